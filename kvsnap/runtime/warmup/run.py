"""The loading policy: which snapshots become pinned prefix entries, which are prefilled, and why.

Runs on the engine thread (it touches mlx). Snapshots matching the model are indexed from
their headers; pinned ones load into memory up to the cache budget, the rest load on first
hit; warm prompts without a valid snapshot are prefilled and written back when the store
is writable. The entries come from ``cache.entries``, the store from ``warmup.store``, the
report and counts from ``warmup.report``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsnap.errors import KvsnapError, SnapshotError, StoreError
from kvsnap.key import ModelIdentity
from kvsnap.prompts import WarmPrompt, WarmPromptSet
from kvsnap.runtime.cache.composed import BlockPool
from kvsnap.runtime.cache.entries import (
    checkpoint_entries,
    make_entry,
    snapshot_loader,
)
from kvsnap.runtime.cache.prefix import Entry, PrefixCache
from kvsnap.runtime.cache.shapes import ModelShapes
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.persist.writeback import commit_snapshot
from kvsnap.runtime.prefill.chunked import prefill
from kvsnap.runtime.warmup.prefetch import Prefetched, context_tokens
from kvsnap.runtime.warmup.report import (
    SnapshotCounts,
    WarmupReport,
)
from kvsnap.snapshot.codec import cache_nbytes_of, is_trimmable
from kvsnap.snapshot.format import BLOCK_KIND
from kvsnap.store.local import SnapshotInfo, Store
from kvsnap.warm_key import warm_key

log = logging.getLogger("kvsnap.runtime.warmup.run")

PrefillFn = Callable[[Sequence[Sequence[int]]], list]  # token lists -> one cache per list
NO_AGENTS_FILE = (
    "no warm-prompt file was given, so prefilled warm prompts are not written back "
    "(the manifest records the file)"
)


@dataclass
class WarmTarget:
    name: str
    tokens: tuple[int, ...] | None  # None: read from the snapshot
    info: SnapshotInfo | None
    prompt_digest: str = ""
    prompt: WarmPrompt | None = None  # None: a snapshot no warm prompt names

    def to_prefill(self) -> ToPrefill | None:
        """This target as a prefill job; None when it has no prompt to prefill."""
        if self.tokens is None or self.prompt is None:
            return None
        return ToPrefill(self.name, self.tokens, self.prompt, self.prompt_digest)


@dataclass(frozen=True)
class ToPrefill:
    """A warm prompt without a usable snapshot: prefilled, and written back where it can be."""

    name: str
    tokens: tuple[int, ...]
    prompt: WarmPrompt
    prompt_digest: str


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
    prefetched: Prefetched | None = None,
    pool: BlockPool | None = None,
) -> WarmupReport:
    """Index the store, pin the warm entries, prefill (at most ``concurrency`` at once) what
    has no snapshot.

    ``prefill_many`` runs one group of warm prefixes; by default one after another with
    the shared ``prefill``, so a written-back snapshot holds the bytes ``kvsnap build``
    would write.
    """
    t0 = time.perf_counter()
    counts.begin_warmup()
    concurrency = max(1, int(concurrency))
    problems = [str(p) for p in (prompts.problems if prompts else [])]
    report = WarmupReport(problems=problems, prefill_concurrency=concurrency)
    if prefix.check_state is None:  # every state served is checked against the model's own cache
        prefix.check_state = ModelShapes(lm).problem
    pool = pool if pool is not None else BlockPool()
    run = _Warmup(lm, prefix, identity, counts, store, report, budget_bytes, pool=pool)
    # each part is checked once: what the pins read, and what the write-backs check or
    # write, is kept for this warm-up (the store forgets it after)
    with store.checks_remembered() if store is not None else contextlib.nullcontext():
        good = run.scan(prefetched)
        if prompts is not None:
            targets, stale_keys = run.targets(prompts, good)
        else:
            targets, stale_keys = [WarmTarget(i.name, None, i) for i in good.values()], set()
        to_prefill, pinned_keys = run.pin(targets)
        run.index_unnamed(good, pinned_keys | stale_keys)
        writable = store if store is not None and not store.readonly else None
        # where prefilled warm prompts are written back: a writable store, and their file
        sink = (writable, agents_file) if writable is not None and agents_file else None
        if writable is not None and not agents_file and to_prefill:
            counts.write_back_note = NO_AGENTS_FILE
        if not allow_prefill:
            report.skipped += len(to_prefill)
            to_prefill = []
        prefill_many = prefill_many or (lambda group: [prefill(lm, tokens) for tokens in group])
        for start in range(0, len(to_prefill), concurrency):
            group = to_prefill[start : start + concurrency]
            report.max_inflight_prefills = max(report.max_inflight_prefills, len(group))
            for t, cache in zip(group, prefill_many([t.tokens for t in group])):
                written = run.write_back(t, cache, *sink) if sink is not None else None
                run.keep_prefilled(t, cache, written)
                del cache
        counts.write_back = sink is not None
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
    prefetched: Prefetched | None = None
    pool: BlockPool = field(default_factory=BlockPool)  # a record's blocks, held once

    def scan(self, prefetched: Prefetched | None) -> dict[str, SnapshotInfo]:
        """The store's snapshots of this model by key; the others are reported as rejected."""
        store, counts = self.store, self.counts
        if store is None:
            return {}
        if prefetched is not None and prefetched.root == store.root:
            self.prefetched = prefetched
            # the headers were read while the model loaded
            infos, bad = prefetched.scan(self.identity)
        else:
            infos, bad = store.scan(self.identity, max_tokens=context_tokens(self.lm.path))
        for problem in bad:
            counts.reject(str(problem.path), problem.reason)
        if store.readonly and not counts.write_back_note:
            counts.write_back_note = (
                f"{store.root} is opened read-only: prefilled warm prompts are not written back"
            )
        return {i.key: i for i in infos}

    def targets(
        self, prompts: WarmPromptSet, good: dict[str, SnapshotInfo]
    ) -> tuple[list[WarmTarget], set[str]]:
        """Each warm prompt's prefix, key and snapshot (None: to prefill); and the keys its
        edits made stale."""
        report, lm = self.report, self.lm
        recorded = ((i.recorded.get("warm_recipe"), i) for i in good.values())
        by_recipe = {recipe: i for recipe, i in recorded if recipe}
        targets: list[WarmTarget] = []
        stale_keys: set[str] = set()
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
                stale_keys |= self._reject_stale(p.name, good)
            targets.append(WarmTarget(p.name, tokens, info, digest, p))
        return targets, stale_keys

    def _reject_stale(self, name: str, good: dict[str, SnapshotInfo]) -> set[str]:
        """The snapshots built for warm prompt ``name`` whose key its tokens no longer give."""
        stale = {i.key: i for i in good.values() if i.name == name}
        for i in stale.values():
            why = f"stale: no longer matches warm prompt {name!r} (its tokens changed); "
            self.counts.reject(str(i.path), why + "rebuild with `kvsnap build`")
        return set(stale)

    def pin(self, targets: list[WarmTarget]) -> tuple[list[ToPrefill], set[str]]:
        """Pin every target that has a snapshot (resident within the budget); returns what is
        left to prefill."""
        report, counts, store = self.report, self.counts, self.store
        used = self.prefix.current_bytes
        to_prefill: list[ToPrefill] = []
        pinned_keys: set[str] = set()
        for t in targets:
            job = t.to_prefill()
            if t.info is None or store is None:
                if job is not None:
                    to_prefill.append(job)
                continue
            try:
                entry = make_entry(
                    self.lm,
                    store,
                    t.info,
                    pinned=True,
                    prefetched=self.prefetched,
                    pool=self.pool,
                    check=self.prefix.check_state,
                )
                if used + t.info.nbytes <= self.budget_bytes:
                    entry.state, entry.nbytes = entry.read()
                    entry.resident = True
                    self._read_good(t.info)
                    used += entry.nbytes
                    counts.loaded += 1
                self.prefix.add(entry)
                pinned_keys.add(t.info.key)
                report.from_snapshots += 1
                report.completed += 1
                report.prompt_tokens += len(entry.tokens)
            except SnapshotError as exc:
                counts.reject(exc.path, exc.reason)
                if job is not None:
                    to_prefill.append(job)
                else:
                    report.skipped += 1
        return to_prefill, pinned_keys

    def _read_good(self, info: SnapshotInfo) -> None:
        """A record just loaded: every block it reaches was read and checked (now, in the
        prefetch, or for a record loaded before), so a write-back need not check it again."""
        checked = self.store.checked if self.store is not None else None
        if checked is not None and info.chain is not None:
            checked.mark_good((BLOCK_KIND, key) for key, _, _ in info.chain.blocks)

    def index_unnamed(self, good: dict[str, SnapshotInfo], skip_keys: set[str]) -> None:
        """Snapshots of this model that no warm prompt names: indexed, loaded on first hit."""
        check, store = self.prefix.check_state, self.store
        # without a store there is no snapshot (``good`` is empty)
        if store is not None:
            for info in good.values():
                if info.key in skip_keys:
                    continue
                try:
                    entry = make_entry(
                        self.lm, store, info, pinned=False, pool=self.pool, check=check
                    )
                    self.prefix.add(entry)
                except SnapshotError as exc:
                    self.counts.reject(exc.path, exc.reason)
            for entry in checkpoint_entries(store, good, self.pool, check):
                self.prefix.add(entry)
        self.counts.indexed = sum(1 for e in self.prefix.entries if e.loader is not None)

    def write_back(self, t: ToPrefill, cache: list, store: Store, agents_file: str) -> Path | None:
        try:
            written = commit_snapshot(
                self.lm,
                store,
                self.identity,
                t.prompt,
                t.prompt_digest,
                t.tokens,
                cache,
                agents_file,
            )
        except (StoreError, SnapshotError, OSError) as exc:
            self.counts.write_back_note = f"write-back failed: {exc}"
            log.warning("[kvsnap] %s", self.counts.write_back_note)
            return None
        self.counts.written += 1
        return written

    def keep_prefilled(self, t: ToPrefill, cache: list, written: Path | None) -> None:
        """A prefilled warm prompt: pinned in memory within the budget, else indexed from the
        file just written."""
        store, report, check = self.store, self.report, self.prefix.check_state
        self.counts.prefilled += 1
        report.prefilled += 1
        report.completed += 1
        report.prompt_tokens += len(t.tokens)
        nbytes = cache_nbytes_of(cache)
        if self.prefix.current_bytes + nbytes <= self.budget_bytes:
            entry = Entry(
                tokens=t.tokens,
                state=cache,
                nbytes=nbytes,
                trimmable=is_trimmable(cache),
                pinned=True,
                source="prefill",
                name=t.name,
                resident=True,
            )
            if written is not None and store is not None:
                # A re-warm reads it back instead of prefilling again; its header is read only then.
                def reload(store: Store = store, path: Path = written) -> tuple[Any, int]:
                    info = store.inspect(path)
                    return snapshot_loader(store, info, pool=self.pool, check=check)()

                entry.loader = reload
            self.prefix.add(entry)
            return
        # Over the memory budget: keep it indexed from the file just written (loads on
        # first hit), or, with nowhere to reload it from, let it go.
        report.over_budget += 1
        if written is not None and store is not None:
            try:
                info = store.inspect(written)
                entry = make_entry(self.lm, store, info, pinned=True, pool=self.pool, check=check)
                self.prefix.add(entry)
            except SnapshotError as exc:
                self.counts.reject(exc.path, exc.reason)
