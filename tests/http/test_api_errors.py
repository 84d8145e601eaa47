"""What a failed generation tells the client: the error type only.

In process: the real app and engine on the tiny dense demo model, through HTTP; the
request's cache preparation is made to fail with a message holding a private detail.
"""

from __future__ import annotations

import json
import logging

import pytest

SECRET = "/home/alice/agents/secret-prompt.txt"


@pytest.fixture()
def failing_app(demo_models, tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from kvsnap.http.server import ServerConfig, create_app
    from kvsnap.runtime.engine.engine import Engine, EngineConfig
    from kvsnap.runtime.engine.request_cache import RequestCaches

    def fail(*args, **kwargs):
        raise RuntimeError(f"cannot read {SECRET}")

    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(RequestCaches, "prepare", fail)
    engine = Engine(
        EngineConfig(
            model=str(demo_models.path("dense")), continuous_batching=True, max_batch_size=2
        )
    )
    with TestClient(create_app(engine, ServerConfig(served_model_name="m"))) as client:
        assert engine.wait_warm(120)
        yield client


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_generation_failed_500_names_only_the_error_type(failing_app, caplog):
    with caplog.at_level(logging.WARNING, logger="kvsnap"):
        r = failing_app.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "generation_failed" and "RuntimeError" in err["message"]
    assert SECRET not in r.text and "cannot read" not in r.text
    assert SECRET in caplog.text  # the detail is in the server log


def test_generation_failed_stream_event_names_only_the_error_type(failing_app):
    r = failing_app.post("/v1/chat/completions", json={**BODY, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert (
        errors
        and errors[0]["code"] == "generation_failed"
        and "RuntimeError" in errors[0]["message"]
    )
    assert SECRET not in r.text
