"""The loading policy: which snapshots become pinned prefix entries, which are prefilled, and why.

Runs on the engine thread (it touches mlx). Snapshots matching the model are indexed from
their headers; pinned ones load into memory up to the cache budget, the rest load on first
hit; warm prompts without a valid snapshot are prefilled and written back when the store
is writable.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvsnap.runtime.writeback import commit_snapshot
from kvsnap.errors import KvsnapError, SnapshotError, StoreError
from kvsnap.key import ModelIdentity
from kvsnap.runtime.modeling import LoadedModel
from kvsnap.runtime.prefill import prefill
from kvsnap.runtime.prefix import CheckFn, Entry, PrefixCache
from kvsnap.runtime.warm_recipe import warm_key
from kvsnap.prompts import WarmPromptSet
from kvsnap.snapshot.cache_classes import layers_trimmable
from kvsnap.snapshot.codec import cache_nbytes_of, decode_cache, is_trimmable
from kvsnap.store.local import SnapshotInfo, Store

log = logging.getLogger("kvsnap.runtime.warmup")


@dataclass
class SnapshotCounts:
    indexed: int = 0
    loaded: int = 0
    prefilled: int = 0
    written: int = 0
    rejected: list[dict] = field(default_factory=list)
    write_back: bool = False
    write_back_note: str = ""

    def reject(self, path: str, reason: str) -> None:
        item = {"file": path, "reason": reason}
        if item in self.rejected:
            return
        self.rejected.append(item)
        log.warning("[kvsnap] rejected snapshot %s: %s; falling back to prefill", path, reason)

    def begin_warmup(self) -> None:
        """loaded / prefilled / written add up over re-warms (a re-warm shows as a rise in
        ``loaded``); ``indexed`` is the latest warm-up's; a rejection is listed once."""
        self.indexed = 0

    def as_dict(self) -> dict:
        return {
            "indexed": self.indexed,
            "loaded": self.loaded,
            "prefilled": self.prefilled,
            "written": self.written,
            "rejected": len(self.rejected),
            "rejected_reasons": list(self.rejected),
            "write_back": self.write_back,
            "write_back_note": self.write_back_note,
        }


@dataclass
class WarmTarget:
    name: str
    tokens: tuple[int, ...] | None  # None: read from the snapshot
    info: SnapshotInfo | None
    prompt_digest: str = ""
    prompt: object = None


def warmup_line(report) -> str:
    """The warm-up's log line, in the original warm-prompts wording (kvsnap serve and the vllm-mlx route)."""
    return (
        f"[lifespan] Warm-up done (strict-prefix): {report.completed} completed, {report.skipped} skipped, "
        f"{report.prompt_tokens} prompt tokens in {report.seconds:.2f}s "
        f"({report.from_snapshots} from snapshots, {report.prefilled} prefilled)"
    )


@dataclass
class WarmupReport:
    completed: int = 0
    skipped: int = 0
    from_snapshots: int = 0
    prefilled: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    prefill_concurrency: int = 1  # the configured bound
    max_inflight_prefills: int = 0  # the most warm prompts actually prefilled at once
    over_budget: int = 0  # prefilled but not kept in memory: the cache budget was full
    recipes_reused: int = 0  # warm prompts whose prefix tokens came from their snapshot's recorded recipe
    prefetch_seconds: float = 0.0  # reading the pinned snapshots, overlapped with the model load
    problems: list[str] = field(default_factory=list)

    def summary(self, counts: SnapshotCounts) -> str:
        why = ""
        if counts.rejected:
            reasons = "; ".join(f"{Path(r['file']).name}: {r['reason']}" for r in counts.rejected[:3])
            why = f"; {len(counts.rejected)} snapshot(s) rejected ({reasons})"
        if self.problems:
            why += f"; {len(self.problems)} warm prompt(s) invalid"
        if self.over_budget:
            why += f"; {self.over_budget} over the cache budget (indexed, load on first hit)" if counts.write_back else f"; {self.over_budget} over the cache budget and not kept"
        return warmup_line(self) + why


def probe_writable(folder: Path, fault=None) -> str | None:
    """None if a file can really be created in ``folder``, else why not.

    A real create-and-delete, not ``os.access``: root passes every access check, and a
    read-only mount or a full disk only shows up when writing.
    """
    try:
        if fault is not None:
            fault("write-probe")
        fd, tmp = tempfile.mkstemp(prefix=".tmp-probe-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def open_store(path: str, write_back: bool, counts: SnapshotCounts, fault=None) -> Store | None:
    p = Path(path).expanduser()
    if not p.exists():
        if not write_back:
            counts.write_back_note = f"{p} does not exist and write-back is off"
            return None
        try:
            return Store.open(p, create=True, fault=fault)
        except (OSError, StoreError) as exc:
            counts.write_back_note = f"cannot create {p}: {exc}"
            return None
    if not write_back:
        counts.write_back_note = "write-back disabled (--no-write-back)"
        return Store.open(p, readonly=True)
    folder = Store(root=p).snapshots_dir if Store(root=p).snapshots_dir.is_dir() else p
    why = probe_writable(folder, fault)
    if why is not None:
        counts.write_back_note = f"{p} is not writable here ({why}): prefilled warm prompts are served but not written back"
        log.warning("[kvsnap] %s", counts.write_back_note)
        return Store.open(p, readonly=True)
    return Store.open(p, create=True, fault=fault)


def make_entry(lm: LoadedModel, store: Store, info: SnapshotInfo, pinned: bool, prefetched=None, pool=None, check: CheckFn | None = None) -> Entry:
    """A prefix entry for a snapshot, only indexed: it loads when pinned within budget, else on first hit.

    ``prefetched``: arrays read while the model loaded (``prefetch.Prefetched``), taken once.
    ``pool``: where a record's blocks are held, once for every entry that shares them.
    ``check``: why a loaded state does not fit the model (a load error), or None."""
    tokens = tuple(store.read_tokens(info))
    loader = snapshot_loader(store, info, prefetched, pool, check)
    return Entry(tokens=tokens, state=None, nbytes=info.nbytes, trimmable=layers_trimmable(info.layers, str(info.path)), pinned=pinned, source="snapshot", name=info.name, key=info.key, loader=loader)


def snapshot_loader(store: Store, info: SnapshotInfo, prefetched=None, pool=None, check: CheckFn | None = None) -> Callable[[], tuple]:
    """Loads one snapshot's cache state: from ``prefetched`` when it was read already, else from
    the file. A record with a ``pool`` stays as its shared blocks (a ``ComposedState``); its
    size is what its blocks added to the pool. A state ``check`` refuses is a SnapshotError."""

    def load():
        arrays = prefetched.take(info) if prefetched is not None else None
        if info.chain is not None and pool is not None:
            from kvsnap.runtime.composed import load_composed

            loaded = arrays if isinstance(arrays, tuple) else load_composed(store, info, pool)
            return _checked(loaded, info, check)
        if arrays is None:
            arrays = store.load_arrays(info)
        _checked((arrays, 0), info, check)  # before decoding: the arrays are what a forger wrote
        state = decode_cache(arrays, info.layers)
        return state, cache_nbytes_of(state)

    return load


SHAPE_FIX = "it was not built for this model's cache (forged or damaged); rebuild it with `kvsnap build`"


def _checked(loaded: tuple, info: SnapshotInfo, check: CheckFn | None) -> tuple:
    """``loaded`` if its state fits the model, else a SnapshotError naming the record and the tensor."""
    why = check(loaded[0]) if check is not None else None
    if why:
        raise SnapshotError(str(info.path), why, SHAPE_FIX)
    return loaded


def checkpoint_loader(store: Store, info: SnapshotInfo, end: int, checkpoint_key: str, pool, check: CheckFn | None = None) -> Callable[[], tuple]:
    """Loads a record's state at one of its checkpoints: its blocks up to ``end`` and the checkpoint there."""
    from kvsnap.runtime.composed import load_composed

    return lambda: _checked(load_composed(store, info, pool, end, checkpoint_key), info, check)


def checkpoint_entries(store: Store, good: dict[str, SnapshotInfo], pool, check: CheckFn | None = None) -> list[Entry]:
    """Hybrid models restore only at checkpoints: one entry (indexed, loaded on first hit) per
    checkpoint inside a record -- a branch point or every C tokens -- so a request that shares an
    agent's preamble but not its tail still starts from the preamble. Records sharing a
    checkpoint share its entry."""
    seen: dict[tuple, Entry] = {}
    for info in good.values():
        if info.chain is None or layers_trimmable(info.layers, str(info.path)):
            continue  # whole files have no checkpoints; trimmable prefixes hit at any token already
        per_token = info.nbytes / max(1, info.n_tokens)
        for key, end in info.chain.checkpoints:
            tokens = tuple(info.tokens[:end])
            if end < info.n_tokens and tokens not in seen:
                seen[tokens] = Entry(tokens=tokens, state=None, nbytes=int(per_token * end), trimmable=False, pinned=False, source="snapshot", name=f"{info.name}@{end}", key=key, loader=checkpoint_loader(store, info, end, key, pool, check), inner=True)
    return list(seen.values())


PrefillFn = Callable[[Sequence[Sequence[int]]], list]  # token lists -> one cache per list


def run_warmup(
    lm: LoadedModel,
    prefix: PrefixCache,
    identity: ModelIdentity,
    counts: SnapshotCounts,
    store: Store | None,
    prompts: WarmPromptSet | None,
    agents_file: str | None,
    budget_bytes: int,
    allow_prefill: bool = True,
    prefill_many: PrefillFn | None = None,
    concurrency: int = 1,
    prefetched=None,
    pool=None,
) -> WarmupReport:
    """Index the store, pin the warm entries, prefill (at most ``concurrency`` at once) what has no snapshot.

    ``prefill_many`` runs one group of warm prefixes; by default one after another with
    the shared ``prefill``, so a written-back snapshot holds the bytes ``kvsnap build``
    would write.
    """
    t0 = time.perf_counter()
    counts.begin_warmup()
    concurrency = max(1, int(concurrency))
    report = WarmupReport(problems=[str(p) for p in (prompts.problems if prompts else [])], prefill_concurrency=concurrency)
    from kvsnap.runtime.composed import BlockPool

    if prefix.check_state is None:  # every state served is checked against the model's own cache
        from kvsnap.runtime.state_shapes import ModelShapes

        prefix.check_state = ModelShapes(lm).problem
    run = _Warmup(lm, prefix, identity, counts, store, report, budget_bytes, pool=pool if pool is not None else BlockPool())
    good = run.scan(prefetched)
    if prompts is not None:
        targets, stale_keys = run.targets(prompts, good)
    else:
        targets, stale_keys = [WarmTarget(i.name, None, i) for i in good.values()], set()
    to_prefill, pinned_keys = run.pin(targets)
    run.index_unnamed(good, pinned_keys | stale_keys)
    writable = store is not None and not store.readonly and bool(agents_file)
    if store is not None and not store.readonly and not agents_file and to_prefill:
        counts.write_back_note = "no warm-prompt file was given, so prefilled warm prompts are not written back (the manifest records the file)"
    if not allow_prefill:
        report.skipped += len(to_prefill)
        to_prefill = []
    prefill_many = prefill_many or (lambda group: [prefill(lm, tokens) for tokens in group])
    for start in range(0, len(to_prefill), concurrency):
        group = to_prefill[start : start + concurrency]
        report.max_inflight_prefills = max(report.max_inflight_prefills, len(group))
        for t, cache in zip(group, prefill_many([t.tokens for t in group])):
            run.keep_prefilled(t, cache, run.write_back(t, cache, agents_file) if writable else None)
            del cache
    counts.write_back = writable
    report.seconds = time.perf_counter() - t0
    return report


@dataclass
class _Warmup:
    """One warm-up's state, so each step of ``run_warmup`` is a method of its own."""

    lm: LoadedModel
    prefix: PrefixCache
    identity: ModelIdentity
    counts: SnapshotCounts
    store: Store | None
    report: WarmupReport
    budget_bytes: int
    prefetched: object = None
    pool: object = None  # runtime.composed.BlockPool: a record's blocks, held once

    def scan(self, prefetched) -> dict[str, SnapshotInfo]:
        """The store's snapshots of this model by key; the others are reported as rejected."""
        store, counts = self.store, self.counts
        if store is None:
            return {}
        if prefetched is not None and prefetched.root == store.root:
            self.prefetched = prefetched
            infos, bad = prefetched.scan(self.identity)  # the headers were read while the model loaded
        else:
            from kvsnap.runtime.prefetch import context_tokens

            infos, bad = store.scan(self.identity, max_tokens=context_tokens(self.lm.path))
        for problem in bad:
            counts.reject(str(problem.path), problem.reason)
        if store.readonly and not counts.write_back_note:
            counts.write_back_note = f"{store.root} is opened read-only: prefilled warm prompts are not written back"
        return {i.key: i for i in infos}

    def targets(self, prompts: WarmPromptSet, good: dict[str, SnapshotInfo]) -> tuple[list[WarmTarget], set[str]]:
        """Each warm prompt's prefix, key and snapshot (None: to prefill); and the keys its edits made stale."""
        report, lm = self.report, self.lm
        by_recipe = {i.recorded.get("warm_recipe"): i for i in good.values() if i.recorded.get("warm_recipe")}
        targets, stale_keys = [], set()
        for p in prompts.entries:
            try:
                warm = warm_key(lm.tokenizer, self.identity, p, by_recipe=by_recipe)
                report.recipes_reused += warm.recipe_reused
            except KvsnapError as exc:
                report.skipped += 1
                report.problems.append(f"{p.name}: {exc}")
                continue
            tokens, digest = warm.tokens, warm.prompt_digest
            if not tokens:
                report.skipped += 1
                continue
            info = good.get(warm.key)
            if info is None:
                for i in good.values():
                    if i.name == p.name:
                        stale_keys.add(i.key)
                        self.counts.reject(str(i.path), f"stale: no longer matches warm prompt {p.name!r} (its tokens changed); rebuild with `kvsnap build`")
            targets.append(WarmTarget(p.name, tokens, info, digest, p))
        return targets, stale_keys

    def pin(self, targets: list[WarmTarget]) -> tuple[list[WarmTarget], set[str]]:
        """Pin every target that has a snapshot (resident within the budget); returns what is left to prefill."""
        report, counts = self.report, self.counts
        used = self.prefix.current_bytes
        to_prefill, pinned_keys = [], set()
        for t in targets:
            if t.info is None:
                to_prefill.append(t)
                continue
            try:
                entry = make_entry(self.lm, self.store, t.info, pinned=True, prefetched=self.prefetched, pool=self.pool, check=self.prefix.check_state)
                if used + t.info.nbytes <= self.budget_bytes:
                    entry.state, entry.nbytes = entry.loader()
                    entry.resident = True
                    used += entry.nbytes
                    counts.loaded += 1
                self.prefix.add(entry)
                pinned_keys.add(t.info.key)
                report.from_snapshots += 1
                report.completed += 1
                report.prompt_tokens += len(entry.tokens)
            except SnapshotError as exc:
                counts.reject(exc.path, exc.reason)
                if t.tokens is not None:
                    to_prefill.append(t)
                else:
                    report.skipped += 1
        return to_prefill, pinned_keys

    def index_unnamed(self, good: dict[str, SnapshotInfo], skip_keys: set[str]) -> None:
        """Snapshots of this model that no warm prompt names: indexed, loaded on first hit."""
        for info in good.values():
            if info.key in skip_keys:
                continue
            try:
                self.prefix.add(make_entry(self.lm, self.store, info, pinned=False, pool=self.pool, check=self.prefix.check_state))
            except SnapshotError as exc:
                self.counts.reject(exc.path, exc.reason)
        if self.store is not None:
            for entry in checkpoint_entries(self.store, good, self.pool, self.prefix.check_state):
                self.prefix.add(entry)
        self.counts.indexed = sum(1 for e in self.prefix.entries if e.loader is not None)

    def write_back(self, t: WarmTarget, cache: list, agents_file: str) -> Path | None:
        try:
            written = commit_snapshot(self.lm, self.store, self.identity, t.prompt, t.prompt_digest, t.tokens, cache, agents_file)
        except (StoreError, SnapshotError, OSError) as exc:
            self.counts.write_back_note = f"write-back failed: {exc}"
            log.warning("[kvsnap] %s", self.counts.write_back_note)
            return None
        self.counts.written += 1
        return written

    def keep_prefilled(self, t: WarmTarget, cache: list, written: Path | None) -> None:
        """A prefilled warm prompt: pinned in memory within the budget, else indexed from the file just written."""
        store, report = self.store, self.report
        self.counts.prefilled += 1
        report.prefilled += 1
        report.completed += 1
        report.prompt_tokens += len(t.tokens)
        nbytes = cache_nbytes_of(cache)
        if self.prefix.current_bytes + nbytes <= self.budget_bytes:
            entry = Entry(tokens=t.tokens, state=cache, nbytes=nbytes, trimmable=is_trimmable(cache), pinned=True, source="prefill", name=t.name, resident=True)
            if written is not None:
                # A re-warm reads it back instead of prefilling again; its header is read only then.
                entry.loader = lambda path=written: snapshot_loader(store, store.inspect(path), pool=self.pool, check=self.prefix.check_state)()
            self.prefix.add(entry)
            return
        # Over the memory budget: keep it indexed from the file just written (loads on
        # first hit), or, with nowhere to reload it from, let it go.
        report.over_budget += 1
        if written is not None:
            try:
                self.prefix.add(make_entry(self.lm, store, store.inspect(written), pinned=True, pool=self.pool, check=self.prefix.check_state))
            except SnapshotError as exc:
                self.counts.reject(exc.path, exc.reason)
