"""Prefix entries for a store's snapshots: what a warm-up indexes and how each one loads.

An entry is only indexed here (its tokens, size and trimmability from the header); its loader
reads the state when it is pinned within the budget or on first hit: from the arrays the
prefetch read while the model loaded, else from the file; a record as its pooled blocks. A
state the model's shape check refuses is a SnapshotError, a load error the caller reports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, cast

from kvsnap.errors import SnapshotError
from kvsnap.runtime.cache.composed import BlockPool, load_composed
from kvsnap.runtime.cache.prefix import CheckFn, Entry
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.snapshot.cache_classes import layers_trimmable
from kvsnap.snapshot.codec import cache_nbytes_of, decode_cache
from kvsnap.store.local import SnapshotInfo, Store
from kvsnap.store.tier_layout import RecordBuffers


class PrefetchedArrays(Protocol):
    """Arrays read ahead of the warm-up (``warmup.prefetch.Prefetched``); named here, not imported,
    because the cache sits below the warm-up."""

    def take(self, info: SnapshotInfo) -> object | None: ...


SHAPE_FIX = (
    "it was not built for this model's cache (forged or damaged); rebuild it with `kvsnap build`"
)


def make_entry(
    lm: LoadedModel,
    store: Store,
    info: SnapshotInfo,
    pinned: bool,
    prefetched: PrefetchedArrays | None = None,
    pool: BlockPool | None = None,
    check: CheckFn | None = None,
) -> Entry:
    """A prefix entry for a snapshot, only indexed: it loads when pinned within budget, else on
    first hit.

    ``prefetched``: arrays read while the model loaded (``prefetch.Prefetched``), taken once.
    ``pool``: where a record's blocks are held, once for every entry that shares them.
    ``check``: why a loaded state does not fit the model (a load error), or None."""
    tokens = tuple(store.read_tokens(info))
    return Entry(
        tokens=tokens,
        state=None,
        nbytes=info.nbytes,
        trimmable=layers_trimmable(info.layers, str(info.path)),
        pinned=pinned,
        source="snapshot",
        name=info.name,
        key=info.key,
        loader=snapshot_loader(store, info, prefetched, pool, check),
        block_ends=tuple(end for _, _, end in info.chain.blocks) if info.chain else (),
    )


def snapshot_loader(
    store: Store,
    info: SnapshotInfo,
    prefetched: PrefetchedArrays | None = None,
    pool: BlockPool | None = None,
    check: CheckFn | None = None,
) -> Callable[[], tuple]:
    """Loads one snapshot's cache state: from ``prefetched`` when it was read already, else from
    the file. A record with a ``pool`` stays as its shared blocks (a ``ComposedState``); its
    size is what its blocks added to the pool. A state ``check`` refuses is a SnapshotError."""

    def load():
        arrays = prefetched.take(info) if prefetched is not None else None
        if info.chain is not None and pool is not None:
            loaded = arrays if isinstance(arrays, tuple) else load_composed(store, info, pool)
            return _checked(loaded, info, check)
        if arrays is None:
            arrays = store.load_arrays(info)
        # Checked before decoding: the arrays are what a forger wrote.
        _checked((arrays, 0), info, check)
        # A whole record is prefetched as its name -> array dict (a chained one as a tuple).
        state = decode_cache(cast(dict, arrays), info.layers)
        return state, cache_nbytes_of(state)

    return load


def fetched_loader(
    store: Store,
    info: SnapshotInfo,
    parts: Mapping[tuple[str, str], bytes | memoryview],
    pool: BlockPool | None,
    check: CheckFn | None = None,
    buffers: RecordBuffers | None = None,
) -> Callable[[], tuple]:
    """Loads a record whose parts are held in memory (a shared tier's fetch, the store still
    writing them) as pooled blocks; parts the pool or the store holds already come from there.
    ``buffers``: what the fetched blocks' tensors view (``store/tier_layout``), which the
    state's copies then read as one prefix."""
    into = pool if pool is not None else BlockPool()
    return lambda: _checked(
        load_composed(store, info, into, in_memory=parts, buffers=buffers), info, check
    )


def _checked(loaded: tuple, info: SnapshotInfo, check: CheckFn | None) -> tuple:
    """``loaded`` if its state fits the model, else a SnapshotError naming the record and the
    tensor."""
    why = check(loaded[0]) if check is not None else None
    if why:
        raise SnapshotError(str(info.path), why, SHAPE_FIX)
    return loaded


def checkpoint_loader(
    store: Store,
    info: SnapshotInfo,
    end: int,
    checkpoint_key: str,
    pool: BlockPool,
    check: CheckFn | None = None,
) -> Callable[[], tuple]:
    """Loads a record's state at one of its checkpoints: its blocks up to ``end`` and the
    checkpoint there."""
    return lambda: _checked(load_composed(store, info, pool, end, checkpoint_key), info, check)


def checkpoint_entries(
    store: Store, good: dict[str, SnapshotInfo], pool: BlockPool, check: CheckFn | None = None
) -> list[Entry]:
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
                seen[tokens] = Entry(
                    tokens=tokens,
                    state=None,
                    nbytes=int(per_token * end),
                    trimmable=False,
                    pinned=False,
                    source="snapshot",
                    name=f"{info.name}@{end}",
                    key=key,
                    loader=checkpoint_loader(store, info, end, key, pool, check),
                    inner=True,
                )
    return list(seen.values())
