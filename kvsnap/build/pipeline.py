"""The build pipeline: warm prompts -> keys -> prefill -> snapshot files in a store."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

from kvsnap.build.record_batch import RecordBatch
from kvsnap.chat import Tokenization
from kvsnap.errors import KvsnapError, SnapshotError, StoreError, TemplateError
from kvsnap.key import DigestCache, ModelIdentity
from kvsnap.prompts import WarmPrompt, WarmPromptSet
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.persist.writeback import (
    ChainPlan,
    manifest_entry,
    profile_record_id,
    put_snapshot,
    record_upsert,
)
from kvsnap.runtime.prefill.chunked import prefill_in_blocks
from kvsnap.snapshot.blocks import BlockSettings, branch_points
from kvsnap.store.fileio import check_store_folders
from kvsnap.store.local import Store
from kvsnap.warm_key import warm_key

Progress = Callable[[str, str], None]  # (event, entry name)
# (entry name, tokens done, the prompt's tokens): restored ones first, then after each chunk
TokenProgress = Callable[[str, int, int], None]


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
    cut: str = ""  # an agent body's entry: where its shared prefix was cut
    tokens_reused: int = 0  # restored from blocks already in the store
    tokens_prefilled: int = 0
    blocks_written: int = 0  # blocks and checkpoints this entry added
    bytes_written: int = 0  # of those, and of its record


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
    plan: ChainPlan | None = None,
    start: tuple[int, list | None] = (0, None),
    on_tokens: Callable[[int], None] | None = None,
    prefiller: Prefiller | None = None,
) -> Path:
    """Prefill ``tokens`` from ``start`` (a restored (token count, cache), default nothing) one
    block at a time, capturing checkpoints where the chain has them, then commit the parts the
    store lacks and the record. Returns the record's path.

    Prefilling block by block makes every block's bytes the same whichever prefix was reused.
    ``on_commit(path)`` runs under the store lock right after the record lands, so whatever
    lists the record there (the build's pending file) is in place before a concurrent ``gc``
    can look. ``on_tokens(n)`` after each prefill chunk of ``n`` tokens.
    """
    from kvsnap.snapshot.codec import encode_cache

    plan = plan or ChainPlan()
    done, cache = start
    whole = set(lm_whole_tensor_classes(lm))
    links = plan.links(identity, tokens, bool(whole), captured_only=False)
    checkpoints = (
        {link.end for link in links if link.checkpoint_key and link.end < len(tokens)}
        if whole
        else set()
    )

    def capture(end: int, state: list) -> None:
        if end in checkpoints:
            arrays, layers = encode_cache(state, tokens[:end])
            kept = {k: v for k, v in arrays.items() if k.split(".")[0] in whole}
            mx_eval(kept)
            plan.checkpoints[end] = (kept, layers)

    ends = [link.end for link in links]
    prefill = prefiller or local_prefill
    cache = prefill(lm, tokens, ends, cache, done, capture, on_tokens, frozenset(checkpoints))
    store.fault("after-prefill")
    return put_snapshot(
        lm, store, identity, prompt, prompt_digest, tokens, cache, tokenization, on_commit, plan
    )


class Prefiller(Protocol):
    """How a build prefills one entry block by block: ``prefill_in_blocks``'s arguments, plus the
    block ends whose state ``on_end`` needs (a sharded build gathers only those from its ranks).
    ``restores``: whether it can continue from a prefix restored from the store."""

    restores: bool

    def __call__(
        self,
        lm: LoadedModel,
        tokens: Sequence[int],
        ends: Sequence[int],
        cache: list | None,
        start: int,
        on_end: Callable[[int, list], None] | None,
        on_tokens: Callable[[int], None] | None,
        gather_at: frozenset = frozenset(),
    ) -> list: ...


class _LocalPrefill:
    """One process: ``prefill_in_blocks`` itself."""

    restores = True

    def __call__(self, lm, tokens, ends, cache, start, on_end, on_tokens, gather_at=frozenset()):
        return prefill_in_blocks(lm, tokens, ends, cache, start, on_end, on_tokens)


local_prefill = _LocalPrefill()


def lm_whole_tensor_classes(lm: LoadedModel) -> list[str]:
    """Layer indexes (as tensor-name prefixes) only a checkpoint can restore."""
    from kvsnap.snapshot.cache_classes import CACHE_CLASSES

    return [
        str(i)
        for i, name in enumerate(lm.layout)
        if not (name in CACHE_CLASSES and CACHE_CLASSES[name].sliceable)
    ]


def mx_eval(arrays: dict) -> None:
    import mlx.core as mx

    mx.eval(list(arrays.values()))


def build_snapshots(
    lm: LoadedModel,
    prompts: WarmPromptSet,
    store: Store,
    agents_file: str,
    force: bool = False,
    progress: Progress | None = None,
    digests: DigestCache | None = None,
    tokenization: Tokenization | None = None,
    blocks: BlockSettings | None = None,
    on_tokens: TokenProgress | None = None,
    prefiller: Prefiller | None = None,
) -> BuildReport:
    """Build (or reuse) one snapshot per valid warm prompt; never raises for one bad entry.

    ``tokenization``: the request path of the server the snapshots are for (default:
    kvsnap's own; ``kvsnap build --for vllm-mlx`` passes vllm-mlx's). ``blocks``: block and
    checkpoint spacing (default 256 / 1,024 tokens). ``on_tokens(name, done, total)``: an
    entry's progress through its prompt's tokens, as it prefills. ``prefiller``: how an entry
    is prefilled (default: here; ``kvsnap build`` under mlx.launch: across the ranks).
    """
    progress = progress or (lambda event, name: None)
    started = time.perf_counter()
    store.read_manifest()  # a damaged manifest stops the build before any prefill (StoreError)
    # every reader refuses a store folder that is a link: a build never writes through one
    check_store_folders(store.root)
    identity = lm.identity(digests)
    store.fault("model-loaded")  # marks the start of the window crash tests kill in
    report = BuildReport(
        store=store.root, model_digest=identity.digest, problems=[str(p) for p in prompts.problems]
    )
    build = _Build(
        lm,
        store,
        identity,
        agents_file,
        tokenization,
        force,
        blocks or BlockSettings(),
        on_tokens,
        prefiller or local_prefill,
    )
    results = {
        prompt.name: EntryResult(name=prompt.name, status="failed") for prompt in prompts.entries
    }
    planned = {}
    for prompt in prompts.entries:  # every prefix first: the branch points need them all
        try:
            planned[prompt.name] = build.plan(prompt, results[prompt.name])
        except KvsnapError as exc:
            results[prompt.name].error = str(exc)
    branches = dict(zip(planned, branch_points([p.tokens for p in planned.values()])))
    splits = build.split_points({name: p.tokens for name, p in planned.items()}, branches)
    try:
        for prompt in prompts.entries:
            t0 = time.perf_counter()
            progress("start", prompt.name)
            result = results[prompt.name]
            if prompt.name in planned:
                try:
                    build.entry(
                        planned[prompt.name],
                        frozenset(branches[prompt.name]),
                        splits[prompt.name],
                        result,
                    )
                except KvsnapError as exc:
                    result.status, result.error = "failed", str(exc)
            result.seconds = time.perf_counter() - t0
            report.entries.append(result)
            progress(result.status, prompt.name)
            if build.batch.due():
                build.flush(results, report)
        # entries that left the agents file leave the record (their files become gc-able);
        # entries that merely failed this time stay
        build.flush(results, report, keep={p.name for p in prompts.entries})
    finally:
        build.close(results, report)
    report.seconds = time.perf_counter() - started
    return report


@dataclass
class _Planned:
    prompt: WarmPrompt
    tokens: list
    prompt_digest: str


@dataclass
class _Build:
    """What every entry of one build shares: the model, the store, the manifest record."""

    lm: LoadedModel
    store: Store
    identity: ModelIdentity
    agents_file: str
    tokenization: Tokenization | None
    force: bool
    blocks: BlockSettings
    on_tokens: TokenProgress | None = None
    prefiller: Prefiller = local_prefill

    def __post_init__(self) -> None:
        self.profile = self.tokenization.descriptor() if self.tokenization is not None else None
        self.rid = profile_record_id(self.identity.digest, self.agents_file, self.profile)
        self.hybrid = bool(lm_whole_tensor_classes(self.lm))
        self.batch = RecordBatch(
            self.store,
            self.rid,
            lambda record, entry: record_upsert(self.lm, self.identity, self.agents_file, entry)(
                record
            ),
        )

    def plan(self, prompt: WarmPrompt, result: EntryResult) -> _Planned:
        """A warm prompt's prefix, digest and key (fills ``result`` as it goes, so a failure still
        reports them)."""
        warm = warm_key(self.lm.tokenizer, self.identity, prompt, self.tokenization)
        tokens, prefix = warm.tokens, warm.prefix
        result.n_tokens = len(tokens)
        result.cut = prompt.cut or ""
        # a build reuses no recipe, so the prefix is always rendered here
        if prefix is not None:
            result.entry_tokens, result.coverage, result.warnings = (
                prefix.entry_tokens,
                prefix.coverage,
                prefix.warnings,
            )
        if not tokens:
            raise TemplateError(
                f"{prompt.name}: the chat template leaves no token shared by every continuation; "
                f"nothing to snapshot"
            )
        result.key = warm.key
        return _Planned(prompt, list(tokens), warm.prompt_digest)

    def entry(
        self, planned: _Planned, branches: frozenset, splits: frozenset, result: EntryResult
    ) -> None:
        """One warm prompt: its record reused when sound; else the longest chain of blocks the
        store has is restored and only the rest prefilled, block by block."""
        store, prompt, tokens = self.store, planned.prompt, planned.tokens

        def commit(written: Path, status: str) -> None:
            result.status = status
            self.record(result, planned.prompt_digest)

        if not self.force and self.reuse(prompt.name, store.path_for(result.key), commit, result):
            result.tokens_reused = len(tokens)
            return
        plan = ChainPlan(self.blocks, branches, splits=splits)
        start: tuple[int, list | None] = (0, None)
        replace: set[str] = set()
        if not self.force and self.prefiller.restores:
            start, replace, warnings = restore_longest(
                self.lm, store, self.identity, tokens, plan, self.hybrid
            )
            result.warnings += warnings
        plan.replace = replace if not self.force else None
        path = capture_snapshot(
            self.lm,
            store,
            self.identity,
            prompt,
            planned.prompt_digest,
            tokens,
            on_commit=lambda written: commit(written, "built"),
            tokenization=self.profile,
            plan=plan,
            start=start,
            on_tokens=self.count_tokens(prompt.name, start[0], len(tokens)),
            prefiller=self.prefiller,
        )
        result.tokens_reused, result.tokens_prefilled = start[0], len(tokens) - start[0]
        result.blocks_written = plan.written.blocks + plan.written.checkpoints
        result.bytes_written = plan.written.nbytes + path.stat().st_size
        result.nbytes = result.bytes_written

    def count_tokens(self, name: str, done: int, total: int) -> Callable[[int], None] | None:
        """The chunk callback that reports ``name``'s tokens done so far (restored ones now)."""
        report = self.on_tokens
        if report is None:
            return None
        report(name, done, total)
        so_far = done

        def chunk(n: int) -> None:
            nonlocal so_far
            so_far += n
            report(name, so_far, total)

        return chunk

    def split_points(
        self, prefixes: dict[str, list], branches: dict[str, set]
    ) -> dict[str, frozenset]:
        """Per prefix, the branch points its chain is also cut at, so siblings that leave each
        other inside a block store that block's shared head once instead of once each.

        A branch point past the first block is cut at when the block around it is not stored
        whole along this prefix (a stored block is never re-cut: a rebuild finds it) and the
        head before it is shared: another prefix leaves there inside the same unstored block or
        ends there, or the head is already stored. So a prefix built alone, or beside prefixes
        that share only blocks already stored whole, keeps the plain grid."""
        from kvsnap.snapshot.format import BLOCK_KIND
        from kvsnap.store.paths import has_part

        def grid(tokens: list, splits: frozenset = frozenset()) -> list:
            plan = ChainPlan(self.blocks, splits=splits)
            return plan.links(self.identity, tokens, self.hybrid, captured_only=False)

        wanted: dict[tuple[int, str], list] = {}  # (depth, prefix digest) -> who would cut there
        for name, tokens in prefixes.items():
            links = grid(tokens)
            wanted.setdefault((len(tokens), links[-1].prefix_digest), []).append(None)
            # past the first block only: a branch inside it (a chat template's header, a short
            # opening) is worth neither a block nor, for hybrids, a checkpoint of its own
            for d in sorted(x for x in branches[name] if x >= self.blocks.block_tokens):
                cell = next((x for x in links if x.start < d < x.end), None)
                if cell is None or has_part(self.store, BLOCK_KIND, cell.key):
                    continue  # already a block end, or a stored block a rebuild will find
                head = next(x for x in grid(tokens, frozenset({d})) if x.end == d)
                wanted.setdefault((d, head.prefix_digest), []).append((name, d, head.key))
        out: dict[str, set] = {name: set() for name in prefixes}
        for group in wanted.values():
            for who in group:
                if who is not None and (len(group) > 1 or has_part(self.store, BLOCK_KIND, who[2])):
                    out[who[0]].add(who[1])
        return {name: frozenset(ds) for name, ds in out.items()}

    def reuse(
        self, name: str, path: Path, commit: Callable[[Path, str], None], result: EntryResult
    ) -> bool:
        """Keep the record already at ``path`` if it and every part it names verify; a bad one is
        replaced (with a warning)."""
        with self.store.lock():
            if not (path.exists() or path.is_symlink()):
                return False
            try:
                info = self.store.verify_file(path, self.identity)
            except SnapshotError as exc:
                result.warnings += (f"{name}: replacing a bad snapshot ({exc.reason})",)
                return False
            result.nbytes = info.nbytes
            commit(path, "reused")
            return True

    def record(self, result: EntryResult, prompt_digest: str) -> None:
        """Put this entry in the next manifest write; under the store lock, so the file and its
        listing (the batch's pending file until then) appear together for gc."""
        self.batch.add(
            manifest_entry(
                result.name,
                result.key,
                result.n_tokens,
                round(result.coverage, 4),
                prompt_digest,
                self.profile,
            )
        )

    def flush(
        self, results: dict[str, EntryResult], report: BuildReport, keep: set[str] | None = None
    ) -> None:
        """Write the batch into the manifest record (an unchanged record is not rewritten); when
        that fails, the entries it held fail with the reason (their files are written, unlisted,
        and the next build reuses them)."""
        names = list(self.batch.pending)
        try:
            self.batch.flush(keep)
        except StoreError as exc:
            for name in names:
                results[name].status = "failed"
                results[name].error = (
                    f"{name}: its snapshot was written but the manifest could not list it "
                    f"({exc}); run the build again: it reuses the snapshot"
                )
            if not names:
                report.problems.append(str(exc))

    def close(self, results: dict[str, EntryResult], report: BuildReport) -> None:
        """List what is still pending (a build stopped by an error), then remove the pending
        file."""
        try:
            self.flush(results, report)
        finally:
            self.batch.close()


def restore_longest(
    lm: LoadedModel,
    store: Store,
    identity: ModelIdentity,
    tokens: Sequence[int],
    plan: ChainPlan,
    hybrid: bool,
) -> tuple[tuple[int, list | None], set, tuple[str, ...]]:
    """The longest prefix of ``tokens`` the store's blocks (and, for hybrids, a checkpoint) restore:
    ((token count, cache or None), keys of bad parts to rewrite, warnings).

    A block or checkpoint that fails its checks is named in a warning and the chain is
    prefilled from the last good restore point before it."""
    from kvsnap.snapshot.blocks import kv_form_at
    from kvsnap.snapshot.codec import decode_cache
    from kvsnap.snapshot.format import BLOCK_KIND, CHECKPOINT_KIND
    from kvsnap.store.checking import check_checkpoint
    from kvsnap.store.paths import has_part
    from kvsnap.store.reading import assemble_state

    links = plan.links(identity, tokens, hybrid, captured_only=False)
    present = []
    for link in links:
        if not has_part(store, BLOCK_KIND, link.key):
            break
        present.append(link)
    points = [
        link
        for link in present
        if (not hybrid or has_part(store, CHECKPOINT_KIND, _checkpoint_key(identity, link)))
        # a quantized chain restores only where a fresh prefill has quantized too
        and kv_form_at(link.end, identity) == link.form
    ]
    replace: set = set()
    warnings: tuple[str, ...] = ()
    if hybrid:
        # The restore reads only the checkpoint it restores at: check every other one here, and
        # restore from before the first bad one, so the prefill recaptures it and it is rewritten.
        bad_ends = []
        for link in points:
            key = _checkpoint_key(identity, link)
            try:
                check_checkpoint(store, key, identity.digest, link.end, link.prefix_digest)
            except SnapshotError as exc:
                replace.add(key)
                bad_ends.append(link.end)
                warnings += (f"replacing a bad checkpoint ({exc.path}: {exc.reason})",)
        points = [link for link in points if not bad_ends or link.end < bad_ends[0]]
        # checkpoints the plan wants that are already stored (and sound) stay in the record's chain
        plan.stored = {link.end for link in points if link.checkpoint_key}
    while points:
        point = points[-1]
        upto = [
            (link.key, link.start, link.end, link.prefix_digest)
            for link in present
            if link.end <= point.end
        ]
        checkpoint = _checkpoint_key(identity, point) if hybrid else None
        try:
            arrays, layers = assemble_state(
                store, str(store.root), identity.digest, tokens, upto, checkpoint, None
            )
        except SnapshotError as exc:
            bad = Path(exc.path).stem
            replace.add(bad)
            warnings += (f"replacing a bad block or checkpoint ({exc.path}: {exc.reason})",)
            points = [p for p in points if p.end < _end_of(present, bad, point.end)]
            plan.stored = {end for end in plan.stored if end < _end_of(present, bad, point.end)}
            continue
        warnings += _bad_past(store, identity, links, point.end, replace)
        return (point.end, decode_cache(arrays, layers)), replace, warnings
    warnings += _bad_past(store, identity, links, 0, replace)
    return (0, None), replace, warnings


def _bad_past(
    store: Store, identity: ModelIdentity, links: Sequence, done: int, replace: set
) -> tuple[str, ...]:
    """Stored blocks past the restore point are prefilled again but kept when present: add the
    ones that fail their checks to ``replace`` (so they are rewritten); their warnings."""
    from kvsnap.snapshot.format import BLOCK_KIND
    from kvsnap.store.checking import check_part
    from kvsnap.store.paths import has_part

    warnings: tuple[str, ...] = ()
    for link in links:
        if link.start < done or link.key in replace or not has_part(store, BLOCK_KIND, link.key):
            continue
        try:
            check_part(
                store,
                BLOCK_KIND,
                link.key,
                identity.digest,
                link.start,
                link.end,
                link.prefix_digest,
            )
        except SnapshotError as exc:
            replace.add(link.key)
            warnings += (f"replacing a bad block ({exc.path}: {exc.reason})",)
    return warnings


def _checkpoint_key(identity: ModelIdentity, link) -> str:
    from kvsnap.snapshot.blocks import checkpoint_key

    return link.checkpoint_key or checkpoint_key(identity.digest, link.prefix_digest, link.form)


def _end_of(links: Sequence, key: str, default: int) -> int:
    """Where the block with ``key`` starts being needed: restore points must end before its end
    (a bad checkpoint at ``default`` rules out only that point)."""
    for link in links:
        if link.key == key:
            return link.start + 1
    return default
