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

Requests that hit the same cached prefix share it in the batch (``SharedPrefix``): each row
holds only its own tokens, and attention reads the prefix once per step for every row
(``install_shared_attention``) instead of once per row from a private copy: at 16 rows on a
2k-token prefix that was most of a decode step's memory traffic, and every request's private
copy, batch merge and join copied the prefix again.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, cast

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


# A batch keeps at least this many tokens its rows have in common shared; below, each row
# holds its prefix (a private copy costs less than the shared prefix's extra matmuls)
MIN_SHARED_TOKENS = 256


class SharedPrefix:
    """One layer's keys and values of a cached prefix, ``(1, heads, n, dim)``, read by every
    batch row that starts with its ``tokens``. Never written: rows write their own tokens
    elsewhere."""

    __slots__ = ("keys", "values", "tokens", "n")

    def __init__(self, keys: Any, values: Any, tokens: tuple[int, ...]):
        self.keys, self.values, self.tokens, self.n = keys, values, tokens, len(tokens)

    def __deepcopy__(self, memo: dict) -> "SharedPrefix":
        return self  # read-only: mlx-lm's batch split deep-copies its caches

    def common(self, other: "SharedPrefix | None") -> "SharedPrefix | None":
        """The prefix both start with (a view of this one), None when under
        ``MIN_SHARED_TOKENS``."""
        if other is None:
            return None
        n = 0
        for a, b in zip(self.tokens, other.tokens):
            if a != b:
                break
            n += 1
        if n < MIN_SHARED_TOKENS:
            return None
        if n == self.n:
            return self
        if n == other.n:
            return other
        return SharedPrefix(self.keys[..., :n, :], self.values[..., :n, :], self.tokens[:n])


class PrefixedKVCache(KVCache):
    """A request's layer on its way into a BatchGenerator that reads ``prefix`` shared and holds
    no tokens of its own yet (its suffix is the prompt); ``room``: tokens it will add."""

    def __init__(self, prefix: SharedPrefix, room: int):
        super().__init__()
        self.prefix, self.room, self.offset = prefix, room, prefix.n

    def unshared(self) -> InsertedKVCache:
        """The same tokens as a plain cache of views (the batch copies them into its buffer)."""
        plain = KVCache()
        plain.keys, plain.values, plain.offset = self.prefix.keys, self.prefix.values, self.offset
        return InsertedKVCache(plain, self.room)

    @classmethod
    def merge(cls, caches: list) -> "RoomyBatchKVCache":
        return RoomyBatchKVCache.merge(caches)


def with_shared_prefix(prefixes: list[SharedPrefix], new_tokens: int) -> list:
    """A request's layers as they go into ``BatchGenerator.insert`` reading ``prefixes`` (one
    per layer, the request's cached tokens) instead of its private copy of them."""
    return [PrefixedKVCache(p, new_tokens) for p in prefixes]


def shared_prefix_of(cache: list, tokens: tuple[int, ...]) -> list[SharedPrefix] | None:
    """Each layer's first ``len(tokens)`` tokens of a request's private cache, computed now as
    the arrays rows share (views: a hit's copy is made once, a stored state's is not copied);
    None when a layer is not a plain ``KVCache`` (rotating, SSM, quantized)."""
    n = len(tokens)
    if n <= 0 or any(type(c) is not KVCache or c.keys is None for c in cache):
        return None
    out = [SharedPrefix(c.keys[..., :n, :], c.values[..., :n, :], tokens) for c in cache]
    mx.eval([a for p in out for a in (p.keys, p.values)])
    return out


class RoomyBatchKVCache(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` made without the copies: see the module's docstring. With a
    ``prefix``, every row starts with it and the buffer holds the rows' own tokens only."""

    prefix: SharedPrefix | None = None

    @classmethod
    def merge(cls, caches: list) -> "RoomyBatchKVCache":
        if all(isinstance(c, PrefixedKVCache) for c in caches):
            merged = cls._reading(caches[0].prefix)
            for c in caches[1:]:
                merged.extend(cls._reading(c.prefix))
            return merged
        caches = [c.unshared() if isinstance(c, PrefixedKVCache) else c for c in caches]
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

    @classmethod
    def _reading(cls, prefix: SharedPrefix) -> "RoomyBatchKVCache":
        """One row that reads ``prefix`` and holds no tokens of its own yet."""
        cache = cls([0])
        cache.prefix = prefix
        cache.offset += prefix.n  # positions count the prefix (rope)
        return cache

    def extract(self, idx: int) -> KVCache:
        """Row ``idx``'s tokens as views of the batch's buffer (mlx-lm's copies them): a caller
        copies what it keeps, before the next step writes the buffer. A shared prefix comes
        first, concatenated when the caller computes it."""
        keys: Any = self.keys
        values: Any = self.values
        cache = KVCache()
        row_keys: Any = None
        row_values: Any = None
        own = 0
        if keys is not None:
            padding = cast(list, self.left_padding.tolist())[idx]
            row_keys = keys[idx : idx + 1, :, padding : self._idx]
            row_values = values[idx : idx + 1, :, padding : self._idx]
            own = self._idx - padding
        prefix = self.prefix
        if prefix is not None and own == 0:
            row_keys, row_values = prefix.keys, prefix.values
        elif prefix is not None:
            row_keys = mx.concatenate([prefix.keys, row_keys], axis=2)
            row_values = mx.concatenate([prefix.values, row_values], axis=2)
        cache.keys, cache.values = row_keys, row_values
        cache.offset = own + (prefix.n if prefix is not None else 0)
        if prefix is not None and own > 0:
            # the row's own tokens apart: a kept prefix that shares the head's blocks copies
            # these, not the whole concatenation (``request_cache._kept_from_views``)
            row: Any = cache
            row.shared_tokens = prefix.n
            row.own = (
                keys[idx : idx + 1, :, self._idx - own : self._idx],
                values[idx : idx + 1, :, self._idx - own : self._idx],
            )
        return cache

    def extend(self, other: Any) -> None:
        """Rows of ``other`` appended. Rows reading another prefix: both sides keep what the two
        prefixes have in common shared, each row then holding the rest of its prefix (a few
        tokens where two prompts part late; all of it where they share too little)."""
        mine, theirs = self.prefix, getattr(other, "prefix", None)
        if mine is not theirs:
            common = mine.common(theirs) if mine is not None else None
            self.reprefix(common)
            if isinstance(other, RoomyBatchKVCache):
                other.reprefix(common)
        super().extend(other)

    def unshare(self) -> None:
        """Each row's prefix copied in front of its own tokens: a plain batch cache."""
        self.reprefix(None)

    def reprefix(self, shorter: SharedPrefix | None) -> None:
        """Read ``shorter`` (the start of this prefix, or None: no prefix) shared: the prefix's
        tokens after it are copied in front of each row's own."""
        prefix = self.prefix
        if prefix is None or prefix is shorter:
            return
        start = shorter.n if shorter is not None else 0
        tail, own = prefix.n - start, self._idx
        if tail > 0:
            rows = int(self.offset.shape[0])
            padding = cast(list, self.left_padding.tolist())
            size = tail + own + (self.step - (tail + own) % self.step)
            shape = (rows, prefix.keys.shape[1], size)
            keys = mx.zeros((*shape, prefix.keys.shape[3]), dtype=prefix.keys.dtype)
            values = mx.zeros((*shape, prefix.values.shape[3]), dtype=prefix.values.dtype)
            tail_keys, tail_values = prefix.keys[..., start:, :], prefix.values[..., start:, :]
            for i, p in enumerate(padding):
                keys[i : i + 1, :, p : p + tail] = tail_keys
                values[i : i + 1, :, p : p + tail] = tail_values
                if self.keys is not None and own > p:
                    keys[i : i + 1, :, p + tail : tail + own] = self.keys[i : i + 1, :, p:own]
                    values[i : i + 1, :, p + tail : tail + own] = self.values[i : i + 1, :, p:own]
            self.keys, self.values = keys, values  # type: ignore[assignment]
            self._idx = tail + own
        self.prefix = shorter

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


def shared_prefix_attention(
    queries: Any, keys: Any, values: Any, prefix: SharedPrefix, scale: float, mask: Any
) -> Any:
    """Attention of every row over the shared ``prefix`` then its own ``keys``/``values``: the
    prefix's part is one matmul per KV head for all rows' queries, one softmax over both."""
    b, hq, length, dim = queries.shape
    hkv, n, own = keys.shape[1], prefix.n, keys.shape[2]
    rep = hq // hkv
    q = (queries * scale).reshape(b, hkv, rep, length, dim)
    # (heads, rows * rep * length) queries against one copy of the prefix per KV head
    flat = q.transpose(1, 0, 2, 3, 4).reshape(1, hkv, b * rep * length, dim)
    on_prefix = (flat @ prefix.keys.swapaxes(-1, -2)).reshape(hkv, b, rep, length, n)
    on_own = q @ keys[:, :, None].swapaxes(-1, -2)
    if isinstance(mask, str):
        q_at, k_at = mx.arange(own - length, own), mx.arange(own)
        mask = q_at[:, None] >= k_at[None]
    if mask is not None:
        if mask.ndim == 4:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            on_own = mx.where(mask, on_own, mx.finfo(on_own.dtype).min)
        else:
            on_own = on_own + mask
    scores = mx.concatenate([on_prefix.transpose(1, 0, 2, 3, 4), on_own], axis=-1)
    weights = mx.softmax(scores, axis=-1, precise=True)
    w_prefix = weights[..., :n].transpose(1, 0, 2, 3, 4).reshape(1, hkv, b * rep * length, n)
    out_prefix = (w_prefix @ prefix.values).reshape(hkv, b, rep, length, -1)
    out = out_prefix.transpose(1, 0, 2, 3, 4) + weights[..., n:] @ values[:, :, None]
    return out.reshape(b, hq, length, -1).astype(queries.dtype)


# model modules whose attention passes its layer's cache to ``scaled_dot_product_attention``
SHARED_ATTENTION_MODELS = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


def install_shared_attention(model: Any) -> bool:
    """Make ``model``'s attention read a batch's shared prefix (other caches: mlx-lm's own
    function, unchanged); False when the model's module is not one known to pass its cache."""
    module = sys.modules.get(type(model).__module__)
    if module is None or module.__name__ not in SHARED_ATTENTION_MODELS:
        return False
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is None:
        return False
    if getattr(current, "reads_shared_prefix", False):
        return True
    patched: Any = module
    patched.scaled_dot_product_attention = _dispatching(current)
    return True


def _dispatching(plain: Callable[..., Any]) -> Callable[..., Any]:
    def attention(
        queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any = None
    ) -> Any:
        prefix = getattr(cache, "prefix", None)
        if isinstance(prefix, SharedPrefix) and isinstance(cache, RoomyBatchKVCache):
            if sinks is not None:
                raise ValueError("a shared prefix does not support attention sinks")
            return shared_prefix_attention(queries, keys, values, prefix, scale, mask)
        return plain(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    attention.reads_shared_prefix = True  # type: ignore[attr-defined]
    return attention
