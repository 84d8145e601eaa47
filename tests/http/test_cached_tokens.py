"""`cached_tokens` on a server without API keys: one trust level, so nothing to round.

A real `kvsnap serve` on 127.0.0.1 with the tiny dense demo model, warm from one agent's
prompt. Every request below contains that whole warm prefix; sequential requests then also
match part of each other's kept prefixes, and concurrent ones a prefix computed once for
the batch. Each must report every token the engine reused (never less than the whole warm
prefix), and `/v1/status` must add up to what the responses said.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers.models import LONG_SYSTEM

from kvsnap.tools.serverproc import serving, start_server

AGENTS = [{"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]}]


@pytest.fixture(scope="module")
def open_server(demo_models, tmp_path_factory):
    """A batching server with no keys, warm from one agent's prompt (prefilled at start)."""
    tmp = tmp_path_factory.mktemp("cached-tokens")
    agents = tmp / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    args = ["--continuous-batching", "--max-batch-size", "4", "--warm-prompts", str(agents)]
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    with serving(demo_models.path("dense"), args, tmp / "serve.log", env, 600) as server:
        yield server


def _warm_length(demo_models, agent: dict) -> int:
    from kvsnap.prompts import parse_warm_prompts, warm_prefix

    lm = demo_models.load("dense")
    return len(warm_prefix(lm.tokenizer, parse_warm_prompts([agent]).entries[0]).tokens)


@pytest.fixture(scope="module")
def warm_length(demo_models) -> int:
    return _warm_length(demo_models, AGENTS[0])


def _ask(client: httpx.Client, url: str, question: str) -> dict:
    body = {
        "model": "dense",
        "messages": AGENTS[0]["messages"] + [{"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
    }
    r = client.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _saved(client: httpx.Client, url: str) -> tuple[int, int]:
    """(cache.tokens_saved, tokens.cached) from /v1/status."""
    body = client.get(f"{url}/v1/status").json()
    return body["cache"]["tokens_saved"], body["tokens"]["cached"]


def _cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_sequential_requests_report_every_reused_token_without_keys(open_server, warm_length):
    """Sequential requests containing the whole warm prefix reported it, then 256: the second
    matched part of the first's kept prefix (anonymous clients share one namespace) and was
    rounded down to a multiple of 128, below the warm prefix it contains."""
    assert warm_length > 256 and warm_length % 128 != 0  # rounding would show
    url = open_server.url
    with httpx.Client(timeout=60) as client:
        before = _saved(client, url)
        told = [
            _ask(client, url, f"Question number {i}: is this function correct?") for i in range(4)
        ]
        after = _saved(client, url)
    cached = [_cached(u) for u in told]
    assert cached[0] == warm_length, cached
    # Later ones also reuse the chat template's tokens after the system prompt (kept by the
    # earlier requests): more than the warm prefix, and exactly what the engine counted.
    assert all(c > warm_length for c in cached[1:]), cached
    assert after[0] - before[0] == sum(cached), (before, after, cached)
    assert after[1] - before[1] == sum(cached), (before, after, cached)


def test_concurrent_requests_report_every_reused_token_without_keys(open_server, warm_length):
    """Four concurrent requests reported 256 and 128 (a prefix computed once for the batch,
    then rounded); /v1/status counted more than the responses added up to."""
    url = open_server.url
    questions = [f"Concurrent question {c}: what does the {c} branch return?" for c in "ABCD"]
    with httpx.Client(timeout=60) as client:
        before = _saved(client, url)
        with ThreadPoolExecutor(len(questions)) as pool:
            told = list(pool.map(lambda q: _ask(client, url, q), questions))
        after = _saved(client, url)
    cached = [_cached(u) for u in told]
    assert min(cached) >= warm_length, cached
    assert after[0] - before[0] == sum(cached), (before, after, cached)
    assert after[1] - before[1] == sum(cached), (before, after, cached)


KEY, ADMIN = "tenant-key-aaaa-1111", "admin-key-cccc-3333"
TWO_AGENTS = AGENTS + [
    {
        "name": "reviewer-with-task",
        "messages": [
            {"role": "system", "content": LONG_SYSTEM},
            {"role": "user", "content": "Review the parser module and list every bug you find."},
            {"role": "assistant", "content": "I will start with the tests."},
        ],
    }
]


def test_with_keys_a_whole_warm_prompt_is_never_rounded_away(demo_models, tmp_path):
    """With keys, partial matches on shared entries are rounded (someone to hide them from),
    but a request containing a whole warm prompt whose longest match is part of a longer warm
    prompt still reports at least the whole one: the client sent those tokens itself."""
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(TWO_AGENTS))
    args = ["--warm-prompts", str(agents)]
    env = {
        "KVSNAP_CACHE_DIR": str(tmp_path / "cache"),
        "KVSNAP_API_KEY": KEY,
        "KVSNAP_ADMIN_API_KEY": ADMIN,
    }
    server = start_server(
        demo_models.path("dense"), args, tmp_path / "serve.log", env=env, limit_s=300
    )
    try:
        server.wait_ready(120)
        body = {
            "model": "dense",
            "messages": AGENTS[0]["messages"]
            + [{"role": "user", "content": "Review the parser module: is it right?"}],
            "max_tokens": 2,
            "temperature": 0,
        }
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        exact = server.status(ADMIN)["cache"]["tokens_saved"]
    finally:
        server.stop()
    whole = _warm_length(demo_models, AGENTS[0])
    assert exact > whole  # the longer warm prompt matched further, part-way
    assert cached == whole, (cached, whole, exact)


def test_a_checkpoint_inside_a_warm_prompt_is_not_a_whole_warm_prompt():
    """Only whole warm prompts lift the rounded count: a checkpoint inside one (a hybrid model's
    restart point, or where two warm prompts diverge) is a partial match of it, and its exact
    length would tell how far the request agrees with the operator's prompt. No model."""
    from kvsnap.runtime.cache.prefix import Entry, PrefixCache

    cache = PrefixCache(max_bytes=1000, copy_state=list, trim_state=lambda s, n: s[: len(s) - n])
    for tokens, inner in ((range(1, 6), False), (range(1, 11), True), (range(1, 21), False)):
        tokens = tuple(tokens)
        cache.add(
            Entry(
                tokens=tokens,
                state=list(tokens),
                nbytes=10,
                trimmable=True,
                pinned=True,
                source="snapshot",
                inner=inner,
            )
        )
    request = list(range(1, 16)) + [99]  # all of the 10-token checkpoint, part of the 20
    assert cache.whole_shared_prefix(request) == 5
    assert cache.whole_shared_prefix(list(range(1, 21)) + [99]) == 20
    assert cache.whole_shared_prefix([7, 8, 9]) == 0


def test_with_keys_a_prompt_that_is_exactly_a_warm_prompt_reports_what_was_reused(
    demo_models, tmp_path
):
    """A prompt that is exactly a warm prompt reuses all of it but its last token (that one
    must run to give the first logits): with keys, the whole warm prompt lifts the rounded
    count, but never above what the engine reused. It used to report the whole warm prompt,
    one token it computed counted as cached, and the responses above /v1/status."""
    from kvsnap.prompts import parse_warm_prompts, warm_prefix

    lm = demo_models.load("dense")
    warm = list(warm_prefix(lm.tokenizer, parse_warm_prompts(AGENTS).entries[0]).tokens)
    assert len(warm) % 128 > 1  # rounding alone would report less than the reuse
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    env = {
        "KVSNAP_CACHE_DIR": str(tmp_path / "cache"),
        "KVSNAP_API_KEY": KEY,
        "KVSNAP_ADMIN_API_KEY": ADMIN,
    }
    args = ["--warm-prompts", str(agents)]
    with serving(demo_models.path("dense"), args, tmp_path / "serve.log", env, 300) as server:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "dense", "prompt": warm, "max_tokens": 2, "temperature": 0},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        tokens = server.status(ADMIN)["tokens"]
    assert usage["prompt_tokens"] == len(warm)
    assert tokens["cached"] == len(warm) - 1 and tokens["computed"] == 1, tokens
    assert _cached(usage) == len(warm) - 1, usage
