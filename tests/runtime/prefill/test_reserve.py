"""A prefill allocates each growing layer's buffer once for the tokens it runs (mlx-lm grows them
256 tokens at a time, copying the whole cache each time: a build was quadratic in prompt
length), and holds the very bytes the growing prefill held, for every cache type.

Real tiny models, the real build pipeline; the count is of a real KVCache's buffer
replacements (a subclass that only counts)."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import pytest
from helpers.counting_cache import KVCache
from helpers.models import LONG_SYSTEM
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models import cache as mlx_cache

from kvsnap.build.pipeline import build_snapshots
from kvsnap.prompts import load_warm_prompts, parse_entry, warm_prefix
from kvsnap.runtime.prefill.chunked import PrefillCursor, prefill_in_blocks
from kvsnap.runtime.prefill.reserve import release, reserve, reserved
from kvsnap.snapshot.blocks import BlockSettings, plan_cuts
from kvsnap.snapshot.codec import decode_cache, encode_cache
from kvsnap.store.local import Store

BLOCKS = BlockSettings(64, 128)


def _counting(lm):
    """``lm`` whose caches count their buffer replacements (the shared model is not touched)."""
    counted = dataclasses.replace(lm)
    counted.make_cache = lambda: [KVCache() for _ in lm.make_cache()]  # type: ignore[method-assign]
    return counted


def _warm_tokens(lm, repeat: int = 3) -> list[int]:
    entry = parse_entry([{"role": "system", "content": LONG_SYSTEM * repeat}], 0)
    return list(warm_prefix(lm.tokenizer, entry).tokens)


def _grown(lm, tokens, ends):
    """The prefill before the reservation: mlx-lm's own growth, same chunks at the same ends."""
    s, cache, done = lm.settings, lm.make_cache(), 0
    for end in ends:
        for at in range(done, end, s.prefill_step_size):
            chunk = tokens[at : min(at + s.prefill_step_size, end)]
            lm.model(mx.array(chunk, dtype=mx.int32)[None], cache=cache)
            maybe_quantize_kv_cache(cache, s.quantized_kv_start, s.kv_group_size, s.kv_bits)
            mx.eval([c.state for c in cache])
        done = end
    return cache


def test_a_build_of_a_prompt_many_blocks_long_allocates_each_layers_buffer_once(
    demo_models, tmp_path
):
    lm = _counting(demo_models.load("dense"))
    made: list[list[KVCache]] = []
    make = lm.make_cache
    lm.make_cache = lambda: made.append(make()) or made[-1]  # type: ignore[method-assign]
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps([{"name": "long", "messages": [{"role": "system", "content": LONG_SYSTEM * 3}]}])
    )
    store = Store.open(tmp_path / "s", create=True)
    report = build_snapshots(lm, load_warm_prompts(agents), store, str(agents), blocks=BLOCKS)
    (entry,) = report.entries
    assert report.ok and entry.tokens_prefilled > 2 * 256, entry  # past two 256-token growths
    filled = [c for c in made if any(layer.offset for layer in c)]
    assert len(filled) == 1  # the cache the build prefilled (others only told the layout)
    assert [layer.replaced for layer in filled[0]] == [1] * len(filled[0])
    assert [layer.keys.shape[2] for layer in filled[0]] == [entry.n_tokens] * len(filled[0])


def test_a_prefill_from_a_restored_state_grows_once(demo_models):
    lm = demo_models.load("dense")
    tokens = _warm_tokens(lm)
    ends = [c.end for c in plan_cuts(len(tokens), set(), BLOCKS)]
    start = ends[1]
    arrays, layers = encode_cache(_grown(lm, tokens, ends[:2]), tokens[:start])
    restored = []
    for layer in decode_cache(arrays, layers):  # a restore's exact-size buffers, counted
        counted = KVCache()
        counted.keys, counted.values, counted.offset = layer.keys, layer.values, layer.offset
        counted.replaced = 0
        restored.append(counted)
    cache = prefill_in_blocks(lm, tokens, ends, restored, start)
    assert [layer.replaced for layer in cache] == [1] * len(cache)
    assert all(layer.offset == len(tokens) for layer in cache)


@pytest.mark.parametrize(
    "name,settings",
    [
        ("dense", {}),
        ("hybrid", {}),
        ("sliding", {}),
        ("dense", {"kv_bits": 8}),
        ("dense", {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 300}),
    ],
    ids=["dense", "hybrid-ssm", "sliding-window", "kv-bits-8", "kv-bits-4-from-300"],
)
def test_reserved_prefill_holds_the_bytes_the_growing_prefill_held(demo_models, name, settings):
    lm = demo_models.load(name, **settings)
    tokens = _warm_tokens(lm)
    ends = [c.end for c in plan_cuts(len(tokens), set(), BLOCKS)]
    want, _ = encode_cache(_grown(lm, tokens, ends), tokens)
    got, _ = encode_cache(prefill_in_blocks(lm, tokens, ends), tokens)
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and mx.array_equal(want[k], got[k]).item(), k


def test_a_cursor_reserves_its_tokens_and_hands_back_mlx_lms_growth_when_it_ends(demo_models):
    lm = demo_models.load("sliding")  # KVCache and RotatingKVCache layers
    tokens = _warm_tokens(lm, repeat=2)
    cursor = PrefillCursor(lm, tokens)
    kinds = {type(c).__name__ for c in cursor.cache}
    assert kinds == {"KVCache", "RotatingKVCache"}
    assert all(
        vars(c).get("step") == (len(tokens) if type(c).__name__ == "KVCache" else None)
        for c in cursor.cache
    )
    while cursor.step():
        pass
    assert all("step" not in vars(c) for c in cursor.cache)  # decode grows as mlx-lm has it
    for c in cursor.cache:
        if type(c).__name__ == "KVCache":
            assert c.keys.shape[2] == len(tokens)
        else:  # the sliding window keeps its own bound
            assert c.keys.shape[2] < len(tokens) and c.max_size < len(tokens)


def test_reserve_reaches_cache_list_members_and_never_shrinks_a_step():
    inner = mlx_cache.KVCache()
    layers = [mlx_cache.CacheList(inner, mlx_cache.ArraysCache(2)), mlx_cache.ArraysCache(1)]
    assert reserve(layers, 10_000) == 1 and inner.step == 10_000
    release(layers)
    assert "step" not in vars(inner) and inner.step == mlx_cache.KVCache.step
    with reserved(layers, 3):
        assert inner.step == mlx_cache.KVCache.step
    assert "step" not in vars(inner)
