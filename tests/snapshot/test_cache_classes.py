"""One object per cache class: its tensor names are what encode writes, its trimmability is
mlx-lm's, and a class no object describes is refused by encode, decode, the header walk
(`kvsnap verify`/`ls`, no mlx) and the warm-up's trimmable check."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.cli import run_kvsnap
from helpers.snapshot_meta import fixed_identity, snapshot_metadata
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from kvsnap.errors import SnapshotError
from kvsnap.snapshot.cache_classes import (
    CACHE_CLASSES,
    UnknownCacheClass,
    cache_class,
    encode_layer,
    layers_trimmable,
)
from kvsnap.snapshot.codec import decode_cache, encode_cache, is_trimmable, to_out_tensors
from kvsnap.snapshot.file import FormatError
from kvsnap.snapshot.header import SnapshotInfo
from kvsnap.snapshot.layer_list import expected_tensor_names
from kvsnap.store.local import Store

N = 12  # past the rotating window (8) and the chunk (4): both have dropped their front


class MysteryCache:
    """A cache class a future mlx-lm might add: kvsnap must refuse it, never guess."""

    offset = N
    keys = values = None


def _kv(n, dim=8, seed=0):
    k = mx.random.normal((1, 2, n, dim), key=mx.random.key(seed))
    return k, k + 1


def _fed(cache, n=N):
    for c in cache:
        for sub in c.caches if isinstance(c, CacheList) else [c]:
            if isinstance(sub, ArraysCache):
                sub[1] = mx.zeros((1, 2, 4, 4))  # slot 0 left empty: only slot 1 is stored
            elif isinstance(sub, QuantizedKVCache):
                sub.update_and_fetch(*_kv(n, 64))
            else:
                sub.update_and_fetch(*_kv(n))
            if isinstance(sub, ChunkedKVCache):
                sub.maybe_trim_front()  # as llama4 does before each step: keeps the last chunk
    return cache


# Every class, filled and (where it can be) empty, as real mlx-lm objects.
LAYOUTS = {
    "KVCache": lambda: [_fed([KVCache()])[0], KVCache()],
    "RotatingKVCache": lambda: [
        _fed([RotatingKVCache(max_size=8, keep=2)])[0],
        RotatingKVCache(max_size=8),
    ],
    "QuantizedKVCache": lambda: [
        _fed([QuantizedKVCache(group_size=64, bits=8)])[0],
        QuantizedKVCache(group_size=64, bits=4),
    ],
    "ArraysCache": lambda: _fed([ArraysCache(2)]),
    "ChunkedKVCache": lambda: [_fed([ChunkedKVCache(4)])[0], ChunkedKVCache(4)],
    "CacheList": lambda: _fed(
        [CacheList(ArraysCache(2), KVCache()), CacheList(KVCache(), RotatingKVCache(max_size=8))]
    ),
}


def _object_names(meta: dict, path: str) -> set[str]:
    """Tensor names as the class objects state them, members included."""
    spec = cache_class(meta["class"])
    names = set(spec.tensor_names(meta, path))
    for j, sub in enumerate(spec.members(meta)):
        names |= _object_names(sub, f"{path}.{j}")
    return names


def test_every_class_has_a_layout_here():
    assert set(LAYOUTS) == set(CACHE_CLASSES)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_class_names_exactly_the_tensors_encode_writes(name):
    cache = LAYOUTS[name]()
    arrays: dict = {}
    for i, c in enumerate(cache):
        layer_arrays: dict = {}
        meta = json.loads(json.dumps(encode_layer(c, str(i), layer_arrays)))
        assert _object_names(meta, str(i)) == set(layer_arrays), (name, i, meta)
        arrays.update(layer_arrays)
    assert arrays  # every layout holds a filled layer: the comparison is not vacuous
    # the header walk asks the same objects and gets the same names
    metas = [json.loads(json.dumps(encode_layer(c, str(i), {}))) for i, c in enumerate(cache)]
    assert expected_tensor_names(metas, len(arrays)) == set(arrays)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_class_is_trimmable_when_mlx_lm_says_so_and_its_trim_is_exact(name):
    for layer in LAYOUTS[name]():
        dropped_front = getattr(layer, "start_position", 0) > 0
        assert is_trimmable([layer]) == (layer.is_trimmable() and not dropped_front), (
            name,
            type(layer).__name__,
        )


def test_a_chunked_cache_that_dropped_its_front_is_not_trimmable_because_its_trim_falls_short():
    full = _fed([ChunkedKVCache(4)])[0]
    assert full.start_position == N - 4 and full.is_trimmable()  # mlx-lm says yes ...
    assert full.trim(N - 2) == 4 and full.offset == N - 4  # ... but cuts 4 tokens, not 10
    assert not is_trimmable(_fed([ChunkedKVCache(4)]))
    assert is_trimmable(_fed([ChunkedKVCache(64)]))  # nothing dropped: every cut is exact


def test_a_rotating_cache_past_its_window_is_not_trimmable_and_below_it_is():
    past = _fed([RotatingKVCache(max_size=8)], n=12)
    below = _fed([RotatingKVCache(max_size=8)], n=5)
    assert not is_trimmable(past) and is_trimmable(below)
    _, past_layers = encode_cache(past, list(range(12)))
    _, below_layers = encode_cache(below, list(range(5)))
    assert not layers_trimmable(past_layers) and layers_trimmable(below_layers)
    # inside a CacheList the untrimmable member makes the whole layer untrimmable
    assert not layers_trimmable(
        [{"class": "CacheList", "caches": [{"class": "KVCache", "offset": 12}, past_layers[0]]}]
    )


def test_an_unknown_class_is_refused_by_encode_naming_it_and_the_fix():
    cache = _fed([KVCache()]) + [MysteryCache()]
    with pytest.raises(UnknownCacheClass) as err:
        encode_cache(cache, list(range(N)))
    text = str(err.value)
    assert (
        "cache layer 1 is 'MysteryCache'" in text
        and "not a cache class this kvsnap knows how to store" in text
    )
    assert "upgrade kvsnap, or report the class" in text and all(
        name in text for name in CACHE_CLASSES
    )
    assert isinstance(err.value, SnapshotError)  # callers that reject a snapshot catch this one


def test_an_unknown_class_is_refused_by_decode():
    with pytest.raises(UnknownCacheClass, match=r"cache layer 0 is 'MysteryCache'"):
        decode_cache({}, [{"class": "MysteryCache", "offset": 3}])


@pytest.mark.parametrize("bad", ["MysteryCache", "os.system", ["KVCache"], None, 7])
def test_an_unknown_class_is_refused_by_the_header_walk(bad):
    with pytest.raises(
        FormatError,
        match=r"kvsnap\.layers\[0\]\.class is .*not a cache class this kvsnap knows how to "
        r"store.*upgrade kvsnap",
    ):
        expected_tensor_names([{"class": bad}], 4)
    nested = [
        {"class": "CacheList", "caches": [{"class": "KVCache", "empty": True}, {"class": bad}]}
    ]
    with pytest.raises(FormatError, match=r"kvsnap\.layers\[0\]\.caches\[1\]\.class is "):
        expected_tensor_names(nested, 4)


def _write_store(root: Path, layers: list, arrays: dict) -> Path:
    """A real store holding one snapshot whose header lists ``layers`` (valid checksum, key and
    digests)."""
    tokens = list(range(N))
    classes = tuple(m["class"] for m in layers)
    metadata = snapshot_metadata(fixed_identity(classes), tokens, json.dumps(layers))
    store = Store.open(root, create=True)
    with store.lock():
        return store.put(
            metadata["kvsnap.key"],
            to_out_tensors({"tokens": mx.array(tokens, dtype=mx.int32), **arrays}),
            metadata,
        )


def test_kvsnap_verify_and_ls_refuse_a_snapshot_of_an_unknown_class(tmp_path):
    arrays, layers = encode_cache(_fed([KVCache()]), list(range(N)))
    arrays.pop("tokens")
    layers[0]["class"] = "MysteryCache"  # what a newer kvsnap with a new codec might write
    victim = _write_store(tmp_path / "s", layers, arrays)
    r = run_kvsnap("verify", tmp_path / "s", timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert (
        f"BAD  {victim}: kvsnap.layers[0].class is 'MysteryCache', not a cache class this kvsnap "
        f"knows how to store" in r.stdout
    ), r.stdout
    assert "upgrade kvsnap" in r.stdout
    r = run_kvsnap("ls", tmp_path / "s", "--json", timeout=120)
    assert r.returncode == 0 and [p["file"] for p in json.loads(r.stdout)["problems"]] == [
        str(victim)
    ], r.stdout + r.stderr


def _info(path: Path, layers: list) -> SnapshotInfo:
    return SnapshotInfo(
        path=path,
        key="k" * 32,
        name="agent",
        model_digest="a" * 32,
        model={},
        prompt_digest="d" * 32,
        n_tokens=N,
        layers=layers,
        recorded={},
        nbytes=1,
        tokens=tuple(range(N)),
    )


def test_the_warm_up_refuses_an_unknown_class_as_a_rejected_snapshot(tmp_path):
    from kvsnap.runtime.cache.entries import make_entry

    store = Store.open(tmp_path / "s", create=True)
    path = tmp_path / "s" / "snapshots" / "x.safetensors"
    with pytest.raises(UnknownCacheClass) as err:
        make_entry(
            None,
            store,
            _info(
                path, [{"class": "KVCache", "offset": N}, {"class": "MysteryCache", "offset": N}]
            ),
            pinned=False,
        )
    # warm-up reports (path, reason)
    assert err.value.path == str(path) and "layer 1 class is 'MysteryCache'" in err.value.reason


def test_the_warm_up_indexes_a_rotating_snapshot_past_its_window_as_untrimmable(tmp_path):
    from kvsnap.runtime.cache.entries import make_entry

    store = Store.open(tmp_path / "s", create=True)
    _, past = encode_cache(_fed([RotatingKVCache(max_size=8), KVCache()], n=N), list(range(N)))
    _, below = encode_cache(_fed([RotatingKVCache(max_size=64), KVCache()], n=N), list(range(N)))
    path = tmp_path / "x.safetensors"
    assert make_entry(None, store, _info(path, past), pinned=False).trimmable is False
    assert make_entry(None, store, _info(path, below), pinned=False).trimmable is True


class PagedKVCache(KVCache):
    """A cache class mlx-lm might add one day: kvsnap has no codec for it."""


@pytest.mark.parametrize("nested", [False, True])
def test_a_model_whose_cache_holds_an_unknown_class_is_refused_at_load(
    nested, demo_models, monkeypatch
):
    from kvsnap.errors import ModelError
    from kvsnap.runtime.model.loading import load_model

    def make_prompt_cache(model, max_kv_size=None):
        layer = CacheList(KVCache(), PagedKVCache()) if nested else PagedKVCache()
        return [KVCache(), layer]

    monkeypatch.setattr("mlx_lm.models.cache.make_prompt_cache", make_prompt_cache)
    with pytest.raises(ModelError) as err:
        load_model(demo_models.path("dense"))
    where = "cache layer[1].caches[1]" if nested else "cache layer[1]"
    assert (
        where in str(err.value)
        and "PagedKVCache" in str(err.value)
        and "upgrade kvsnap" in str(err.value)
    )


def test_a_model_with_known_cache_classes_loads(demo_models):
    from kvsnap.runtime.model.loading import load_model

    assert load_model(demo_models.path("hybrid")).layout
