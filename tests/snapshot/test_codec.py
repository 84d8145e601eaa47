"""Codec round trips for cache classes the demo architectures do not produce (llama4, falcon_h1)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

from kvsnap.snapshot.cache_classes import CACHE_CLASSES, UnknownCacheClass
from kvsnap.snapshot.codec import copy_cache, decode_cache, encode_cache, encode_layer


def _kv(n, seed):
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
    return k, k * 0.5 + 1


def _feed(cache, n, seed):
    for c in cache:
        subs = c.caches if isinstance(c, CacheList) else [c]
        for sub in subs:
            if isinstance(sub, ArraysCache):
                sub[0] = mx.random.normal((1, 3, 4), key=mx.random.key(seed))
                sub[1] = mx.random.normal((1, 2, 4, 4), key=mx.random.key(seed + 1))
            else:
                sub.update_and_fetch(*_kv(n, seed))
            if isinstance(sub, ChunkedKVCache):
                # as llama4 does before each step: the front past the chunk goes
                sub.maybe_trim_front()


def _fetch_all(cache):
    """What attention would read next: keys/values after one more token."""
    out = []
    for c in cache:
        for sub in c.caches if isinstance(c, CacheList) else [c]:
            if isinstance(sub, ArraysCache):
                out += [a for a in sub.cache if a is not None]
            else:
                out += list(sub.update_and_fetch(*_kv(1, 99)))
    mx.eval(out)
    return out


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: [ChunkedKVCache(16), KVCache()], id="chunked(llama4)"),
        pytest.param(
            lambda: [CacheList(ArraysCache(2), KVCache()), KVCache()], id="cachelist(falcon_h1)"
        ),
        pytest.param(
            lambda: [CacheList(KVCache(), RotatingKVCache(max_size=8))], id="cachelist-rotating"
        ),
    ],
)
def test_round_trip_is_bitwise_and_behaves_the_same(make):
    n = 21  # more than the chunk and the window, so both have trimmed their front
    original = make()
    _feed(original, n, seed=1)
    arrays, layers = encode_cache(original, list(range(n)))
    restored = decode_cache({k: mx.array(v) for k, v in arrays.items()}, layers)
    assert [type(c).__name__ for c in restored] == [type(c).__name__ for c in original]
    again, _ = encode_cache(restored, list(range(n)))
    assert set(again) == set(arrays) and all(
        mx.array_equal(again[k], arrays[k]).item() for k in arrays
    )
    for a, b in zip(_fetch_all(original), _fetch_all(restored)):
        assert mx.array_equal(a, b).item()


def test_copies_never_share_appends():
    original = [KVCache()]
    _feed(original, 5, seed=3)
    a, b = copy_cache(original), copy_cache(original)
    a[0].update_and_fetch(*_kv(1, 4))
    assert b[0].offset == 5 and original[0].offset == 5


def test_an_unknown_cache_class_names_the_supported_ones():
    class MysteryCache:
        pass

    with pytest.raises(UnknownCacheClass) as err:
        encode_layer(MysteryCache(), "0", {})
    assert "MysteryCache" in str(err.value) and all(
        name in str(err.value) for name in CACHE_CLASSES
    )


def test_copies_are_copy_on_write_for_in_place_writes():
    """Regression: copies became views (eager copies cost 1.5 s per 470 MB); an in-place write must
    not leak."""
    original = [RotatingKVCache(max_size=8)]
    _feed(original, 12, seed=5)  # a full ring: the next token is written in place
    before = mx.array(original[0].keys)
    mx.eval(before)
    mine = copy_cache(original)
    mine[0].update_and_fetch(*_kv(1, 6))  # in-place write into the ring
    mine[0].keys[..., 0, :] = 0  # and a direct one
    mx.eval(mine[0].keys)
    assert mx.array_equal(original[0].keys, before).item()
    assert not mx.array_equal(mine[0].keys, before).item()
