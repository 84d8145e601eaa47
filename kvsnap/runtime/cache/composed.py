"""Warm states held as their blocks, each block once in memory however many prompts share it.

A v3 record's state is its chain of blocks plus a checkpoint. The server keeps it that way:
a ``ComposedState`` holds references to shared ``Block`` objects from one ``BlockPool``, so
ten agents with one 2,000-token preamble pin the preamble's KV once. A hit materializes a
private cache by concatenating the slices (with room for the request's own tokens, so its
first step writes in place): the one copy a request made anyway when it first wrote to a
shared buffer.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx

from kvsnap.snapshot.cache_classes import split_tensor_names
from kvsnap.snapshot.codec import copy_cache, decode_cache
from kvsnap.store import parts as store_parts
from kvsnap.store.local import SnapshotInfo, Store
from kvsnap.store.parts import end_checkpoint, read_state_parts


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
    n."""

    blocks: list
    checkpoint: Block | None
    layers: list
    n_tokens: int

    def materialize(self, spare: int = 256) -> list:
        """A private cache: the slices concatenated along the token axis, plus ``spare`` empty
        positions, so the request's first tokens are written in place, not by another copy."""
        sliced, whole = split_tensor_names(self.layers)
        arrays: dict[str, Any] = {}
        for name in sliced:
            pieces = [block.arrays[name] for _, _, block in self.blocks]
            room = pieces[-1]
            pad = (
                mx.zeros((*room.shape[:-2], spare, room.shape[-1]), dtype=room.dtype)
                if spare
                else None
            )
            arrays[name] = mx.concatenate(pieces + ([pad] if pad is not None else []), axis=-2)
        # the layers kept whole come from the checkpoint (attention-only models have none)
        kept = self.checkpoint.arrays if self.checkpoint is not None else {}
        for name in whole:
            arrays[name] = kept[name][...]  # a view: copied on its first write
        # sliceable layers: offset n in a buffer of n + spare
        cache = decode_cache(arrays, self.layers)
        mx.eval([c.state for c in cache])
        return cache


def load_composed(
    store: Store,
    info: SnapshotInfo,
    pool: BlockPool,
    end: int | None = None,
    checkpoint_key: str | None = None,
) -> tuple[ComposedState, int]:
    """A v3 record's state at ``end`` (default: all of it) as pooled blocks; blocks already in
    the pool are not read again. Returns the state and the bytes this load added to the pool.
    Reading and checking are ``store.parts.read_state_parts``'s; SnapshotError names a bad part."""
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
            # looked up on its module when called, so a test can count the reads
            part, arrays = store_parts.read_part(
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
    return ComposedState(
        blocks, held[checkpoint_key] if checkpoint_key is not None else None, layers, n
    ), added


def copy_state(state: Any) -> Any:
    """The prefix cache's copy: a private cache from a composed state, else ``codec.copy_cache``."""
    if isinstance(state, ComposedState):
        return state.materialize()
    return copy_cache(state)
