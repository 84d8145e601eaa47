"""The build pipeline: warm prompts -> keys -> prefill -> snapshot files in a store."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvsnap.errors import KvsnapError, SnapshotError, TemplateError
from kvsnap.key import DigestCache, ModelIdentity, prompt_identity, snapshot_key
from kvsnap.runtime.modeling import LoadedModel
from kvsnap.runtime.prefill import prefill
from kvsnap.prompts import Tokenization, WarmPrompt, WarmPromptSet, resolve_chat_template, warm_prefix
from kvsnap.runtime.writeback import manifest_entry, profile_record_id, put_snapshot, record_upsert
from kvsnap.store.local import Store

Progress = Callable[[str, str], None]  # (event, entry name)


@dataclass
class EntryResult:
    name: str
    status: str  # built | reused | failed
    key: str = ""
    n_tokens: int = 0
    entry_tokens: int = 0
    coverage: float = 0.0
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    warnings: tuple[str, ...] = ()


@dataclass
class BuildReport:
    store: Path
    model_digest: str
    entries: list[EntryResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(1 for e in self.entries if e.status == status)

    @property
    def ok(self) -> bool:
        return not self.problems and self.count("failed") == 0


def capture_snapshot(
    lm: LoadedModel,
    store: Store,
    identity: ModelIdentity,
    prompt: WarmPrompt,
    prompt_digest: str,
    tokens: Sequence[int],
    on_commit: Callable[[Path], None] | None = None,
    tokenization: dict | None = None,
) -> Path:
    """Prefill ``tokens``, check the state holds exactly them, and commit the file. Returns its path.

    ``on_commit(path)`` runs under the store lock right after the file lands, so a
    manifest record written there is in place before a concurrent ``gc`` can look.
    """
    cache = prefill(lm, tokens)
    store.fault("after-prefill")
    return put_snapshot(lm, store, identity, prompt, prompt_digest, tokens, cache, tokenization, on_commit)


def _without_time(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "updated"}


def build_snapshots(
    lm: LoadedModel,
    prompts: WarmPromptSet,
    store: Store,
    agents_file: str,
    force: bool = False,
    progress: Progress | None = None,
    digests: DigestCache | None = None,
    tokenization: Tokenization | None = None,
) -> BuildReport:
    """Build (or reuse) one snapshot per valid warm prompt; never raises for one bad entry.

    ``tokenization``: the request path of the server the snapshots are for (default:
    kvsnap's own; ``kvsnap build --for vllm-mlx`` passes vllm-mlx's).
    """
    progress = progress or (lambda event, name: None)
    started = time.perf_counter()
    store.read_manifest()  # a damaged manifest stops the build before any prefill (StoreError)
    identity = lm.identity(digests)
    store.fault("model-loaded")  # marks the start of the window crash tests kill in
    report = BuildReport(store=store.root, model_digest=identity.digest, problems=[str(p) for p in prompts.problems])
    build = _Build(lm, store, identity, agents_file, tokenization, force)
    for prompt in prompts.entries:
        t0 = time.perf_counter()
        progress("start", prompt.name)
        result = EntryResult(name=prompt.name, status="failed")
        try:
            build.entry(prompt, result)
        except KvsnapError as exc:
            result.status, result.error = "failed", str(exc)
        result.seconds = time.perf_counter() - t0
        report.entries.append(result)
        progress(result.status, prompt.name)
    build.drop_departed({p.name for p in prompts.entries})
    report.seconds = time.perf_counter() - started
    return report


@dataclass
class _Build:
    """What every entry of one build shares: the model, the store, the manifest record."""

    lm: LoadedModel
    store: Store
    identity: ModelIdentity
    agents_file: str
    tokenization: Tokenization | None
    force: bool

    def __post_init__(self) -> None:
        self.profile = self.tokenization.descriptor() if self.tokenization is not None else None
        self.rid = profile_record_id(self.identity.digest, self.agents_file, self.profile)

    def entry(self, prompt: WarmPrompt, result: EntryResult) -> None:
        """One warm prompt: its prefix and key, then its snapshot reused when sound, else built.

        Fills ``result`` as it goes, so a failure still reports what was known (tokens, key)."""
        lm, store = self.lm, self.store
        prefix = warm_prefix(lm.tokenizer, prompt, self.tokenization)
        tokens = prefix.tokens
        result.n_tokens, result.entry_tokens, result.coverage, result.warnings = len(tokens), prefix.entry_tokens, prefix.coverage, prefix.warnings
        if not tokens:
            raise TemplateError(f"{prompt.name}: the chat template leaves no token shared by every continuation; nothing to snapshot")
        prompt_digest = prompt_identity(resolve_chat_template(lm.tokenizer, prompt.tools), prompt.chat_template_kwargs, prompt.tools, self.profile)
        result.key = snapshot_key(self.identity, prompt_digest, tokens)

        def commit(written: Path, status: str) -> None:
            result.status, result.nbytes = status, written.stat().st_size
            self.record(result, prompt_digest)

        if not self.force and self.reuse(prompt.name, store.path_for(result.key), commit, result):
            return
        capture_snapshot(lm, store, self.identity, prompt, prompt_digest, tokens, on_commit=lambda written: commit(written, "built"), tokenization=self.profile)

    def reuse(self, name: str, path: Path, commit: Callable[[Path, str], None], result: EntryResult) -> bool:
        """Keep the snapshot already at ``path`` if it verifies; a bad one is replaced (with a warning)."""
        with self.store.lock():
            if not (path.exists() or path.is_symlink()):
                return False
            try:
                self.store.verify_file(path, self.identity)
            except SnapshotError as exc:
                result.warnings += (f"{name}: replacing a bad snapshot ({exc.reason})",)
                return False
            commit(path, "reused")
            return True

    def record(self, result: EntryResult, prompt_digest: str) -> None:
        """Put this entry in the manifest record; under the store lock, so the file and its record appear together for gc."""
        update = record_upsert(self.lm, self.identity, self.agents_file, manifest_entry(result.name, result.key, result.n_tokens, round(result.coverage, 4), prompt_digest, self.profile))
        current = self.store.read_manifest()["records"].get(self.rid, {})
        if _without_time(update(current)) != _without_time(current):  # an unchanged rebuild writes nothing
            self.store.update_record(self.rid, update)

    def drop_departed(self, current: set[str]) -> None:
        """Drop records of entries that left the agents file (their files become gc-able),
        but keep entries that merely failed this time; rewrite only when one really left."""
        record = self.store.read_manifest()["records"].get(self.rid)
        if record and any(e.get("name") not in current for e in record.get("entries", [])):
            self.store.update_record(self.rid, lambda r: {**r, "entries": [e for e in r.get("entries", []) if e.get("name") in current]})
