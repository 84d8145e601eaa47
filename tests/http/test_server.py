"""`kvsnap serve` as a real uvicorn process on 127.0.0.1, with tiny models."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from helpers.models import LONG_SYSTEM

from kvsnap.tools.client import stream_chat
from kvsnap.tools.serverproc import start_server

AGENTS = [
    {"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]},
    {
        "name": "planner",
        "messages": [
            {
                "role": "system",
                "content": "You are a planner agent. Plan each task step by step, list the tools. "
                * 4,
            },
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hello, what are we planning?"},
        ],
    },
]
QUESTION = {"role": "user", "content": "Please check the server function and explain the fix."}
N_GEN = 32


def _build(model_dir, agents_file, store):
    from helpers.cli import run_kvsnap

    r = run_kvsnap("build", agents_file, "--model", model_dir, "--out", store)
    assert r.returncode == 0, r.stdout + r.stderr


def _chat(client, url, messages, **extra):
    body = {"model": "m", "messages": messages, "max_tokens": N_GEN, "temperature": 0, **extra}
    r = client.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _status(client, url):
    return client.get(f"{url}/v1/status").json()


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def servers(request, demo_models, tmp_path_factory):
    """One server started from snapshots, one started with nothing, for the same model."""
    name = request.param
    tmp = tmp_path_factory.mktemp(f"server-{name}")
    model = tmp / "m"
    model.symlink_to(demo_models.path(name), target_is_directory=True)
    agents = tmp / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    store = tmp / "snaps"
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    _build(model, agents, store)
    warm = start_server(
        model,
        ["--continuous-batching", "--warm-prompts", str(agents), "--kv-snapshots", str(store)],
        tmp / "warm.log",
        env=env,
        limit_s=600,
    )
    cold = start_server(model, ["--continuous-batching"], tmp / "cold.log", env=env, limit_s=600)
    try:
        warm.wait_ready(120)
        cold.wait_ready(120)
        yield {
            "name": name,
            "warm": warm,
            "cold": cold,
            "agents": agents,
            "store": store,
            "tmp": tmp,
        }
    finally:
        warm.stop()
        cold.stop()


def test_startup_report_says_where_warmth_came_from(servers):
    warmup = servers["warm"].status()["warmup"]  # the report the log line is written from, as data
    assert (
        warmup["completed"],
        warmup["skipped"],
        warmup["from_snapshots"],
        warmup["prefilled"],
    ) == (2, 0, 2, 0), warmup
    built = [
        e["n_tokens"]
        for r in json.loads((servers["store"] / "manifest.json").read_text())["records"].values()
        for e in r["entries"]
    ]
    assert warmup["prompt_tokens"] == sum(built) and warmup["seconds"] > 0, warmup
    cold = servers["cold"].status()["warmup"]
    assert (
        cold["completed"],
        cold["from_snapshots"],
        cold["prefilled"],
        cold["prompt_tokens"],
    ) == (0, 0, 0, 0), cold


def test_the_warm_up_log_line_tells_people_where_warmth_came_from_and_what_was_refused():
    """The one check of the line's wording (for people; code reads /v1/status): built from the
    report object."""
    from kvsnap.runtime.warmup.report import SnapshotCounts, WarmupReport

    report = WarmupReport(
        completed=2,
        skipped=1,
        from_snapshots=1,
        prefilled=1,
        prompt_tokens=525,
        seconds=0.0412,
        over_budget=1,
        problems=["entry 3: no messages"],
    )
    counts = SnapshotCounts(write_back=True)
    counts.reject("/srv/snaps/snapshots/ab12.safetensors", "built for another model")
    assert report.summary(counts) == (
        "[lifespan] Warm-up done (strict-prefix): 2 completed, 1 skipped, 525 prompt tokens in "
        "0.04s (1 from snapshots, 1 prefilled)"
        "; 1 snapshot(s) rejected (ab12.safetensors: built for another model)"
        "; 1 warm prompt(s) invalid"
        "; 1 over the cache budget (indexed, load on first hit)"
    )
    counts.write_back = False
    assert report.summary(counts).endswith("; 1 over the cache budget and not kept")


def test_first_request_per_agent_hits_the_snapshot_and_matches_a_cold_server(servers):
    warm, cold = servers["warm"], servers["cold"]
    with httpx.Client(timeout=120) as client:
        warm_status = _status(client, warm.url)
        assert warm_status["cache"]["hits"] == 0  # nothing has been asked yet
        for agent in AGENTS:
            messages = agent["messages"] + [QUESTION]
            got = _chat(client, warm.url, messages)
            want = _chat(client, cold.url, messages)
            # The warm prefix length, computed the way build does, from the snapshot on disk.
            prefix_len = next(
                e["n_tokens"]
                for r in json.loads((servers["store"] / "manifest.json").read_text())[
                    "records"
                ].values()
                for e in r["entries"]
                if e["name"] == agent["name"]
            )
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix_len
            assert want["usage"]["prompt_tokens_details"]["cached_tokens"] < prefix_len
            assert (
                got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
            )
            assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == N_GEN
        status = _status(client, warm.url)
        # Honest accounting: what the engine measured it computed equals prompt - cached.
        assert (
            status["tokens"]["computed"] == status["tokens"]["prompt"] - status["tokens"]["cached"]
        )


def test_streaming_and_non_streaming_give_the_same_text(servers):
    warm = servers["warm"]
    messages = AGENTS[1]["messages"] + [{"role": "user", "content": "list the steps"}]
    with httpx.Client(timeout=120) as client:
        plain = _chat(client, warm.url, messages)
        streamed = stream_chat(client, warm.url, "m", messages, max_tokens=N_GEN)
    assert streamed.text == plain["choices"][0]["message"]["content"]
    assert streamed.usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert streamed.cached_tokens > 0


BAD_INPUTS = [
    ("invalid json", b"{not json", 400),
    ("missing messages", {"model": "m"}, 400),
    ("messages wrong type", {"model": "m", "messages": "hi"}, 400),
    ("empty messages", {"model": "m", "messages": []}, 400),
    ("unknown role", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("content wrong type", {"model": "m", "messages": [{"role": "user", "content": 7}]}, 400),
    ("negative max_tokens", {"model": "m", "messages": [QUESTION], "max_tokens": -1}, 400),
    ("huge max_tokens", {"model": "m", "messages": [QUESTION], "max_tokens": 10**9}, 400),
    ("string max_tokens", {"model": "m", "messages": [QUESTION], "max_tokens": "10"}, 400),
    ("temperature out of range", {"model": "m", "messages": [QUESTION], "temperature": 9}, 400),
    ("unknown model", {"model": "gpt-9", "messages": [QUESTION]}, 404),
    (
        "prompt longer than the context",
        {"model": "m", "messages": [{"role": "user", "content": "word " * 40000}]},
        400,
    ),
    ("stream wrong type", {"model": "m", "messages": [QUESTION], "stream": "yes"}, 400),
]


def test_bad_input_gets_an_openai_error_and_leaves_server_and_cache_alone(servers):
    warm = servers["warm"]
    with httpx.Client(timeout=60) as client:
        before = _status(client, warm.url)["cache"]
        for label, body, code in BAD_INPUTS:
            t0 = time.perf_counter()
            if isinstance(body, bytes):
                r = client.post(
                    f"{warm.url}/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                )
            else:
                r = client.post(f"{warm.url}/v1/chat/completions", json=body)
            assert r.status_code == code, (label, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], label
            assert time.perf_counter() - t0 < 10, f"{label} was not answered promptly"
        r = client.post(f"{warm.url}/v1/completions", json={"model": "m", "prompt": [-4]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        after = _status(client, warm.url)["cache"]
        assert (after["entry_count"], after["hits"], after["misses"]) == (
            before["entry_count"],
            before["hits"],
            before["misses"],
        )
        assert client.get(f"{warm.url}/health").status_code == 200
        _chat(client, warm.url, AGENTS[0]["messages"] + [QUESTION], max_tokens=2)


def test_completions_models_and_health(servers):
    warm = servers["warm"]
    with httpx.Client(timeout=60) as client:
        models = client.get(f"{warm.url}/v1/models").json()
        assert models["data"][0]["id"] == "m"
        r = client.post(
            f"{warm.url}/v1/completions",
            json={"model": "m", "prompt": "hello world", "max_tokens": 4},
        )
        assert (
            r.status_code == 200
            and r.json()["object"] == "text_completion"
            and r.json()["usage"]["completion_tokens"] <= 4
        )
        assert client.get(f"{warm.url}/health").json()["warm"] is True


def test_clear_prefix_cache_rewarms_from_snapshots_not_prefill(servers):
    warm = servers["warm"]
    with httpx.Client(timeout=60) as client:
        before = _status(client, warm.url)
        r = client.delete(f"{warm.url}/v1/cache/prefix")
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "cleared" and body["rewarm_scheduled"] is True
        assert body["cleared_entries"] >= 2  # entry_count dropped: everything was cleared
        deadline = time.monotonic() + 30
        while True:
            status = _status(client, warm.url)
            if status["snapshots"]["loaded"] >= before["snapshots"]["loaded"] + 2:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["snapshots"]["prefilled"] == before["snapshots"]["prefilled"]
        got = _chat(
            client,
            warm.url,
            AGENTS[0]["messages"] + [{"role": "user", "content": "another question"}],
            max_tokens=2,
        )
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_client_that_disconnects_mid_stream_frees_its_slot(servers):
    warm = servers["warm"]
    body = {
        "model": "m",
        "messages": AGENTS[0]["messages"] + [QUESTION],
        "max_tokens": 4000,
        "stream": True,
        "temperature": 0,
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{warm.url}/v1/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    break  # got a real token; now hang up
        deadline = time.monotonic() + 10
        while _status(client, warm.url)["batch_size"] != 0:
            assert time.monotonic() < deadline, "the cancelled request still holds its slot"
            time.sleep(0.05)
        _chat(client, warm.url, AGENTS[1]["messages"] + [QUESTION], max_tokens=2)


def test_health_is_503_until_warm_then_200(demo_models, tmp_path, monkeypatch):
    """In-process: the engine is loaded but its warm-up thread is held back, then released."""
    from fastapi.testclient import TestClient

    from kvsnap.http.server import ServerConfig, create_app
    from kvsnap.prompts import parse_warm_prompts
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    prompts = parse_warm_prompts(AGENTS)
    engine = Engine(
        EngineConfig(
            model=str(demo_models.path("dense")),
            warm_prompts=prompts,
            warm_prompts_file=str(tmp_path / "a.json"),
            snapshots=str(tmp_path / "snaps"),
        )
    )
    engine._load()
    engine.loaded.set()  # the lifespan sees a loaded engine and does not start it
    app = create_app(engine, ServerConfig(served_model_name="m"))
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["warm"] is False
        engine.start_serving()
        assert engine.wait_warm(60)
        r = client.get("/health")
        assert r.status_code == 200 and r.json()["warm"] is True
        status = client.get("/v1/status").json()
        # No snapshots existed: both warm prompts were prefilled and written back.
        assert status["snapshots"]["prefilled"] == 2 and status["snapshots"]["written"] == 2


@pytest.mark.parametrize("name", ["dense", "sliding"])
def test_answers_over_http_come_from_the_exact_snapshot_state(
    name, demo_models, tmp_path, monkeypatch
):
    """In process (the real app and engine, through HTTP), so the served state can be read.

    Equal greedy text against a cold engine is not enough (a zeroed key in one layer kept it):
    the warm state, its private copy, the first-token logits and the KV each request
    attended to are checked too (``assert_served_from_the_exact_snapshot_state``).
    """
    from fastapi.testclient import TestClient
    from helpers.engine import assert_served_from_the_exact_snapshot_state

    from kvsnap.chat import request_tokens
    from kvsnap.http.server import ServerConfig, create_app
    from kvsnap.prompts import parse_warm_prompts, warm_prefix
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    model = demo_models.path(name)
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    store = tmp_path / "snaps"
    _build(model, agents, store)
    prompts = parse_warm_prompts(AGENTS, str(agents))
    warm_engine = Engine(
        EngineConfig(
            model=str(model),
            warm_prompts=prompts,
            warm_prompts_file=str(agents),
            snapshots=str(store),
            write_back=False,
        )
    )
    cold_engine = Engine(EngineConfig(model=str(model), cache_memory_mb=0))
    config = ServerConfig(served_model_name="m")
    with (
        TestClient(create_app(warm_engine, config)) as warm,
        TestClient(create_app(cold_engine, config)) as cold,
    ):
        assert warm_engine.wait_warm(120) and cold_engine.wait_warm(120)
        assert warm_engine.status()["snapshots"]["loaded"] == 2
        for i, agent in enumerate(AGENTS):
            messages = agent["messages"] + [QUESTION]
            body = {"model": "m", "messages": messages, "max_tokens": N_GEN, "temperature": 0}
            got, want = (
                warm.post("/v1/chat/completions", json=body),
                cold.post("/v1/chat/completions", json=body),
            )
            assert got.status_code == want.status_code == 200, (got.text, want.text)
            got, want = got.json(), want.json()
            warm_tokens = warm_prefix(warm_engine.lm.tokenizer, prompts.entries[i]).tokens
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(warm_tokens)
            assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert (
                got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
            )
            assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == N_GEN
            assert_served_from_the_exact_snapshot_state(
                warm_engine, warm_tokens, request_tokens(warm_engine.lm.tokenizer, messages)
            )
