"""Demo models load offline, are deterministic and context-sensitive enough to catch broken
caches."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvsnap.chat import request_tokens
from kvsnap.errors import UsageError
from kvsnap.key import hash_file
from kvsnap.tools.demo import DemoSpec, make_demo_model


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
        tokens = request_tokens(
            lm.tokenizer,
            [{"role": "system", "content": system}, {"role": "user", "content": "hello world"}],
        )
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
    assert tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ).endswith("<|im_start|>assistant\n")


def test_bad_spec_is_a_clear_error(tmp_path):
    with pytest.raises(UsageError, match="--arch 'mamba' is not a demo architecture"):
        make_demo_model(tmp_path / "x", DemoSpec(arch="mamba"))
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "junk").write_text("x")
    with pytest.raises(UsageError, match="not a model directory"):
        make_demo_model(tmp_path / "file", DemoSpec())


# --- the benchmark table's families ----------------------------------------------------

# name -> spec: the original table's families at test size.
FAMILIES = {
    "llama3": DemoSpec(arch="llama"),
    "dense-q8": DemoSpec(arch="dense", quantize_bits=8),
    "dense-q4": DemoSpec(arch="dense", quantize_bits=4),
    "moe-q4": DemoSpec(arch="moe", quantize_bits=4),
}
FAMILY_SYSTEM = (
    "You are a careful reviewer of python server code. Read the tests first, then check every "
    "function for errors. " * 4
)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: make_demo_model(root / name, spec) for name, spec in FAMILIES.items()}


def _greedy_from(lm, cache, tokens, n=12):
    logits = lm.model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)[:, -1, :]
    out = []
    for _ in range(n):
        tok = mx.argmax(logits, axis=-1)
        out.append(tok.item())
        logits = lm.model(tok[None], cache=cache)[:, -1, :]
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_generates_with_mlx_lm_and_its_snapshot_answers_like_a_cold_prefill(
    family_models, name, tmp_path, isolated_cache
):
    import json

    from mlx_lm import generate, load
    from mlx_lm.models.cache import make_prompt_cache

    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.prompts import parse_warm_prompts
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.snapshot.codec import decode_cache
    from kvsnap.store.local import Store

    path = family_models[name]
    model, tok = load(str(path))  # plain mlx-lm
    text = generate(
        model,
        tok,
        tok.apply_chat_template(
            [{"role": "user", "content": "hello world"}], tokenize=False, add_generation_prompt=True
        ),
        max_tokens=8,
    )
    assert isinstance(text, str) and text

    lm = load_model(path)
    agents = [{"name": "reviewer", "messages": [{"role": "system", "content": FAMILY_SYSTEM}]}]
    (tmp_path / "agents.json").write_text(json.dumps(agents))
    store = Store.open(tmp_path / "snaps", create=True)
    report = build_snapshots(
        lm,
        parse_warm_prompts(agents, str(tmp_path / "agents.json")),
        store,
        str(tmp_path / "agents.json"),
    )
    assert report.ok, report
    (info,) = store.scan()[0]
    warm = store.read_tokens(info)
    full = request_tokens(
        lm.tokenizer,
        [
            {"role": "system", "content": FAMILY_SYSTEM},
            {"role": "user", "content": "Please review the request handler."},
        ],
    )
    assert full[: len(warm)] == warm and len(full) > len(warm)

    cold = _greedy_from(lm, make_prompt_cache(lm.model), full)
    restored = decode_cache(store.load_arrays(info), info.layers)
    assert _greedy_from(lm, restored, full[len(warm) :]) == cold
    # The state matters: without it the same suffix answers differently, so a broken restore would
    # show.
    assert _greedy_from(lm, make_prompt_cache(lm.model), full[len(warm) :]) != cold


def test_family_configs_are_what_the_hub_ships(family_models):
    import json

    def config(name):
        return json.loads((family_models[name] / "config.json").read_text())

    for name, bits in (("dense-q8", 8), ("dense-q4", 4)):
        c = config(name)
        assert c["model_type"] == "qwen3"
        assert (
            c["quantization"]["bits"] == bits
            and c["quantization"]["group_size"] == 64
            and c["quantization_config"] == c["quantization"]
        )
    moe = config("moe-q4")
    assert (
        moe["model_type"] == "qwen3_5_moe"
        and moe["text_config"]["num_experts"] > moe["text_config"]["num_experts_per_tok"] > 0
    )
    # mlx_lm.convert's predicate for this model: the router stays at 8 bits, the experts go to 4.
    assert moe["quantization"]["bits"] == 4 and moe["quantization"][
        "language_model.model.layers.0.mlp.gate"
    ] == {"group_size": 64, "bits": 8}
    assert config("llama3")["model_type"] == "llama"


def test_family_cache_layouts(family_models):
    from kvsnap.runtime.model.loading import load_model

    assert load_model(family_models["moe-q4"]).layout == (
        "ArraysCache",
        "ArraysCache",
        "ArraysCache",
        "KVCache",
    )
    assert set(load_model(family_models["dense-q8"]).layout) == {"KVCache"}
    assert set(load_model(family_models["llama3"]).layout) == {"KVCache"}


def test_llama3_tokenizer_adds_bos_on_encode_and_the_template_carries_its_own(family_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_models["llama3"])
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|eot_id|>"
    assert (
        tok.encode("hello world")[0] == bos
        and tok.encode("hello world", add_special_tokens=False)[0] != bos
    )
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hello"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text == "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe "
        "brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # Like Meta's: a plain encode of the rendered prompt starts with two BOS, kvsnap's request path
    # with one.
    assert tok.encode(text)[:2] == [bos, bos]
    assert (
        request_tokens(tok, messages)[:2] != [bos, bos] and request_tokens(tok, messages)[0] == bos
    )
    for special in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_templates_and_sizes_must_fit_the_architecture(tmp_path):
    with pytest.raises(UsageError, match="llama3 template goes with --arch llama"):
        make_demo_model(tmp_path / "a", DemoSpec(arch="dense", template="llama3"))
    with pytest.raises(UsageError, match="--template chatml does not fit --arch llama"):
        make_demo_model(tmp_path / "b", DemoSpec(arch="llama", template="chatml"))
    with pytest.raises(
        UsageError, match="--size 'qwen3-0.6b' has no shape for --arch moe; use one of tiny, small"
    ):
        make_demo_model(tmp_path / "c", DemoSpec(arch="moe", size="qwen3-0.6b"))
    assert not any(tmp_path.iterdir())


def test_text_outputs_models_never_pick_a_special_or_partial_utf8_token(tmp_path):
    """The benchmark's models: streamed text starts with the first token and every request runs to
    max_tokens."""
    import json

    from mlx_lm.models.cache import make_prompt_cache

    from kvsnap.runtime.model.loading import load_model

    path = make_demo_model(
        tmp_path / "m", DemoSpec(arch="llama", quantize_bits=4, text_outputs=True)
    )
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False
    lm = load_model(path)
    specials = set(lm.tokenizer.all_special_ids)
    for user in ("hello world", "中文 内容 你好", "4 2 100 ! ? ."):
        tokens = request_tokens(
            lm.tokenizer,
            [{"role": "system", "content": FAMILY_SYSTEM}, {"role": "user", "content": user}],
        )
        out = _greedy_from(lm, make_prompt_cache(lm.model), tokens, n=24)
        assert not specials & set(out), out
        assert all(
            lm.tokenizer.decode([t]) and "\ufffd" not in lm.tokenizer.decode([t]) for t in out
        ), [lm.tokenizer.decode([t]) for t in out]
    # Off by default for the tests' sizes: their weights stay what they were.
    assert (
        DemoSpec(arch="llama").plain_text_outputs is False
        and DemoSpec(arch="llama", size="small").plain_text_outputs is True
    )
