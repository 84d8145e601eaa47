"""`kvsnap serve` in front of hostile clients: keys, tenant isolation, bounded input, cancel, admin.

Each test is named after the attack it pins. Real uvicorn servers on
127.0.0.1 with the tiny dense demo model; keys come from the environment, as the docs say.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers.models import LONG_SYSTEM

from kvsnap.tools.serverproc import free_port, serving, start_server

USER_A, USER_B, ADMIN = "user-key-aaaa-1111", "user-key-bbbb-2222", "admin-key-cccc-3333"
AGENTS = [{"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]}]


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat_body(content: str, **extra) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture(scope="module")
def keyed(demo_models, tmp_path_factory):
    """A batching server with two user keys and one admin key, warm from one agent's snapshot."""
    from helpers.cli import build_args, run_kvsnap

    tmp = tmp_path_factory.mktemp("keyed")
    model = tmp / "m"
    model.symlink_to(demo_models.path("dense"), target_is_directory=True)
    agents = tmp / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    env = {
        "KVSNAP_CACHE_DIR": str(tmp / "cache"),
        "KVSNAP_API_KEY": f"{USER_A},{USER_B}",
        "KVSNAP_ADMIN_API_KEY": ADMIN,
    }
    r = run_kvsnap(
        *build_args(agents, model, tmp / "snaps"),
        env={"KVSNAP_CACHE_DIR": str(tmp / "cache")},
    )
    assert r.returncode == 0, r.stderr
    args = [
        "--continuous-batching",
        "--warm-prompts",
        str(agents),
        "--kv-snapshots",
        str(tmp / "snaps"),
        "--max-request-bytes",
        "200000",
        "--max-batch-size",
        "2",
        "--max-queued-requests",
        "1",
    ]
    server = start_server(model, args, tmp / "keyed.log", env=env, limit_s=600)
    try:
        server.wait_ready(120)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


# --- finding 5: authentication ------------------------------------------------------------


def test_every_endpoint_but_health_needs_a_key(keyed, client):
    url = keyed.url
    assert client.get(f"{url}/health").status_code == 200
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/v1/status"),
        ("DELETE", "/v1/cache/prefix"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
        ("GET", "/nowhere"),
    ]:
        for headers in (
            {},
            auth("wrong-key-0000-0000"),
            {"Authorization": USER_A},
            {"Authorization": f"Basic {USER_A}"},
        ):
            r = client.request(method, f"{url}{path}", headers=headers, json=chat_body("hi"))
            assert_openai_error(r, 401, "invalid_api_key")
    assert client.get(f"{url}/v1/models", headers=auth(USER_A)).status_code == 200
    # the schema pages are off with keys
    assert client.get(f"{url}/docs", headers=auth(USER_A)).status_code == 404
    assert USER_A not in keyed.log() and ADMIN not in keyed.log()


def near_misses(key: str) -> list[str]:
    """Keys a sloppy comparison would take for ``key``: one character changed (first, middle,
    last), a prefix, the key plus a suffix, and the key in another case."""

    def swap(i: int) -> str:
        return key[:i] + ("x" if key[i] != "x" else "y") + key[i + 1 :]

    return [
        swap(0),
        swap(len(key) // 2),
        swap(len(key) - 1),
        key[:-1],
        key[: len(key) // 2],
        key + "0",
        key + " " + key,
        key.upper(),
    ]


def test_near_miss_keys_are_refused_and_do_not_pass_for_admin(keyed, client):
    url = keyed.url
    for key in (USER_A, USER_B, ADMIN):
        for miss in near_misses(key):
            assert miss not in (USER_A, USER_B, ADMIN)
            r = client.get(f"{url}/v1/models", headers=auth(miss))
            assert_openai_error(r, 401, "invalid_api_key")
    # An ordinary key with the admin key's tail, or a near miss of the admin key, is no admin.
    for miss in near_misses(ADMIN):
        r = client.delete(f"{url}/v1/cache/prefix", headers=auth(miss))
        assert_openai_error(r, 401, "invalid_api_key")
    assert client.get(f"{url}/v1/models", headers=auth(USER_B)).status_code == 200


def test_only_an_admin_key_clears_the_cache_and_sees_every_request(keyed, client):
    url = keyed.url
    assert_openai_error(
        client.delete(f"{url}/v1/cache/prefix", headers=auth(USER_A)),
        403,
        "insufficient_permissions",
    )
    user = client.get(f"{url}/v1/status", headers=auth(USER_A)).json()
    assert "snapshots" not in user and "warmup" not in user and "model" not in user
    assert str(keyed.log_path.parent) not in json.dumps(user)  # no file paths for ordinary keys
    admin = client.get(f"{url}/v1/status", headers=auth(ADMIN)).json()
    assert "snapshots" in admin and "warmup" in admin


def test_an_ordinary_key_sees_only_its_own_requests_in_status(keyed, client):
    url = keyed.url
    body = chat_body("Write a long story about a tree.", max_tokens=400)
    done = threading.Event()

    def long_request():
        with httpx.Client(timeout=120) as c:
            c.post(f"{url}/v1/chat/completions", json=body, headers=auth(USER_A))
        done.set()

    t = threading.Thread(target=long_request)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not client.get(f"{url}/v1/status", headers=auth(ADMIN)).json()["requests"]:
            assert time.monotonic() < deadline and not done.is_set(), (
                "the long request never showed up"
            )
            time.sleep(0.05)
        assert len(client.get(f"{url}/v1/status", headers=auth(USER_A)).json()["requests"]) == 1
        assert client.get(f"{url}/v1/status", headers=auth(USER_B)).json()["requests"] == []
    finally:
        t.join(120)


# --- finding 2: tenant isolation ----------------------------------------------------------


def _cached(client, url, key, content, **extra) -> int:
    r = client.post(
        f"{url}/v1/chat/completions", json=chat_body(content, **extra), headers=auth(key)
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_key_cannot_read_back_a_prompt_through_cached_tokens(keyed, client):
    url = keyed.url
    secret = "My bank account number is 4812 and my pin is 7731, please remember both carefully."
    _cached(client, url, USER_A, secret)
    # The victim's own next turn reuses its prefix...
    assert _cached(client, url, USER_A, secret + " Also this.") > 0
    # ...another key, probing the same text, learns nothing (each probe in a fresh salt, so
    # B's own earlier probes cannot answer it either).
    for i, probe in enumerate(
        (secret[:40], secret.replace("4812", "4811"), secret + " Also this.")
    ):
        assert _cached(client, url, USER_B, probe, cache_salt=f"probe-{i}") == 0


def test_cache_salt_scopes_prefixes_within_one_key(keyed, client):
    url = keyed.url
    text = "Salted conversation about the weather in the mountains this week and next."
    _cached(client, url, USER_B, text, cache_salt="tenant-one")
    assert _cached(client, url, USER_B, text + " More.", cache_salt="tenant-one") > 0
    assert _cached(client, url, USER_B, text + " More.", cache_salt="tenant-two") == 0
    assert _cached(client, url, USER_B, text + " More.") == 0


def test_warm_snapshots_stay_shared_and_partial_matches_are_coarse(keyed, client):
    url = keyed.url
    full = client.post(
        f"{url}/v1/chat/completions",
        json={
            **chat_body("q"),
            "messages": AGENTS[0]["messages"] + [{"role": "user", "content": "q"}],
        },
        headers=auth(USER_B),
    ).json()
    # every key hits the operator's warm prompt
    assert full["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # A probe that shares only part of the warm prompt learns at most a multiple of 128 tokens.
    probe = [
        {"role": "system", "content": LONG_SYSTEM[:200] + " something else entirely"},
        {"role": "user", "content": "q"},
    ]
    # (A fresh salt: the count is never below the caller's own best match, and A has entries.)
    r = client.post(
        f"{url}/v1/chat/completions",
        json={**chat_body("q", cache_salt="coarse"), "messages": probe},
        headers=auth(USER_A),
    ).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] % 128 == 0


def test_tenant_status_shows_nothing_that_moves_with_other_tenants_traffic(keyed, client):
    """Cache counters, memory and queue lengths moved with others' requests and
    spelled out match lengths (``tokens_saved`` deltas); in-flight rows gave exact counts."""
    url = keyed.url
    before = _settled_status(client, url, USER_A)
    _cached(client, url, USER_B, "Another tenant's request about the weather today.")
    after = client.get(f"{url}/v1/status", headers=auth(USER_A)).json()
    assert set(after) == {"warm", "requests", "rewarm_in_progress", "version", "uptime_s"}
    assert {k: v for k, v in before.items() if k != "uptime_s"} == {
        k: v for k, v in after.items() if k != "uptime_s"
    }
    admin = client.get(f"{url}/v1/status", headers=auth(ADMIN)).json()
    assert admin["cache"]["hits"] >= 1 and "tokens" in admin  # admin keys keep the full view


def _settled_status(client, url: str, key: str, limit_s: float = 10.0) -> dict:
    """``/v1/status`` for ``key`` once its own earlier requests have left the engine: a
    request is answered before the engine drops its row, so a status read right after an
    earlier test's request can still list it (bounded wait)."""
    deadline = time.monotonic() + limit_s
    while True:
        body = client.get(f"{url}/v1/status", headers=auth(key)).json()
        if not body["requests"] or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def _warm_tokens(demo_models) -> list[int]:
    from kvsnap.prompts import parse_warm_prompts, warm_prefix

    lm = demo_models.load("dense")
    return list(warm_prefix(lm.tokenizer, parse_warm_prompts(AGENTS).entries[0]).tokens)


def _attack_transcript(client, url, warm: list[int], m: int, run: str) -> list[int]:
    """A tenant's binary search on a probe sharing ``m`` tokens with the warm prompt:
    for each length L, an own entry of L probe tokens (a fresh salt per step), then the probe.
    Returns every ``cached_tokens`` it was told."""
    free = [t for t in range(5, 700) if t not in warm[: len(warm)]]
    probe = warm[:m] + free[: 300 - m]  # one length for every m: only the match differs

    def cached(prompt: list[int], salt: str) -> int:
        body = {
            "model": "m",
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "cache_salt": salt,
        }
        r = client.post(f"{url}/v1/completions", json=body, headers=auth(USER_B))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    seen = [cached(probe, f"{run}-base")]
    lo, hi = seen[0], len(probe) - 1  # the smallest L whose own entry wins lies in (lo, hi]
    for step in range(12):  # bounded: log2(len(probe)) steps suffice
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        salt = f"{run}-{step}"
        cached(probe[:mid] + [free[-1 - step]], salt)  # the tenant's own entry: probe[:mid]
        got = cached(probe, salt)
        seen.append(got)
        lo, hi = (lo, mid) if got == mid else (mid, hi)
    return seen + [hi]


def test_cached_tokens_binary_search_against_own_entries_learns_only_the_rounded_match(
    keyed, client, demo_models
):
    """With entries of its own of chosen lengths, a tenant binary-searched the exact
    length a probe shares with the operator's warm prompt. Two probes sharing 150 and 220
    tokens (both 128 once rounded) must give the attacker the very same answers."""
    warm = _warm_tokens(demo_models)
    assert len(warm) > 240
    first = _attack_transcript(client, keyed.url, warm, 150, "atk-150")
    second = _attack_transcript(client, keyed.url, warm, 220, "atk-220")
    assert first[0] == second[0] == 128
    assert first == second, (first, second)
    assert first[-1] not in (150, 151, 220, 221)


# --- findings 1, 3, 9: templates, token ids, bad numbers and text -----------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chat_template": "INJECTED {{ 7*6 }}"},
        {
            "chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor "
            "%}{% endfor %}"
        },
        {"tokenize": True},
        {"messages": []},
        {"bos_token": "<|im_start|>"},
        {"not_a_variable": 1},
    ],
)
def test_template_kwargs_outside_the_models_template_are_refused(keyed, client, kwargs):
    t0 = time.monotonic()
    r = client.post(
        f"{keyed.url}/v1/chat/completions",
        json=chat_body("hi", chat_template_kwargs=kwargs),
        headers=auth(USER_A),
    )
    err = assert_openai_error(r, 400, "invalid_value")
    assert (
        next(iter(kwargs)) in err["message"]
        and err["param"] == f"chat_template_kwargs.{next(iter(kwargs))}"
    )
    assert time.monotonic() - t0 < 5


def test_a_variable_the_template_reads_is_accepted(keyed, client):
    r = client.post(
        f"{keyed.url}/v1/chat/completions",
        json=chat_body("hi", chat_template_kwargs={"enable_thinking": False}),
        headers=auth(USER_A),
    )
    assert r.status_code == 200, r.text
    bad = client.post(
        f"{keyed.url}/v1/chat/completions",
        json=chat_body("hi", chat_template_kwargs={"enable_thinking": {"nested": [1]}}),
        headers=auth(USER_A),
    )
    assert_openai_error(bad, 400, "invalid_value")


def test_token_ids_are_bounded_by_the_embedding_rows(keyed, client, demo_models):
    from kvsnap.http.limits import embedding_rows

    rows = embedding_rows(demo_models.load("dense").model)
    for ids in ([5_000_000], [rows], [-1], [1, rows + 1], [2**40]):
        r = client.post(
            f"{keyed.url}/v1/completions",
            json={"model": "m", "prompt": ids, "max_tokens": 1},
            headers=auth(USER_A),
        )
        assert_openai_error(r, 400, "invalid_value")
    ok = client.post(
        f"{keyed.url}/v1/completions",
        json={"model": "m", "prompt": [rows - 1, 1], "max_tokens": 1},
        headers=auth(USER_A),
    )
    assert ok.status_code == 200, ok.text


def test_nested_text_config_still_bounds_ids_and_context(demo_models):
    from kvsnap.http.limits import context_length, vocab_bound

    lm = demo_models.load("dense")
    nested = {
        "model_type": "gemma3",
        "text_config": {k: v for k, v in lm.config.items() if k != "model_type"},
    }
    nested["text_config"].pop("vocab_size", None)
    assert (
        vocab_bound(lm.model, nested)
        == vocab_bound(lm.model, {})
        == lm.model.model.embed_tokens.weight.shape[0]
    )
    assert context_length({"text_config": {"max_position_embeddings": 4096}}) == 4096
    assert (
        context_length(
            {"max_position_embeddings": 512, "text_config": {"max_position_embeddings": 4096}}
        )
        == 512
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("seed", 2**70),
        ("seed", -(2**64)),
        ("max_tokens", 2**70),
        ("temperature", 1e308),
        ("top_p", -1),
        ("stop", ["x" * 5000]),
        ("n", 2),
        ("cache_salt", ""),
    ],
)
def test_numbers_at_the_limits_get_a_400(keyed, client, field, value):
    r = client.post(
        f"{keyed.url}/v1/chat/completions",
        json=chat_body("hi", **{field: value}),
        headers=auth(USER_A),
    )
    err = assert_openai_error(r, 400, "invalid_value")
    assert err["param"] == field


def test_negative_and_uint64_seeds_are_valid(keyed, client):
    for seed in (-1, 2**64 - 1, 0):
        r = client.post(
            f"{keyed.url}/v1/chat/completions",
            json=chat_body("hi", seed=seed, temperature=0.8),
            headers=auth(USER_A),
        )
        assert r.status_code == 200, r.text


def _token_ids(r: httpx.Response) -> list[tuple[int, ...]]:
    """The answer's tokens, each as its bytes (the chat logprobs' shape carries no id)."""
    assert r.status_code == 200, r.text
    return [tuple(t["bytes"]) for t in r.json()["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize(
    "sampling",
    [
        {"top_k": 2**31 - 1, "temperature": 1.0, "seed": 3},
        {"top_k": 2**31 - 1, "temperature": 1.0},
        {"top_p": 1e-50, "temperature": 1.0, "seed": 3},
        {"min_p": 5e-324, "top_k": 100000, "temperature": 1.0, "seed": 3},
    ],
)
def test_one_tenants_sampling_values_do_not_fail_another_tenants_batched_request_issue_39(
    keyed, client, sampling
):
    """A top_k of the vocabulary or more made mlx-lm's sampler raise for the whole batch: the
    other key's greedy request got a 500 too."""
    greedy = chat_body("Tell me about the reviewer's rules.", max_tokens=24, logprobs=True)
    alone = _token_ids(
        client.post(f"{keyed.url}/v1/chat/completions", json=greedy, headers=auth(USER_B))
    )
    answers: dict[str, httpx.Response] = {}

    def send(name: str, key: str, body: dict) -> None:
        answers[name] = client.post(
            f"{keyed.url}/v1/chat/completions", json=body, headers=auth(key)
        )

    threads = [
        threading.Thread(target=send, args=("greedy", USER_B, greedy)),
        threading.Thread(
            target=send,
            args=("sampled", USER_A, chat_body("Tell me a story.", max_tokens=16, **sampling)),
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers["sampled"].status_code == 200, answers["sampled"].text
    assert _token_ids(answers["greedy"]) == alone


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 5e-6])
def test_a_temperature_below_the_floor_answers_as_greedy_issue_39(keyed, client, temperature):
    """1e-39 overflowed 1/temperature in float32: the draw was uniform, not the greedy token."""
    body = chat_body("Name three rivers.", max_tokens=12, logprobs=True)
    greedy = _token_ids(
        client.post(f"{keyed.url}/v1/chat/completions", json=body, headers=auth(USER_A))
    )
    for seed in (1, 2, 3):
        tiny = {**body, "temperature": temperature, "seed": seed}
        assert (
            _token_ids(
                client.post(f"{keyed.url}/v1/chat/completions", json=tiny, headers=auth(USER_A))
            )
            == greedy
        )


@pytest.mark.parametrize(
    "path,raw",
    [
        (
            "/v1/chat/completions",
            b'{"model":"m","messages":[{"role":"user","content":"a\\ud800b"}]}',
        ),
        ("/v1/completions", b'{"model":"m","prompt":"x\\udfffy"}'),
        (
            "/v1/chat/completions",
            b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stop":["\\ud800"]}',
        ),
    ],
)
def test_lone_surrogates_get_a_json_400(keyed, client, path, raw):
    r = client.post(
        f"{keyed.url}{path}",
        content=raw,
        headers={**auth(USER_A), "content-type": "application/json"},
    )
    assert_openai_error(r, 400, "invalid_value")


# --- bounded load -----------------------------------------------------------------------


def test_an_oversized_body_gets_413_declared_or_streamed(keyed, client):
    big = json.dumps(chat_body("x" * 300_000)).encode()
    assert_openai_error(
        client.post(
            f"{keyed.url}/v1/chat/completions",
            content=big,
            headers={**auth(USER_A), "content-type": "application/json"},
        ),
        413,
        "request_too_large",
    )

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    assert_openai_error(
        client.post(
            f"{keyed.url}/v1/chat/completions",
            content=chunks(),
            headers={**auth(USER_A), "content-type": "application/json"},
        ),
        413,
        "request_too_large",
    )


def test_a_full_queue_answers_429_with_retry_after(keyed, client):
    url = keyed.url
    body = chat_body("Tell a very long story about rivers.", max_tokens=300)
    threads = [
        threading.Thread(
            target=lambda: httpx.post(
                f"{url}/v1/chat/completions", json=body, headers=auth(USER_A), timeout=120
            )
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while True:  # 2 running + 1 queued fill it
            st = client.get(f"{url}/v1/status", headers=auth(ADMIN)).json()
            if len(st["requests"]) >= 3:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        r = client.post(
            f"{url}/v1/chat/completions", json=chat_body("one more"), headers=auth(USER_B)
        )
        assert_openai_error(r, 429)
        assert r.headers["retry-after"] == "1"
    finally:
        for t in threads:
            t.join(120)
    assert (
        client.post(
            f"{url}/v1/chat/completions", json=chat_body("after"), headers=auth(USER_B)
        ).status_code
        == 200
    )


# --- admin: re-warm -----------------------------------------------------------------------


def test_deletes_during_a_rewarm_are_coalesced_and_answer_the_same(keyed, client):
    url = keyed.url
    before = client.get(f"{url}/v1/status", headers=auth(ADMIN)).json()
    answers = [
        client.delete(f"{url}/v1/cache/prefix", headers=auth(ADMIN)).json() for _ in range(5)
    ]
    assert all(a["status"] == "cleared" and a["rewarm_scheduled"] is True for a in answers)
    # Each answer is sent once the engine has cleared: all five are counted at once.
    now = client.get(f"{url}/v1/status", headers=auth(ADMIN)).json()
    assert (
        now["rewarms"] + now["rewarms_coalesced"]
        == before["rewarms"] + before["rewarms_coalesced"] + 5
    ), (before, now)
    deadline = time.monotonic() + 30
    while (st := client.get(f"{url}/v1/status", headers=auth(ADMIN)).json())["rewarm_in_progress"]:
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    assert 1 <= st["rewarms"] - before["rewarms"] <= 5
    assert (
        st["rewarms"] - before["rewarms"] + st["rewarms_coalesced"] - before["rewarms_coalesced"]
        == 5
    )
    # from the snapshot, no prefill
    assert st["snapshots"]["prefilled"] == before["snapshots"]["prefilled"]
    full = client.post(
        f"{url}/v1/chat/completions",
        json={
            **chat_body("q"),
            "messages": AGENTS[0]["messages"] + [{"role": "user", "content": "q"}],
        },
        headers=auth(USER_A),
    ).json()
    assert full["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert client.get(f"{url}/health").status_code == 200


# --- finding 4: abandoned requests --------------------------------------------------------


@pytest.fixture(scope="module")
def sequential(demo_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sequential")
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    with serving(
        demo_models.path("dense"), ["--served-model-name", "m"], tmp / "seq.log", env, 600
    ) as server:
        yield server


@pytest.mark.parametrize("which", ["keyed", "sequential"])
def test_an_abandoned_non_streaming_request_stops_within_two_seconds(which, request, client):
    server = request.getfixturevalue(which)
    headers = auth(ADMIN) if which == "keyed" else {}
    # minutes of decoding on this model
    body = chat_body("Write an endless story about the sea.", max_tokens=30_000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=1.0)
    gone_by = time.monotonic() + 2.5
    while client.get(f"{server.url}/v1/status", headers=headers).json()["requests"]:
        assert time.monotonic() < gone_by, "the abandoned request is still generating"
        time.sleep(0.05)
    t0 = time.monotonic()
    assert (
        client.post(
            f"{server.url}/v1/chat/completions", json=chat_body("next"), headers=headers
        ).status_code
        == 200
    )
    assert time.monotonic() - t0 < 10


# --- finding 12: a failed warm-up ends the server ----------------------------------------


def test_kv_snapshots_naming_a_file_fails_at_once(demo_models, tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("x")
    env = {**os.environ, "KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsnap",
            "serve",
            str(demo_models.path("dense")),
            "--port",
            str(free_port()),
            "--kv-snapshots",
            str(not_a_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2 and str(not_a_dir) in r.stderr and "is a file" in r.stderr, r.stderr[
        -2000:
    ]


def test_a_warm_up_that_fails_in_the_engine_ends_the_server_non_zero(demo_models, tmp_path):
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    from kvsnap.store.local import Store

    # a store already (an empty folder is made one without a write probe)
    Store.open(tmp_path / "snaps", create=True)
    # An error the warm-up cannot place (not a bad file, not a full disk): injected at the store
    # probe.
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache"), "KVSNAP_FAULT": "write-probe=crash"}
    server = start_server(
        demo_models.path("dense"),
        ["--warm-prompts", str(agents), "--kv-snapshots", str(tmp_path / "snaps")],
        tmp_path / "fail.log",
        env=env,
        limit_s=120,
    )
    try:
        rc = server.proc.wait(60)
    finally:
        server.stop()
    assert rc == 1, server.log()[-2000:]
    assert "warm-up failed" in server.log() and "injected fault at write-probe" in server.log()


# --- finding 8: no file I/O under a lock the event loop takes ------------------------------


def test_a_slow_lazy_load_does_not_block_status_readers():
    from kvsnap.runtime.cache.prefix import Entry, PrefixCache

    release = threading.Event()

    def slow_loader():
        release.wait(5)  # a multi-GB snapshot being read
        return "state", 10

    cache = PrefixCache(max_bytes=10**6, copy_state=lambda s: s, trim_state=lambda s, n: s)
    cache.add(
        Entry(
            tokens=(1, 2, 3),
            state=None,
            nbytes=10,
            trimmable=True,
            pinned=True,
            source="snapshot",
            loader=slow_loader,
        )
    )
    fetcher = threading.Thread(target=lambda: cache.fetch([1, 2, 3, 4]))
    fetcher.start()
    try:
        time.sleep(0.2)  # the fetch is inside the loader now
        t0 = time.monotonic()
        assert len(cache) == 1 and cache.current_bytes == 0 and cache.stats.hits == 0
        assert time.monotonic() - t0 < 0.5
    finally:
        release.set()
        fetcher.join(10)
    assert cache.stats.hits == 1 and cache.stats.loads == 1


def test_prefixes_of_two_namespaces_never_match_each_other():
    from kvsnap.runtime.cache.prefix import Entry, PrefixCache

    cache = PrefixCache(max_bytes=10**6, copy_state=lambda s: s, trim_state=lambda s, n: s)
    cache.add(
        Entry(
            tokens=(1, 2, 3, 4),
            state="a",
            nbytes=1,
            trimmable=True,
            pinned=False,
            source="request",
            namespace="tenant-a/",
        )
    )
    assert cache.lookup([1, 2, 3, 4, 5], "tenant-b/") is None
    assert cache.lookup([1, 2, 3, 4, 5], "") is None
    assert cache.lookup([1, 2, 3, 4, 5], "tenant-a/").n_cached == 4
    cache.add(
        Entry(tokens=(1, 2), state="w", nbytes=1, trimmable=True, pinned=True, source="snapshot")
    )
    assert cache.lookup([1, 2, 9], "tenant-b/").n_cached == 2  # warm entries are shared


def test_no_request_prefix_cache_keeps_no_request_prompt(demo_models, tmp_path, monkeypatch):
    """`--no-request-prefix-cache`: a second turn reuses nothing, and the cache holds no request
    entry."""
    from fastapi.testclient import TestClient

    from kvsnap.http.server import ServerConfig, create_app
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    text = "A conversation that would normally be kept for its next turn, long enough to matter."
    for keep, expect_cached in ((True, True), (False, False)):
        engine = Engine(EngineConfig(model=str(demo_models.path("dense"))))
        engine.start()
        try:
            with TestClient(
                create_app(engine, ServerConfig(served_model_name="m", request_prefix_cache=keep))
            ) as c:
                # A salt of its own: the partial match is reported exactly (not in shared 128-token
                # steps).
                assert (
                    c.post(
                        "/v1/chat/completions", json=chat_body(text, cache_salt="mine")
                    ).status_code
                    == 200
                )
                r = c.post(
                    "/v1/chat/completions", json=chat_body(text + " And more.", cache_salt="mine")
                )
                assert (
                    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                ) is expect_cached
                assert (len(engine.prefix) > 0) is expect_cached
        finally:
            engine.shutdown()
