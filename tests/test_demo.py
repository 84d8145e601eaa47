"""Demo models load offline, are deterministic and context-sensitive enough to catch broken caches."""

from __future__ import annotations

import pytest

import mlx.core as mx

from kvsnap.tools.demo import DemoSpec, make_demo_model
from kvsnap.errors import UsageError
from kvsnap.key import hash_file
from kvsnap.prompts import request_tokens


def _greedy(lm, tokens, n=16):
    cache = lm.make_cache()
    logits = lm.model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)[:, -1, :]
    first = logits
    out = []
    for _ in range(n):
        tok = mx.argmax(logits, axis=-1)
        out.append(tok.item())
        logits = lm.model(tok[None], cache=cache)[:, -1, :]
    return out, first


@pytest.mark.parametrize("name", ["dense", "hybrid", "sliding", "dense-q4"])
def test_two_system_prompts_give_different_greedy_outputs(demo_models, name):
    lm = demo_models.load(name)
    outs = []
    for system in ("You are a code reviewer.", "You are a planner for a trip."):
        tokens = request_tokens(lm.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": "hello world"}])
        out, first = _greedy(lm, tokens)
        top2 = mx.sort(first[0])[-2:]
        assert (top2[1] - top2[0]).item() > 1e-3, "near-uniform logits would let broken caches pass"
        outs.append(out)
    assert outs[0] != outs[1]


def test_expected_cache_layouts(demo_models):
    assert set(demo_models.load("dense").layout) == {"KVCache"}
    assert set(demo_models.load("hybrid").layout) == {"ArraysCache", "KVCache"}
    assert set(demo_models.load("sliding").layout) == {"RotatingKVCache", "KVCache"}


def test_demo_model_is_deterministic(tmp_path):
    a = make_demo_model(tmp_path / "a", DemoSpec())
    b = make_demo_model(tmp_path / "b", DemoSpec())
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert hash_file(a / name) == hash_file(b / name)
    c = make_demo_model(tmp_path / "c", DemoSpec(seed=1))
    assert hash_file(a / "model.safetensors") != hash_file(c / "model.safetensors")


def test_demo_model_loads_with_plain_mlx_lm_offline(tmp_path, monkeypatch):
    from mlx_lm import load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = make_demo_model(tmp_path / "m", DemoSpec(arch="hybrid"))
    model, tok = load(str(path))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_bad_spec_is_a_clear_error(tmp_path):
    with pytest.raises(UsageError, match="--arch 'moe' is not a demo architecture"):
        make_demo_model(tmp_path / "x", DemoSpec(arch="moe"))
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "junk").write_text("x")
    with pytest.raises(UsageError, match="not a model directory"):
        make_demo_model(tmp_path / "file", DemoSpec())
