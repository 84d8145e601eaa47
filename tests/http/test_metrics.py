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
