"""A ``--warm-prompts`` warm-up on an upstream server's model, shared by both routes.

For each warm-prompt entry: the warm prefix as the server tokenizes that agent's requests
(its profile, ``kvsnap.profiles``), its key, the store's snapshot when it has one, else one
prefill with kvsnap's ``prefill`` on the model the server loaded, captured exactly at the
prefix boundary and written back when the store is writable. Every warm entry goes into the
server's prefix cache and is pinned there (``WarmPlan._insert``, each route's own: vllm-mlx's
in ``integrations.vllm_mlx.warm_plan``, mlx_lm.server's in ``integrations.mlx_lm.warm``). The
same pass runs at start and for each re-warm.

Runs on the thread that owns the model (mlx arrays belong to a thread's stream).
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvsnap.chat import Tokenization
from kvsnap.errors import KvsnapError, SnapshotError, StoreError, WarmPromptError
from kvsnap.prompts import WarmPrompt, WarmPromptSet, load_warm_prompts, parse_warm_prompts

if TYPE_CHECKING:
    from kvsnap.key import ModelIdentity
    from kvsnap.runtime.cache.shapes import ModelShapes
    from kvsnap.runtime.model.loading import LoadedModel
    from kvsnap.store.local import SnapshotInfo, Store

log = logging.getLogger("kvsnap.integrations")


@dataclass
class AgentResult:
    name: str
    # snapshot | prefilled | skipped
    source: str
    tokens: int = 0
    key: str = ""
    written: bool = False
    reason: str = ""


def upstream_model(model_name: str, model: Any, tokenizer: Any) -> LoadedModel:
    """The model an upstream server (vllm-mlx, mlx_lm.server) loaded, as kvsnap's LoadedModel:
    its folder (a hub id: the cached files it loaded) and config beside the live objects. Its
    live KV is mlx-lm's default cache: no KV quantization, no bound."""
    from kvsnap.key import KVSettings, read_config
    from kvsnap.runtime.model.loading import LoadedModel
    from kvsnap.runtime.model.source import resolve_model

    model_dir = resolve_model(model_name).path
    return LoadedModel(
        path=model_dir,
        model=model,
        tokenizer=tokenizer,
        config=read_config(model_dir),
        settings=KVSettings(),
    )


@dataclass
class WarmReport:
    """What one warm-up (or re-warm) did; tests and ``GET /v1/kvsnap/status`` read this, not the
    log."""

    completed: int = 0
    skipped: int = 0
    from_snapshots: int = 0
    prefilled: int = 0
    written: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    agents: list[AgentResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # A rank of a sharded server other than 0: recorded, not logged (rank 0 says it once).
    quiet: bool = False

    def summary(self) -> str:
        from kvsnap.runtime.warmup.report import warmup_line

        return warmup_line(self)

    def warn(self, text: str) -> None:
        self.warnings.append(text)
        if not self.quiet:
            log.warning("[kvsnap] %s", text)

    def skip(self, name: str, reason: str, tokens: int = 0) -> None:
        self.skipped += 1
        self.agents.append(AgentResult(name=name, source="skipped", tokens=tokens, reason=reason))
        if not self.quiet:
            log.warning("[kvsnap] warm prompt %s skipped: %s", name, reason)

    def as_dict(self) -> dict:
        return asdict(self)


def checked_arrays(
    store: Store, info: SnapshotInfo, identity: ModelIdentity, shapes: ModelShapes
) -> dict:
    """One snapshot read, its arrays checked against this model's cache: a SnapshotError (naming
    file and tensor) when they are not, for a forged block would otherwise fail mlx-lm's
    generation step."""
    return check_shapes(store.load_arrays(info, identity), shapes, str(info.path))


def check_shapes(arrays: dict, shapes: ModelShapes, where: str) -> dict:
    """``arrays`` when they fit this model's cache (before decoding: they are what a forger
    wrote); else a SnapshotError naming ``where`` and the tensor."""
    from kvsnap.runtime.cache.entries import SHAPE_FIX

    why = shapes.problem(arrays)
    if why:
        raise SnapshotError(where, why, SHAPE_FIX)
    return arrays


def checked_state(
    store: Store, info: SnapshotInfo, identity: ModelIdentity, shapes: ModelShapes
) -> list:
    """One snapshot read, checked (``checked_arrays``) and decoded into cache objects."""
    return StateSource().load(store, info, identity, shapes)


class StateSource:
    """How a warm-up reads, agrees on and writes back states: one process reads each snapshot
    whole and writes what it prefilled. A sharded server's ranks each read their slice, agree
    on every entry, and write the logical state gathered from all of them
    (``integrations.mlx_lm.sharded``)."""

    # Whether this process writes prefilled entries back to its store.
    writes = True

    @property
    def quiet(self) -> bool:
        """Whether its reports stay out of the log (a sharded server's ranks but 0 say nothing
        rank 0 says once)."""
        return False

    def begin(self, keys: list[str]) -> None:
        """Called once per warm-up with the keys it will warm, in order, before any is read."""

    def candidates(self, keys: list[str]) -> list[str]:
        """The snapshots to pin, in order, from this process's own store's ``keys``."""
        return keys

    def load(
        self, store: Store, info: SnapshotInfo, identity: ModelIdentity, shapes: ModelShapes
    ) -> list:
        """One snapshot's state as this process's cache holds it; SnapshotError if unusable."""
        from kvsnap.snapshot.codec import decode_cache

        arrays = checked_arrays(store, info, identity, shapes)
        return decode_cache(arrays, info.layers)

    def agree(self, loaded: list[SnapshotInfo | None], reasons: list[str | None]) -> list[bool]:
        """For each entry (its snapshot, or None where this process has none or could not use
        it): whether to use it. One process uses what it loaded."""
        return [reason is None and info is not None for info, reason in zip(loaded, reasons)]

    def logical(self, state: list, tokens: tuple) -> list:
        """The whole-model cache a prefilled ``state`` is written back as."""
        return state


@dataclass
class WarmPlan(ABC):
    """Everything a warm-up needs, fixed at start; ``run`` may be called again for each re-warm.

    Each route subclasses it: ``_insert`` puts an entry into its server's prefix cache,
    ``_min_prefix_tokens`` is the shortest prefix that cache reuses, and ``route_name`` and
    ``build_for`` name the server and its ``kvsnap build --for`` value in messages.
    """

    # The server, as messages name it.
    route_name: ClassVar[str]
    # ``kvsnap build --for`` this server's rendering.
    build_for: ClassVar[str]

    # The server's prefix cache: vllm-mlx's MemoryAwarePrefixCache, mlx-lm's PinnedPromptCache.
    prefix_cache: Any
    # kvsnap's LoadedModel around the model the server loaded.
    lm: LoadedModel
    identity: ModelIdentity
    store: Store
    writable: bool
    prompts: WarmPromptSet
    agents_file: str
    tokenization: Tokenization
    # The shapes of ``lm``'s cache, learned on first use.
    shapes: ModelShapes | None = None
    source: StateSource = field(default_factory=StateSource)

    def run(self) -> WarmReport:
        from kvsnap.runtime.warmup.prefetch import context_tokens

        t0 = time.perf_counter()
        report = WarmReport()
        for problem in self.prompts.problems:
            report.skip(f"entry {problem.index}", str(problem))
        # Foreign and broken files (and records longer than the context): not ours to report
        # per entry.
        infos, _bad = self.store.scan(self.identity, max_tokens=context_tokens(self.lm.path))
        by_key = {info.key: info for info in infos}
        warmed = [
            (prompt, found)
            for prompt in self.prompts.entries
            if (found := self._warm_prefix(prompt, report)) is not None
        ]
        self.source.begin([key for _, (_, _, key) in warmed])
        for prompt, (tokens, digest, key) in warmed:
            info = by_key.get(key) or self._same_tokens(infos, tokens)
            state = self._restore(prompt, info, report)
            source, written = "snapshot", False
            if state is None:
                self._warn_other_renderings(prompt, infos, key, info, report)
                state, source = self._prefill(tokens), "prefilled"
                report.prefilled += 1
                written = self._write_back(prompt, digest, tokens, state, report)
            if self._insert(prompt.name, tokens, state, report):
                report.completed += 1
                report.prompt_tokens += len(tokens)
                report.from_snapshots += source == "snapshot"
                report.agents.append(
                    AgentResult(
                        name=prompt.name,
                        source=source,
                        tokens=len(tokens),
                        key=key,
                        written=written,
                    )
                )
                log.info(
                    "[kvsnap] warm prompt %s: %d tokens %s",
                    prompt.name,
                    len(tokens),
                    "from snapshot " + key
                    if source == "snapshot"
                    else "prefilled" + (", written back as " + key if written else ""),
                )
            del state
        report.seconds = time.perf_counter() - t0
        return report

    def _warm_prefix(self, prompt: WarmPrompt, report: WarmReport) -> tuple[tuple, str, str] | None:
        """(tokens, prompt digest, key) as the server tokenizes this agent; None (and a skip) when
        it cannot be warmed."""
        from kvsnap.warm_key import warm_key

        try:
            warm = warm_key(
                self.lm.tokenizer, self.identity, prompt, self._tokenization_for(prompt)
            )
        except KvsnapError as exc:
            report.skip(prompt.name, str(exc))
            return None
        # The server's own rendering raises jinja's and its own types: one entry must not
        # stop the rest
        except Exception as exc:
            report.skip(
                prompt.name, f"{self.route_name} cannot render it ({type(exc).__name__}: {exc})"
            )
            return None
        tokens = warm.tokens
        min_tokens = self._min_prefix_tokens()
        if len(tokens) < min_tokens:
            report.skip(
                prompt.name,
                f"its warm prefix holds {len(tokens)} tokens, under {self.route_name}'s minimum "
                f"reusable prefix of {min_tokens} tokens",
                len(tokens),
            )
            return None
        return tokens, warm.prompt_digest, warm.key

    def _tokenization_for(self, prompt: WarmPrompt) -> Tokenization:
        """How the server renders this entry's requests: ``tokenization``, unless the server
        has a request path of its own for the entry (an agent body's API)."""
        return self.tokenization

    def _restore(
        self, prompt: WarmPrompt, info: SnapshotInfo | None, report: WarmReport
    ) -> list | None:
        """The entry's state from its snapshot ``info``, or None (then it is prefilled): when it
        has none, or it cannot be used here (or, sharded, on another rank)."""
        from kvsnap.runtime.cache.shapes import ModelShapes

        if self.shapes is None:
            self.shapes = ModelShapes(self.lm)
        state, reason = None, None
        if info is not None:
            try:
                state = self.source.load(self.store, info, self.identity, self.shapes)
            except SnapshotError as exc:
                reason = f"snapshot {exc.path} cannot be used ({exc.reason})"
                report.warn(f"{prompt.name}: {reason}; prefilling instead")
        if not self.source.agree([info], [reason])[0]:
            return None
        return state

    def _warn_other_renderings(
        self,
        prompt: WarmPrompt,
        infos: list[SnapshotInfo],
        key: str,
        info: SnapshotInfo | None,
        report: WarmReport,
    ) -> None:
        """Say so when this agent's snapshot exists but was keyed for another server's rendering."""
        from kvsnap.profiles import describe, recorded_tokenization

        for other in infos:
            if other.name == prompt.name and other.key != key and other is not info:
                report.warn(
                    f"{prompt.name}: snapshot {other.path.name} was built for a rendering "
                    f"{self.route_name} will not use "
                    f"({describe(recorded_tokenization(other.recorded))}; this server tokenizes as "
                    f"{describe(self.tokenization.descriptor())}); "
                    f"prefilling instead; build for it with `kvsnap build … --for {self.build_for}`"
                )

    def _prefill(self, tokens: tuple) -> list:
        from kvsnap.runtime.prefill.chunked import prefill
        from kvsnap.snapshot.codec import check_captured_at

        state = prefill(self.lm, tokens)
        check_captured_at(state, len(tokens))
        return state

    def _write_back(
        self, prompt: WarmPrompt, digest: str, tokens: tuple, state: list, report: WarmReport
    ) -> bool:
        from kvsnap.runtime.persist.writeback import commit_snapshot

        if not self.writable:
            return False
        # Sharded: every rank takes part in gathering the logical state; one per folder writes it.
        state = self.source.logical(state, tokens)
        if not self.source.writes:
            return False
        try:
            commit_snapshot(
                self.lm,
                self.store,
                self.identity,
                prompt,
                digest,
                tokens,
                state,
                self.agents_file,
                tokenization=self.tokenization.descriptor(),
            )
        except (StoreError, SnapshotError, OSError) as exc:
            report.warn(
                f"{prompt.name}: write-back to {self.store.root} failed ({exc}); served from "
                f"memory only"
            )
            return False
        report.written += 1
        return True

    @abstractmethod
    def _insert(self, name: str, tokens: tuple, state: list, report: WarmReport) -> bool:
        """Put one warm entry into the server's prefix cache, pinned; False (and a skip) when the
        cache refuses it."""

    @abstractmethod
    def _min_prefix_tokens(self) -> int:
        """The shortest prefix the server's cache reuses: a shorter warm prefix is skipped."""

    def _same_tokens(self, infos: list[SnapshotInfo], tokens: tuple) -> SnapshotInfo | None:
        """A snapshot of this model holding exactly these tokens, whatever rendering it was keyed
        for.

        The KV state depends only on the model identity (already matched) and the tokens, so
        a snapshot built for kvsnap serve whose tokens equal the server's is exactly right here.
        """
        for info in infos:
            if info.n_tokens != len(tokens):
                continue
            try:
                if tuple(self.store.read_tokens(info)) == tuple(tokens):
                    return info
            except SnapshotError as exc:
                log.debug("[kvsnap] %s: %s", exc.path, exc.reason)
        return None


def load_warm_prompt_file(path: str) -> WarmPromptSet:
    """A warm-prompt file in vllm-mlx's shape (lists of messages) or kvsnap's (objects).

    vllm-mlx lets a list entry end with a user message and warms the text before that
    user's content; kvsnap's probes start a user turn after the entry, which is the same
    prefix, so that trailing user message is dropped here (and said so).
    """
    file = Path(path).expanduser()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        # Its named errors: missing, unreadable, bad JSON.
        return load_warm_prompts(file)
    if isinstance(data, list):
        for i, entry in enumerate(data):
            if (
                isinstance(entry, list)
                and len(entry) > 1
                and isinstance(entry[-1], dict)
                and entry[-1].get("role") == "user"
            ):
                log.info(
                    "[kvsnap] %s entry %d ends with a user message: warming the text before it, as "
                    "vllm-mlx does",
                    file,
                    i,
                )
                data[i] = entry[:-1]
    result = parse_warm_prompts(data, str(file))
    if not result.entries:
        detail = "; ".join(str(p) for p in result.problems[:3]) or "the list is empty"
        raise WarmPromptError(f"{file}: no valid warm-prompt entry ({detail})")
    for problem in result.problems:
        log.warning("[kvsnap] %s: skipped warm prompt %s", file, problem)
    return result
