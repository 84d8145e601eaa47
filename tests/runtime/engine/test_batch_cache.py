"""A request's KV enters mlx-lm's BatchGenerator copied once at most, and a shared array is
never written. Pointers are read through numpy from the arrays' buffers: one pointer, one
buffer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from kvsnap.runtime.engine.batch_cache import RoomyBatchKVCache, for_batch

HEADS, DIM = 2, 4


def _pointer(a: mx.array) -> int:
    mx.eval(a)
    return np.asarray(memoryview(a)).__array_interface__["data"][0]  # type: ignore[arg-type]


def _kv(n: int, seed: int) -> mx.array:
    return mx.random.normal((1, HEADS, n, DIM), key=mx.random.key(seed))


def _cache(keys: mx.array, values: mx.array, offset: int) -> KVCache:
    c = KVCache()
    c.keys, c.values, c.offset = keys, values, offset
    return c


def _batch(caches: list[KVCache], adds: int) -> BatchKVCache:
    layers = [for_batch([c], adds)[0] for c in caches]
    return layers[0].merge(layers)


def test_a_lone_hit_with_room_is_the_batch_buffer_and_its_tokens_are_written_in_place():
    """A hit's copy made with room (as ``ComposedState.materialize`` makes it) becomes the
    batch's buffer: no copy at the merge, none for the prompt step, none moving to decoding."""
    pieces = [_kv(5, 1), _kv(3, 2)]
    pad = mx.zeros((1, HEADS, 256, DIM))
    keys = mx.concatenate([*pieces, pad], axis=2)
    values = mx.concatenate([*pieces, pad], axis=2)
    where = _pointer(keys)
    batch = _batch([_cache(keys, values, 8)], 3)
    del keys, values  # the request's copy is the batch's own now
    assert _pointer(batch.keys) == where
    new = _kv(3, 3)
    batch.update_and_fetch(new, new)  # the prompt step
    assert _pointer(batch.keys) == where
    batch.filter([0])  # prompt processing -> decoding keeps every row
    batch.update_and_fetch(_kv(1, 4), _kv(1, 4))  # a decode step
    assert _pointer(batch.keys) == where
    k, _ = batch.keys_and_values()
    want = mx.concatenate([*pieces, new], axis=2)
    assert mx.array_equal(k[..., :11, :], want).item()


def test_a_view_of_a_shared_state_is_copied_once_with_room_and_never_written():
    shared_k, shared_v = _kv(8, 5), _kv(8, 6)
    kept_k = np.array(shared_k)
    batch = _batch([_cache(shared_k[...], shared_v[...], 8)], 3)
    assert batch.keys.shape[2] == 8 + 256
    assert _pointer(batch.keys) != _pointer(shared_k)
    copied = _pointer(batch.keys)
    batch.update_and_fetch(_kv(3, 7), _kv(3, 7))
    assert _pointer(batch.keys) == copied
    assert np.array_equal(np.array(shared_k), kept_k)


def test_several_requests_merge_as_mlx_lm_merges_them_with_room():
    """Requests admitted together: the same left-padded rows as mlx-lm's own merge (plus
    room), a cold request among them, and a gather only when rows go."""
    short = _cache(_kv(3, 8), _kv(3, 9), 3)
    long = _cache(_kv(6, 10), _kv(6, 11), 6)
    cold = KVCache()
    ours = _batch([short, long, cold], 4)
    theirs = BatchKVCache.merge([short, long, cold])
    assert isinstance(ours, RoomyBatchKVCache) and ours.keys.shape[2] == 6 + 256
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    for a, b in zip(ours.keys_and_values(), theirs.keys_and_values()):
        assert mx.array_equal(a, b).item()
    ours.filter([1])
    theirs.filter([1])
    for a, b in zip(ours.keys_and_values(), theirs.keys_and_values()):
        assert mx.array_equal(a, b).item()


def test_only_plain_kv_layers_are_wrapped_and_an_empty_batch_is_empty():
    from mlx_lm.models.cache import RotatingKVCache

    rotating = RotatingKVCache(max_size=8)
    plain = KVCache()
    wrapped = for_batch([plain, rotating], 2)
    assert wrapped[1] is rotating and isinstance(wrapped[0], KVCache) and wrapped[0].room == 2
    empty = wrapped[0].merge([wrapped[0]])
    assert isinstance(empty, RoomyBatchKVCache) and empty.keys is None
