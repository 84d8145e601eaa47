"""A request's attention cache as it enters mlx-lm's BatchGenerator, and the batch cache it
becomes, copying the request's KV once at most.

mlx-lm's ``BatchKVCache.merge`` sizes the batch buffer to the prompt exactly, so the first
prompt step grows it (a copy of every cached token), and moving a request from prompt
processing to decoding gathers its rows (another copy), though it keeps every row. A warm hit
arrives either as its own buffer with room for its tokens (``ComposedState.materialize``, not
yet computed) or as a read-only view of a stored state (``codec.copy_cache``). Here a lone
request's own buffer becomes the batch's as it is, a view is copied once with room, and
keeping every row in order gathers nothing. mlx writes in place only into a buffer nothing
else holds, so a view of a shared entry is never written through.
"""

from __future__ import annotations

from typing import Any, cast

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: E402

from kvsnap.runtime.cache.composed import room_for  # noqa: E402


class InsertedKVCache(KVCache):
    """A request's ``KVCache`` on its way into a BatchGenerator: the same arrays, plus how many
    tokens the request will add (``room``), so the batch buffer is made once with room."""

    def __init__(self, source: KVCache, room: int):
        super().__init__()
        self.keys, self.values, self.offset = source.keys, source.values, source.offset
        self.room = room

    @classmethod
    def merge(cls, caches: list) -> "RoomyBatchKVCache":
        return RoomyBatchKVCache.merge(caches)


def for_batch(cache: list, new_tokens: int) -> list:
    """The request's cache layers as they go into ``BatchGenerator.insert``: plain ``KVCache``
    layers wrapped (others, e.g. rotating or SSM layers, go as they are)."""
    return [InsertedKVCache(c, new_tokens) if type(c) is KVCache else c for c in cache]


class RoomyBatchKVCache(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` made without the copies: see the module's docstring."""

    @classmethod
    def merge(cls, caches: list) -> "RoomyBatchKVCache":
        lengths = [c.size() for c in caches]
        n = max(lengths)
        if n == 0:
            return cls([0] * len(caches))
        room = room_for(max(getattr(c, "room", 0) for c in caches))
        padding = [n - length for length in lengths]
        keys, values = _own_buffer(caches[0], n, room) if len(caches) == 1 else (None, None)
        if keys is None:
            keys, values = _merged_buffers(caches, padding, n + room)
        cache = cls(padding)
        cache.keys, cache.values = keys, values
        cache.offset += n
        cache._idx = n
        return cache

    def extract(self, idx: int) -> KVCache:
        """Row ``idx``'s tokens as views of the batch's buffer (mlx-lm's copies them): a caller
        copies what it keeps, before the next step writes the buffer."""
        keys: Any = self.keys
        values: Any = self.values
        padding = cast(list, self.left_padding.tolist())[idx]
        cache = KVCache()
        cache.keys = keys[idx : idx + 1, :, padding : self._idx]
        cache.values = values[idx : idx + 1, :, padding : self._idx]
        cache.offset = self._idx - padding
        return cache

    def filter(self, batch_indices: Any) -> None:
        """Keep these rows; every row in order gathers nothing (a slice is a view)."""
        keep = list(batch_indices)
        if keep == list(range(int(self.left_padding.shape[0]))):
            super().filter(slice(None))
        else:
            super().filter(keep)


def _own_buffer(cache: Any, n: int, room: int) -> tuple[Any, Any]:
    """A lone request's buffers for the batch: its own when they already have room after its
    ``n`` tokens (a hit's copy made for it), else its tokens copied once with ``room`` more."""
    keys, values = cache.keys, cache.values
    if keys.shape[2] > n:
        return keys, values
    return tuple(  # type: ignore[return-value]
        mx.concatenate(
            [a[..., :n, :], mx.zeros((*a.shape[:2], room, a.shape[3]), dtype=a.dtype)], axis=2
        )
        for a in (keys, values)
    )


def _merged_buffers(caches: list, padding: list[int], size: int) -> tuple[Any, Any]:
    """Several requests' tokens, right-aligned at ``n`` in one buffer of ``size`` positions."""
    first = next(c for c in caches if c.keys is not None)
    heads = max(c.keys.shape[1] for c in caches if c.keys is not None)
    k_dim = max(c.keys.shape[3] for c in caches if c.keys is not None)
    v_dim = max(c.values.shape[3] for c in caches if c.values is not None)
    keys = mx.zeros((len(caches), heads, size, k_dim), dtype=first.keys.dtype)
    values = mx.zeros((len(caches), heads, size, v_dim), dtype=first.values.dtype)
    for i, (p, c) in enumerate(zip(padding, caches)):
        if c.keys is None:
            continue
        keys[i : i + 1, :, p : p + c.offset] = c.keys[..., : c.offset, :]
        values[i : i + 1, :, p : p + c.offset] = c.values[..., : c.offset, :]
    return keys, values
