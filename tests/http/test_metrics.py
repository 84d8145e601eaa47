"""`GET /metrics`: Prometheus's text format, parsed with prometheus_client's own parser.

A real `kvsnap serve` on 127.0.0.1 with the tiny dense demo model, warm from a built store
and persisting its request prefixes: after a few requests the scrape must say what the
responses and `/v1/status` said. A keyed server keeps it to admins. Two apps in one process
count apart (each has its own registry).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from kvsnap.tools.serverproc import serving

USER, ADMIN = "user-key-metrics-1111", "admin-key-metrics-2222"
QUESTIONS = ["Is this function correct?", "What does the loop do?", "Where is the bug?"]


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample as (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def requests_of(samples: dict, route: str, method: str, status: str) -> float:
    labels = (("method", method), ("route", route), ("status", status))
    return samples.get(("kvsnap_http_requests_total", labels), 0.0)


def total(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def warm_server(built, demo_models, tmp_path_factory):
    """No keys, warm from a copy of the built store, persisting request prefixes into it."""
    tmp = tmp_path_factory.mktemp("metrics")
    store = tmp / "snaps"
    shutil.copytree(built, store)
    agents = built.parent / f"{built.name}-agents.json"
    args = [
        "--continuous-batching",
        "--warm-prompts",
        str(agents),
        "--kv-snapshots",
        str(store),
        "--persist-requests",
    ]
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    with serving(demo_models.path("dense"), args, tmp / "serve.log", env, 600) as server:
        yield server, json.loads(agents.read_text())


def _chat(client: httpx.Client, url: str, messages: list, stream: bool) -> dict:
    body = {"model": "dense", "messages": messages, "max_tokens": 4, "temperature": 0}
    if not stream:
        r = client.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


def _settled(client: httpx.Client, url: str) -> dict:
    """/v1/status once the conversation writer has nothing queued and stopped writing."""
    last = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = client.get(f"{url}/v1/status").json()
        persist = status["persist"]
        now = (persist["queued"], persist["written"])
        if persist["queued"] == 0 and now == last:
            return status
        last = now
        time.sleep(0.5)
    raise AssertionError(f"the conversation writer did not settle: {status['persist']}")


def test_a_scrape_says_what_the_responses_and_the_status_said(warm_server):
    server, agents = warm_server
    url = server.url
    with httpx.Client(timeout=120) as client:
        usages = [
            _chat(
                client,
                url,
                agents[i % len(agents)]["messages"] + [{"role": "user", "content": q}],
                stream=i == len(QUESTIONS) - 1,
            )
            for i, q in enumerate(QUESTIONS)
        ]
        r = client.post(
            f"{url}/v1/completions", json={"model": "dense", "prompt": "Hello", "max_tokens": 3}
        )
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
        assert client.get(f"{url}/v1/no-such-route").status_code == 404
        status = _settled(client, url)
        r = client.get(f"{url}/metrics")
        after = client.get(f"{url}/v1/status").json()
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST, r.text
    samples = scrape(r.text)

    assert requests_of(samples, "/v1/chat/completions", "POST", "200") == len(QUESTIONS)
    assert requests_of(samples, "/v1/completions", "POST", "200") == 1
    assert requests_of(samples, "other", "GET", "404") == 1
    assert requests_of(samples, "/v1/status", "GET", "200") >= 2

    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0 and total(samples, "kvsnap_cached_tokens_total") == cached
    prompt = sum(u["prompt_tokens"] for u in usages)
    assert total(samples, "kvsnap_prompt_tokens_total") == prompt
    assert total(samples, "kvsnap_computed_tokens_total") == status["tokens"]["computed"]

    # every generation observed once: TPOT only where there was a second token
    assert total(samples, "kvsnap_time_to_first_token_seconds_count") == len(usages)
    several = sum(1 for u in usages if u["completion_tokens"] >= 2)
    assert several > 0
    assert total(samples, "kvsnap_time_per_output_token_seconds_count") == several
    assert total(samples, "kvsnap_time_to_first_token_seconds_sum") > 0

    entries = [total(samples, "kvsnap_cache_entries", kind=k) for k in ("warm", "request")]
    assert sum(entries) == status["cache"]["entry_count"] == after["cache"]["entry_count"]
    assert entries[0] >= len(agents) and entries[1] >= 1
    assert total(samples, "kvsnap_cache_bytes", kind="warm") > 0
    assert total(samples, "kvsnap_cache_hits_total") == status["cache"]["hits"]
    assert total(samples, "kvsnap_cache_evictions_total") == status["cache"]["evictions"]

    assert status["snapshots"]["loaded"] >= len(agents)  # warm from the store, not prefilled
    assert total(samples, "kvsnap_snapshots_loaded_total") == status["snapshots"]["loaded"]
    assert total(samples, "kvsnap_restore_seconds") == status["warmup"]["seconds"] > 0

    persist = after["persist"]
    assert persist["written"] == status["persist"]["written"] >= 1, (status, after)
    assert total(samples, "kvsnap_persist_enabled") == 1
    assert total(samples, "kvsnap_persist_writes_total") == persist["written"]
    assert total(samples, "kvsnap_persist_queue_depth") == persist["queued"] == 0
    assert total(samples, "kvsnap_persist_drops_total") == persist["dropped"]
    assert total(samples, "kvsnap_persist_evictions_total") == persist["evicted"]


@pytest.fixture(scope="module")
def keyed_server(demo_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics-keyed")
    env = {
        "KVSNAP_CACHE_DIR": str(tmp / "cache"),
        "KVSNAP_API_KEY": USER,
        "KVSNAP_ADMIN_API_KEY": ADMIN,
    }
    with serving(demo_models.path("dense"), [], tmp / "serve.log", env, 600) as server:
        yield server


def test_metrics_are_for_admins_when_keys_are_set(keyed_server):
    url = f"{keyed_server.url}/metrics"
    with httpx.Client(timeout=60) as client:
        missing = client.get(url)
        tenant = client.get(url, headers={"Authorization": f"Bearer {USER}"})
        admin = client.get(url, headers={"Authorization": f"Bearer {ADMIN}"})
    assert missing.status_code == 401, missing.text
    assert tenant.status_code == 403, tenant.text
    assert tenant.json()["error"]["code"] == "insufficient_permissions"
    assert admin.status_code == 200, admin.text
    samples = scrape(admin.text)
    assert requests_of(samples, "/metrics", "GET", "401") == 1
    assert requests_of(samples, "/metrics", "GET", "403") == 1


def test_two_apps_in_one_process_count_apart():
    from kvsnap.http.server import ServerConfig, create_app
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    # not started (no lifespan here): the scrape reads an engine with nothing loaded
    apps = [create_app(Engine(EngineConfig(model="unused")), ServerConfig("m")) for _ in "ab"]

    async def run() -> list[dict]:
        seen = []
        for n, app in enumerate(apps):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                for _ in range(n + 1):
                    assert (await client.get("/v1/models")).status_code == 200
                seen.append(scrape((await client.get("/metrics")).text))
        return seen

    first, second = asyncio.run(run())
    assert requests_of(first, "/v1/models", "GET", "200") == 1
    assert requests_of(second, "/v1/models", "GET", "200") == 2
    assert total(first, "kvsnap_cache_entries", kind="warm") == 0


# --- issue 39: each number means what its help says ------------------------------------------


def _unstarted_engine():
    """An engine that never loads (no lifespan here): a scrape reads it with nothing loaded."""
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model="unused"))


def test_time_per_output_token_is_over_the_tokens_after_the_first():
    """TPOT is the decode time after the first token over the tokens after it: 3 tokens, the
    last 2 s after the first, is 1 s each (over all 3 tokens it read 0.67 s: the decode
    looked faster than it was, and more so for short answers). The app's own Metrics, fed
    the engine's RequestState as the engine ends a generation."""
    from kvsnap.http.metrics import Metrics
    from kvsnap.runtime.engine.types import GenerationRequest, RequestState

    metrics = Metrics(_unstarted_engine(), inflight=lambda: 0)
    for n, (first, done) in enumerate(((10.5, 12.5), (20.25, 20.75)), start=1):
        request = GenerationRequest(tokens=[1, 2, 3], max_tokens=8)
        state = RequestState(n, request, on_event=lambda event: None)
        state.t_submit, state.t_first_token, state.t_done = first - 0.5, first, done
        state.completion_tokens = 3 if n == 1 else 2
        metrics.finished(state)
    samples = scrape(metrics.render().decode())
    assert total(samples, "kvsnap_time_per_output_token_seconds_count") == 2
    # 2 s over 2 tokens, then 0.5 s over 1
    assert total(samples, "kvsnap_time_per_output_token_seconds_sum") == 1.0 + 0.5
    assert total(samples, "kvsnap_time_to_first_token_seconds_sum") == 0.5 + 0.5


def test_an_unhandled_exception_counts_as_a_500():
    """A route that raises answers 500 (the server's last-resort handler, outside the
    counter): the counter saw no response start and must count 500, not 200 (a crash
    counted as a success hides it from every error-rate alert)."""
    from kvsnap.http.server import ServerConfig, create_app

    engine = _unstarted_engine()
    app = create_app(engine, ServerConfig("m"))

    def broken():
        raise RuntimeError("an unexpected failure inside /v1/status")

    async def run() -> tuple[int, dict]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            engine.status = broken  # this one call; the scrape reads the engine too
            try:
                code = (await client.get("/v1/status")).status_code
            finally:
                del engine.status
            return code, scrape((await client.get("/metrics")).text)

    code, samples = asyncio.run(run())
    assert code == 500
    assert requests_of(samples, "/v1/status", "GET", "500") == 1
    assert requests_of(samples, "/v1/status", "GET", "200") == 0


def _bytes_and_memory(client: httpx.Client, url: str) -> tuple[float, float, dict]:
    """(kvsnap_cache_bytes over both kinds, the status's bytes in memory, the status's cache)."""
    samples = scrape(client.get(f"{url}/metrics").text)
    cache = client.get(f"{url}/v1/status").json()["cache"]
    held = sum(total(samples, "kvsnap_cache_bytes", kind=k) for k in ("warm", "request"))
    return held, cache["current_memory_mb"] * 2**20, cache


def test_cache_bytes_count_only_the_entries_in_memory(built, demo_models, tmp_path):
    """A budget below one snapshot: the store's snapshots stay indexed, not loaded, and each
    hit loads one that is unloaded again for the budget. `kvsnap_cache_bytes` is what memory
    holds (the status's current_memory_mb), never the indexed entries' sizes on disk."""
    store = tmp_path / "snaps"
    shutil.copytree(built, store)
    agents = json.loads((built.parent / f"{built.name}-agents.json").read_text())
    args = ["--kv-snapshots", str(store), "--cache-memory-mb", "0.01"]
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    half_a_kib = 0.0005 * 2**20  # the status rounds MiB to 3 decimals
    with serving(demo_models.path("dense"), args, tmp_path / "serve.log", env, 600) as server:
        with httpx.Client(timeout=120) as client:
            held, memory, cache = _bytes_and_memory(client, server.url)
            assert cache["entry_count"] >= len(agents), cache  # indexed
            assert abs(held - memory) <= half_a_kib and memory < 2**20 * 0.01, (held, cache)
            question = [{"role": "user", "content": "Is this function correct?"}]
            _chat(client, server.url, agents[0]["messages"] + question, stream=False)
            held, memory, cache = _bytes_and_memory(client, server.url)
    assert cache["lazy_loads"] >= 1 and cache["entry_count"] >= len(agents), cache
    assert abs(held - memory) <= half_a_kib, (held, cache)


def test_a_full_disk_turns_persist_enabled_to_0(demo_models, tmp_path):
    """A full disk stops persisting until restart (the status says why): the gauge that says
    whether request prefixes are persisted must drop to 0 with it."""
    env = {
        "KVSNAP_CACHE_DIR": str(tmp_path / "cache"),
        "KVSNAP_FAULT": "conversation-before-record=enospc",
    }
    args = ["--persist-requests", "--kv-snapshots", str(tmp_path / "store")]
    messages = [{"role": "user", "content": "Is this function correct?"}]
    with serving(demo_models.path("dense"), args, tmp_path / "serve.log", env, 600) as server:
        with httpx.Client(timeout=120) as client:
            before = scrape(client.get(f"{server.url}/metrics").text)
            _chat(client, server.url, messages, stream=False)
            deadline = time.monotonic() + 60
            while not (persist := client.get(f"{server.url}/v1/status").json()["persist"])[
                "disabled"
            ]:
                assert time.monotonic() < deadline, persist
                time.sleep(0.05)
            after = scrape(client.get(f"{server.url}/metrics").text)
    assert total(before, "kvsnap_persist_enabled") == 1
    assert "disk full" in persist["disabled"], persist
    assert total(after, "kvsnap_persist_enabled") == 0
