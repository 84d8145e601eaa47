"""`kvsnap mlx-lm serve`: mlx-lm's own server (mlx_lm.server) warm from a kvsnap store.

Real mlx-lm 0.32 code throughout: its LRUPromptCache, its ResponseGenerator._tokenize,
its server on 127.0.0.1 beside a plain mlx_lm.server started the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from helpers.cli import build_args, run_kvsnap
from helpers.mlx_lm_route import (
    AGENTS,
    USERS,
    _ask,
    _kvsnap_mlx_lm,
    _launch,
    _llama_demo,
    _same_answers,
    _warmup,
)

ROOT = Path(__file__).resolve().parents[3]


# --- the prompt cache: warm entries protected from every eviction path -----------------


def _kv(n_tokens: int, seed: int = 0):
    """A real mlx-lm KVCache holding ``n_tokens`` (one layer, 2 heads, dim 4)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    mx.random.seed(seed)
    c.update_and_fetch(mx.random.normal((1, 2, n_tokens, 4)), mx.random.normal((1, 2, n_tokens, 4)))
    mx.eval(c.state)
    return [c]


def test_pinned_warm_entries_survive_size_bytes_and_prefix_eviction_and_are_private_copies():
    import mlx.core as mx

    from kvsnap.integrations.mlx_lm.cache import PinnedPromptCache

    cache = PinnedPromptCache(max_size=1)
    warm = list(range(100, 140))
    original = _kv(len(warm))
    cache.pin("m", warm, original)
    kept = mx.array(original[0].keys[..., : len(warm), :])
    # Request traffic: the agent's own longer turns (trimmable: mlx-lm drops their prefixes),
    # other prompts past --prompt-cache-size 1, then --prompt-cache-bytes' trim to nothing.
    cache.insert_cache("m", warm + [1, 2, 3], _kv(len(warm) + 3, 1), cache_type="user")
    for i in range(5):
        cache.insert_cache("m", [7, i, 8, 9], _kv(4, i), cache_type="system")
    cache.trim_to(n_sequences=0, n_bytes=0)
    got, rest = cache.fetch_nearest_cache("m", warm + [5, 6])
    assert rest == [5, 6] and got[0].offset == len(warm)
    # The request's copy is its own: writing into it leaves the warm entry unchanged.
    got[0].update_and_fetch(mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    again, _ = cache.fetch_nearest_cache("m", warm + [5, 6])
    assert again[0].offset == len(warm)
    assert mx.array_equal(again[0].keys[..., : len(warm), :], kept).item()
    assert (
        cache.pinned_count == 1
        and len(cache) == 1
        and cache.stats_by_type()["system"]["n_sequences"] == 1
    )
    # A longer LRU entry of the same conversation wins over the warm prefix.
    cache.insert_cache("m", warm + [5, 6, 7], _kv(len(warm) + 3, 2), cache_type="assistant")
    longer, rest = cache.fetch_nearest_cache("m", warm + [5, 6, 7, 8])
    assert rest == [8] and longer[0].offset == len(warm) + 3
    # Another model never sees the warm entry.
    assert cache.fetch_nearest_cache("other", warm + [5]) == (None, warm + [5])


# --- tokenization: kvsnap's --for mlx-lm prefix against mlx_lm.server's own _tokenize -----


def _server_tokens(tokenizer, messages, cli_chat_template_args=None, request_kwargs=None):
    """mlx_lm.server's own ResponseGenerator._tokenize on a chat request: (prompt, segments,
    types)."""
    from mlx_lm.server import CompletionRequest, ResponseGenerator

    owner = SimpleNamespace(
        model_provider=SimpleNamespace(
            processor=None,
            cli_args=SimpleNamespace(chat_template_args=cli_chat_template_args or {}),
        )
    )
    request = CompletionRequest(
        request_type="chat",
        prompt="",
        messages=[dict(m) for m in messages],
        tools=None,
        role_mapping=None,
    )
    args = SimpleNamespace(chat_template_kwargs=request_kwargs)
    prompt, segments, types, _, _ = ResponseGenerator._tokenize(owner, tokenizer, request, args)
    return list(prompt), segments, types


@pytest.mark.parametrize("name", ["dense", "hybrid", "llama"])
def test_mlx_lm_profile_prefix_is_a_strict_prefix_of_mlx_lm_servers_own_tokens(
    name, demo_models, tmp_path_factory
):
    from kvsnap.profiles import mlx_lm_tokenization
    from kvsnap.prompts import parse_warm_prompts, warm_prefix
    from kvsnap.runtime.model.loading import load_model

    lm = (
        load_model(_llama_demo(tmp_path_factory.mktemp("llama") / "m"))
        if name == "llama"
        else demo_models.load(name)
    )
    tok = lm.tokenizer
    for cli_args in ({}, {"enable_thinking": False}):
        profile = mlx_lm_tokenization(cli_args)
        for entry in parse_warm_prompts(AGENTS).entries:
            prefix = warm_prefix(tok, entry, profile).tokens
            for user in USERS:
                prompt, segments, types = _server_tokens(
                    tok, [*entry.messages, {"role": "user", "content": user}], cli_args
                )
                assert tuple(prompt[: len(prefix)]) == prefix and len(prompt) > len(prefix), (
                    user,
                    cli_args,
                )
                # mlx-lm's own cut, which kvsnap's prefix need not equal
                assert types[0] == "system"
    if name == "llama":
        bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
        # the tokenizer adds BOS on encode, as Meta's does
        assert list(tok.encode("hi"))[:1] == [bos]
        # one BOS only
        assert prefix[:2] == (bos, tok.encode("<|start_header_id|>", add_special_tokens=False)[0])


def test_real_llama3_tokenizer_mlx_lm_requests_start_with_one_bos_and_hit(tmp_path):
    """The real Llama-3 tokenizer (npm, BOS on encode as Meta ships it) through mlx-lm's
    wrapper and its server's _tokenize: one BOS, and the --for mlx-lm prefix matches."""
    from helpers.vllm_mlx_route import llama3_tokenizer_files
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from kvsnap.profiles import mlx_lm_tokenization
    from kvsnap.prompts import parse_warm_prompts, warm_prefix

    tok = load_tokenizer(llama3_tokenizer_files(tmp_path / "llama3"))
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert list(tok.encode("hi"))[0] == bos
    for entry in parse_warm_prompts(AGENTS).entries:
        prefix = warm_prefix(tok, entry, mlx_lm_tokenization()).tokens
        prompt, _, _ = _server_tokens(tok, [*entry.messages, {"role": "user", "content": USERS[0]}])
        assert prefix[0] == bos and prefix[1] != bos and tuple(prompt[: len(prefix)]) == prefix


# --- build --for mlx-lm ----------------------------------------------------------------


def test_build_for_mlx_lm_records_its_profile_and_refuses_what_mlx_lm_cannot_use(
    demo_models, tmp_path
):
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS[:1]))
    model = demo_models.path("dense")
    r = run_kvsnap(
        *build_args(agents, model, tmp_path / "s"),
        "--for",
        "mlx-lm",
        "--chat-template-args",
        '{"enable_thinking": false}',
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    from kvsnap.store.local import Store

    (info,) = Store.open(tmp_path / "s", readonly=True).scan()[0]
    recorded = info.recorded["tokenization"]
    recorded = json.loads(recorded) if isinstance(recorded, str) else recorded
    assert recorded == {
        "server": "mlx-lm",
        "add_special_tokens": False,
        "template_defaults": {"enable_thinking": False},
    }
    for bad, said in (
        (["--for", "mlx-lm", "--kv-bits", "8"], "drop --kv-bits"),
        (["--chat-template-args", "{}"], "only applies with --for mlx-lm"),
        (["--for", "mlx-lm", "--chat-template-args", "[1]"], "not a JSON object"),
    ):
        r = run_kvsnap("build", agents, "--model", model, "--out", tmp_path / "bad", *bad)
        assert r.returncode == 2 and said in r.stderr, r.stderr


def test_mlx_lm_serve_refuses_options_the_snapshots_cannot_serve(demo_models, tmp_path):
    model = str(demo_models.path("dense"))
    r = run_kvsnap("mlx-lm", "serve", "--model", model, "--warm-prompts", "a.json", timeout=120)
    assert r.returncode == 2 and "needs --kv-snapshots" in r.stderr, r.stderr
    (tmp_path / "s").mkdir()
    r = run_kvsnap(
        "mlx-lm",
        "serve",
        "--model",
        model,
        "--kv-snapshots",
        tmp_path / "s",
        "--adapter-path",
        tmp_path,
        "--port",
        "1",
        timeout=120,
    )
    assert r.returncode == 2 and "drop --adapter-path" in r.stderr, r.stderr


# --- end to end: kvsnap mlx-lm serve beside a plain mlx_lm.server ---------------------------


def _serve_and_ask(
    cmd: list[str], log: Path, asks: list[tuple[str, str]]
) -> tuple[list[dict], str, float]:
    server = _launch(cmd, log)
    try:
        ready = server.wait_ready(180)
        answers = [_ask(server, agent, user) for agent, user in asks]
    finally:
        server.stop()
    return answers, server.log(), ready


@pytest.fixture(scope="module")
def world(demo_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-lm-e2e")
    agents = root / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    models = {
        "dense": demo_models.path("dense"),
        "hybrid": demo_models.path("hybrid"),
        "llama": _llama_demo(root / "llama"),
    }
    n_tokens = {}
    for arch, model in models.items():
        r = run_kvsnap(
            "build", agents, "--model", model, "--out", root / "snaps", "--for", "mlx-lm", "--json"
        )
        assert r.returncode == 0, r.stdout + r.stderr
        n_tokens[arch] = {e["name"]: e["n_tokens"] for e in json.loads(r.stdout)["entries"]}
    return SimpleNamespace(
        root=root,
        agents=agents,
        models={k: str(v) for k, v in models.items()},
        store=root / "snaps",
        n_tokens=n_tokens,
    )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dense", "hybrid", "llama"])
def test_mlx_lm_serve_first_agent_request_hits_and_answers_like_plain_mlx_lm_server(
    world, arch, tmp_path
):
    model = world.models[arch]
    asks = [("reviewer", USERS[0]), ("planner", USERS[1]), ("reviewer", USERS[2])]
    warm, log, _ = _serve_and_ask(
        _kvsnap_mlx_lm(model, "--kv-snapshots", str(world.store)), tmp_path / "warm.log", asks
    )
    assert _warmup(log) == (2, 0), log[-3000:]  # both agents from the store, nothing prefilled
    n = world.n_tokens[arch]
    assert [a["cached"] for a in warm[:2]] == [n["reviewer"], n["planner"]], log[-3000:]
    cold, cold_log, _ = _serve_and_ask(
        [sys.executable, "-m", "mlx_lm", "server", "--model", model], tmp_path / "cold.log", asks
    )
    # Cold: the first request computes everything; the planner's shares a few template tokens.
    assert cold[0]["cached"] == 0 and cold[1]["cached"] < n["planner"] // 10, cold_log[-2000:]
    _same_answers(warm, cold)


@pytest.mark.slow
def test_warm_prompts_prefill_once_write_back_and_the_next_start_prefills_nothing(world, tmp_path):
    model, store = world.models["hybrid"], tmp_path / "fresh"
    cmd = _kvsnap_mlx_lm(model, "--kv-snapshots", str(store), "--warm-prompts", str(world.agents))
    first, log1, _ = _serve_and_ask(cmd, tmp_path / "first.log", [("planner", USERS[0])])
    assert _warmup(log1) == (0, 2), log1[-3000:]
    assert len(list((store / "snapshots").glob("*.safetensors"))) == 2
    second, log2, _ = _serve_and_ask(cmd, tmp_path / "second.log", [("planner", USERS[0])])
    assert _warmup(log2) == (2, 0), log2[-3000:]
    n = world.n_tokens["hybrid"]["planner"]
    assert first[0]["cached"] == second[0]["cached"] == n
    _same_answers(second, first)


@pytest.mark.slow
def test_agents_stay_warm_under_prompt_cache_size_and_bytes_pressure(world, tmp_path):
    model = world.models["dense"]
    others = [("reviewer", f"{i} unrelated question") for i in range(4)]
    cmd = _kvsnap_mlx_lm(
        model,
        "--kv-snapshots",
        str(world.store),
        "--prompt-cache-size",
        "1",
        "--prompt-cache-bytes",
        "1",
    )
    server = _launch(cmd, tmp_path / "pressure.log")
    try:
        server.wait_ready(180)
        for agent, user in others:
            _ask(server, agent, user)  # each evicts everything the LRU holds
        body = {
            "messages": [
                {"role": "system", "content": "Someone else entirely. " * 40},
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 4,
            "temperature": 0,
        }
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
        after = [_ask(server, "planner", USERS[2]), _ask(server, "reviewer", USERS[1])]
    finally:
        server.stop()
    n = world.n_tokens["dense"]
    assert [a["cached"] for a in after] == [n["planner"], n["reviewer"]], server.log()[-3000:]
