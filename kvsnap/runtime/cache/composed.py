"""Warm states held as their blocks, each block once in memory however many prompts share it.

A v3 record's state is its chain of blocks plus a checkpoint. The server keeps it that way:
a ``ComposedState`` holds references to shared ``Block`` objects from one ``BlockPool``, so
ten agents with one 2,000-token preamble pin the preamble's KV once. A hit gets a private
cache that is not computed yet: the slices and room for the request's own tokens, one
concatenation that the request's first step evaluates and then writes into in place. mlx-lm's
attention reads one contiguous buffer per layer, so that one copy of the cached tokens is the
least a request that writes can make; nothing else is copied (``engine.batch_cache`` keeps
the batch from copying it again). A state fetched from a shared tier is also one buffer per
tensor (``buffers``, its blocks views of them): its copies are views of those, as a local hit's
are, and a batch reads it as one shared prefix without concatenating anything.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx

from kvsnap.snapshot.cache_classes import layers_at, split_tensor_names
from kvsnap.snapshot.codec import copy_cache, copy_cache_head, decode_cache, trim_cache
from kvsnap.store import reading as store_reading
from kvsnap.store.local import SnapshotInfo, Store
from kvsnap.store.paths import end_checkpoint
from kvsnap.store.reading import read_state_parts
from kvsnap.store.tier_layout import RecordBuffers

ROOM_STEP = 256  # mlx-lm's KVCache grows in steps of 256 tokens: room comes in the same steps


class Block:
    """One block's (or checkpoint's) arrays, shared by every state that passes through it."""

    __slots__ = ("key", "arrays", "layers", "nbytes", "__weakref__")

    def __init__(self, key: str, arrays: dict, layers: list | None):
        self.key = key
        self.arrays = arrays
        self.layers = layers  # the layer list at its end, when its header has one
        self.nbytes = sum(a.nbytes for a in arrays.values())


class BlockPool:
    """Blocks by key, held only while some state holds them (weak values): dropping the last
    prompt that uses a block frees it."""

    def __init__(self) -> None:
        self._blocks: "weakref.WeakValueDictionary[str, Block]" = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, key: str) -> Block | None:
        with self._lock:
            return self._blocks.get(key)

    def add(self, key: str, arrays: dict, layers: list | None) -> tuple[Block, bool]:
        """The pooled block for ``key`` (``arrays`` if it is new) and whether it was new."""
        with self._lock:
            found = self._blocks.get(key)
            if found is not None:
                return found, False
            block = Block(key, arrays, layers)
            self._blocks[key] = block
            return block, True

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._blocks.values())


@dataclass
class ComposedState:
    """A warm state as shared blocks: slices ``(start, end, Block)`` tiling [0, n), the
    checkpoint holding the other layers whole (None for attention-only models), the layer list at
    n. ``buffers``: one array per sliced tensor holding all n tokens, the blocks' arrays views of
    them, with room after (a shared tier's fetch, ``store/tier_layout``), or None."""

    blocks: list
    checkpoint: Block | None
    layers: list
    n_tokens: int
    buffers: RecordBuffers | None = None

    def materialize(self, room: int = 0, upto: int | None = None) -> list:
        """A private cache, not computed yet: each sliced tensor is the blocks' slices then
        ``room_for(room)`` empty positions, so the request's ``room`` tokens are written in
        place and the cached ones are copied once, when the request first runs.

        ``upto``: only the first ``upto`` tokens (a partial match of a state with no
        checkpointed layers), so a short match copies what it uses, not the whole state."""
        sliced, whole = split_tensor_names(self.layers)
        if upto is not None and whole:
            raise ValueError("a state with checkpointed layers is only served whole")
        if self.buffers is not None and not whole:
            # its tokens are one buffer per tensor already: views, as a local hit's copy is
            # (``codec.copy_cache``); the first write copies them once, with room
            n = self.n_tokens if upto is None else upto
            views = self.buffers.head(n)
            return decode_cache(views, self.layers if upto is None else layers_at(self.layers, n))
        spare = room_for(room)
        arrays: dict[str, Any] = {}
        heads = self.head(upto) if upto is not None else None
        for name in sliced:
            pieces = (
                heads[name]
                if heads is not None
                else [block.arrays[name] for _, _, block in self.blocks]
            )
            last = pieces[-1]
            pad = mx.zeros((*last.shape[:-2], spare, last.shape[-1]), dtype=last.dtype)
            arrays[name] = mx.concatenate([*pieces, pad], axis=-2)
        # the layers kept whole come from the checkpoint (attention-only models have none)
        kept = self.checkpoint.arrays if self.checkpoint is not None else {}
        for name in whole:
            arrays[name] = kept[name][...]  # a view: copied on its first write
        # sliceable layers: offset n in a buffer of n + spare
        return decode_cache(arrays, self.layers if upto is None else layers_at(self.layers, upto))

    def head(self, n: int) -> dict[str, list]:
        """Each sliced tensor's first ``n`` tokens as the blocks hold them, not copied: what a
        longer state that starts with these tokens can share (a request's kept prefix)."""
        sliced, _ = split_tensor_names(self.layers)
        return {
            name: [
                block.arrays[name] if end <= n else block.arrays[name][..., : n - start, :]
                for start, end, block in self.blocks
                if start < n
            ]
            for name in sliced
        }


def load_composed(
    store: Store,
    info: SnapshotInfo,
    pool: BlockPool,
    end: int | None = None,
    checkpoint_key: str | None = None,
    in_memory: Mapping[tuple[str, str], bytes | memoryview] | None = None,
    buffers: RecordBuffers | None = None,
) -> tuple[ComposedState, int]:
    """A v3 record's state at ``end`` (default: all of it) as pooled blocks; blocks already in
    the pool are not read again, nor are parts ``in_memory`` by (kind, key) (a shared
    tier's fetch). Returns the state and the bytes this load added to the pool. Reading and
    checking are ``store.reading.read_state_parts``'s; SnapshotError names a bad part.
    ``buffers``: those a fetch received every block into (``store/tier_layout``), kept as
    the state's when they fit it."""
    n = info.n_tokens if end is None else end
    if checkpoint_key is None and n == info.n_tokens:
        checkpoint_key = end_checkpoint(info)
    if info.chain is None:
        raise ValueError(f"{info.path} is no block record: it has no blocks to load")
    spans = info.chain.spans(n)
    held: dict[str, Block] = {}
    added = 0

    def fetch(kind: str, key: str, start: int, stop: int, digest: str) -> tuple[dict, list | None]:
        nonlocal added
        block = pool.get(key)
        if block is None:
            data = in_memory.get((kind, key)) if in_memory is not None else None
            if data is not None:
                part, arrays = store_reading.part_from_bytes(
                    store, kind, key, info.model_digest, start, stop, digest, data
                )
            else:  # looked up on its module when called, so a test can count the reads
                part, arrays = store_reading.read_part(
                    store, kind, key, info.model_digest, start, stop, digest
                )
            block, new = pool.add(key, arrays, part.layers)
            added += block.nbytes if new else 0
        held[key] = block
        return block.arrays, block.layers

    _, _, layers = read_state_parts(
        store,
        str(info.path),
        info.model_digest,
        spans,
        checkpoint_key,
        info.layers if n == info.n_tokens else None,
        fetch,
    )
    blocks = [(start, stop, held[key]) for key, start, stop, _ in spans]
    checkpoint = held[checkpoint_key] if checkpoint_key is not None else None
    return ComposedState(blocks, checkpoint, layers, n, _fitting(buffers, blocks, n)), added


def _fitting(buffers: RecordBuffers | None, blocks: list, n: int) -> RecordBuffers | None:
    """``buffers`` when they hold exactly the blocks' sliced tensors at ``n`` tokens in their
    form (the blocks were checked as loaded; the buffers' bytes are theirs), else None."""
    if buffers is None or not blocks or buffers.n != n:
        return None
    first = blocks[0][2].arrays
    if first.keys() != buffers.arrays.keys():
        return None
    for name, a in first.items():
        b = buffers.arrays[name]
        if b.dtype != a.dtype or b.shape[:-2] != a.shape[:-2] or b.shape[-1] != a.shape[-1]:
            return None
    return buffers


def room_for(tokens: int) -> int:
    """Positions a copy leaves after its cached ones for ``tokens`` more: whole steps of
    mlx-lm's 256, at least one position past them (where the first decode step writes)."""
    return -(-(max(tokens, 0) + 1) // ROOM_STEP) * ROOM_STEP


def copy_state_head(state: Any, n: int, room: int = 0) -> Any:
    """``copy_state`` of a trimmable state's first ``n`` tokens only (a partial match). A
    state with layers kept whole (a sliding window not yet full) is copied whole and trimmed."""
    if not isinstance(state, ComposedState):
        return copy_cache_head(state, n)
    if split_tensor_names(state.layers)[1]:
        return trim_cache(state.materialize(room), state.n_tokens - n)
    return state.materialize(room, upto=n)


def copy_state(state: Any, room: int = 0) -> Any:
    """The prefix cache's copy for a request adding ``room`` tokens: a composed state's private
    cache (not computed yet), else ``codec.copy_cache``'s views (copied on their first write)."""
    if isinstance(state, ComposedState):
        return state.materialize(room)
    return copy_cache(state)
