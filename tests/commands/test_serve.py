"""`kvsnap serve`'s request defaults and logging flags, on real servers with the dense demo
model: --temp/--top-k applied when a request leaves them out (a request's own values win),
--log-level and --no-access-log, and one line format for kvsnap's and uvicorn's lines."""

from __future__ import annotations

import re

import httpx
import pytest

from kvsnap.tools.serverproc import serving

MESSAGES = [{"role": "user", "content": "Review the server code, then list the steps."}]
# kvsnap's format (asctime, level, message) for every logged line, uvicorn's too
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) ")


@pytest.fixture(scope="module")
def hot_server(demo_models, tmp_path_factory):
    """Defaults that sample hot but keep only the likeliest token: greedy unless a request
    sets its own top_k."""
    tmp = tmp_path_factory.mktemp("serve-defaults")
    args = ["--temp", "2", "--top-k", "1", "--chat-template-args", '{"unused": true}']
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    with serving(demo_models.path("dense"), args, tmp / "serve.log", env, 600) as server:
        yield server


def test_server_sampling_defaults_apply_and_request_values_win(hot_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{hot_server.url}/v1", api_key="none")

    def answer(**extra) -> str:
        r = client.chat.completions.create(model="dense", messages=MESSAGES, max_tokens=8, **extra)
        return r.choices[0].message.content or ""

    greedy = answer(temperature=0)
    # left out: --temp 2 with --top-k 1 keeps only the likeliest token
    assert {answer(seed=s) for s in range(4)} == {greedy}
    # the request's own top_k (vLLM's -1: off) wins over --top-k: temperature 2 samples
    sampled = {answer(seed=s, extra_body={"top_k": -1}) for s in range(6)}
    assert sampled != {greedy}


def test_log_lines_share_kvsnap_format(hot_server):
    httpx.get(f"{hot_server.url}/v1/models", timeout=30)
    lines = [ln for ln in hot_server.log().splitlines() if LINE.match(ln)]
    assert any("[kvsnap]" in ln for ln in lines)
    assert any("Uvicorn running" in ln or "Application startup" in ln for ln in lines)
    assert any('"GET /v1/models HTTP/1.1" 200' in ln for ln in lines)
    assert not [ln for ln in hot_server.log().splitlines() if ln.startswith("INFO:")]


def test_log_level_warning_and_no_access_log(demo_models, tmp_path):
    args = ["--log-level", "warning", "--no-access-log"]
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    with serving(demo_models.path("dense"), args, tmp_path / "serve.log", env, 600) as server:
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": "dense", "messages": MESSAGES, "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200
        log = server.log()
    assert " INFO " not in log and "INFO:" not in log, log
    assert "POST /v1/chat/completions" not in log, log


def test_chat_template_args_must_be_a_json_object(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "kvsnap", "serve", "m", "--chat-template-args", "enable_thinking"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "--chat-template-args 'enable_thinking': not JSON" in r.stderr
    assert "give a JSON object" in r.stderr
