"""The staged app `kvsnap serve` opens its port with: `/health` answered from the engine while
the API is still being imported, every other request held until the API exists (never
refused), a failed build answered 503 and stopping the server. A real uvicorn server on
127.0.0.1; the engine is its two signals (warm, failed), the API a small ASGI app whose build
the test releases."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from kvsnap.http.connections import ConnectionGuard
from kvsnap.http.listen import bind_socket, make_server
from kvsnap.http.staged import StagedApp
from kvsnap.tools.serverproc import free_port


async def _api(scope, receive, send):
    """The built API: says who answered, so a test sees which app served a request."""
    if scope["type"] != "http":
        return
    body = f'{{"served_by":"api","path":"{scope["path"]}"}}'.encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


class Harness:
    def __init__(self, build):
        self.engine = SimpleNamespace(warm=threading.Event(), failed=None)
        self.shutdowns: list[float] = []
        self.failures: list[BaseException] = []
        self.app = StagedApp(
            self.engine,
            "m",
            build,
            on_shutdown=lambda: self.shutdowns.append(time.monotonic()),
            on_build_failure=self._failed,
        )
        self.sock = bind_socket("127.0.0.1", free_port())
        self.server = make_server(
            self.app, ConnectionGuard(max_connections=16), log_level="warning"
        )
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _failed(self, exc: BaseException) -> None:
        self.failures.append(exc)
        self.server.should_exit = True

    def run(self):
        thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "uvicorn did not start in 30 s"
        return thread


@pytest.fixture()
def harness_with(request):
    made = []

    def make(build):
        h = Harness(build)
        made.append((h, h.run()))
        return h

    yield make
    for h, thread in made:
        h.server.should_exit = True
        thread.join(15)
        h.sock.close()


def test_health_answers_before_the_api_is_built_and_requests_wait_for_it(harness_with):
    release = threading.Event()

    def build():
        assert release.wait(30), "the test never released the build"
        return _api

    h = harness_with(build)
    h.app.start_building()
    # the API is not built: /health is the engine's answer, 503 until warm, then 200
    r = httpx.get(f"{h.url}/health", timeout=5)
    assert (r.status_code, r.json()) == (503, {"status": "warming", "warm": False})
    h.engine.warm.set()
    r = httpx.get(f"{h.url}/health", timeout=5)
    assert (r.status_code, r.json()) == (200, {"status": "ok", "warm": True, "model": "m"})
    assert r.headers["content-type"] == "application/json"
    # any other request is held, not refused, and served by the API once it exists
    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(httpx.post, f"{h.url}/v1/chat/completions", json={}, timeout=30)
        status = pool.submit(httpx.get, f"{h.url}/v1/status", timeout=30)
        time.sleep(0.5)
        assert not early.done() and not status.done() and not h.app.settled.is_set()
        release.set()
        assert early.result().json() == {"served_by": "api", "path": "/v1/chat/completions"}
        assert status.result().json() == {"served_by": "api", "path": "/v1/status"}
    # built: /health is the API's own route from now on
    assert httpx.get(f"{h.url}/health", timeout=5).json() == {"served_by": "api", "path": "/health"}


def test_health_reports_a_failed_warm_up_before_the_api_is_built(harness_with):
    h = harness_with(lambda: threading.Event().wait(30) or _api)
    h.app.start_building()
    h.engine.failed = RuntimeError("the snapshot store is unreadable")
    r = httpx.get(f"{h.url}/health", timeout=5)
    assert r.status_code == 503
    assert r.json() == {
        "status": "failed",
        "warm": False,
        "error": "the snapshot store is unreadable",
    }


def test_a_failed_build_answers_503_and_stops_the_server(harness_with):
    release = threading.Event()

    def build():
        release.wait(30)
        raise ImportError("No module named 'fastapi'")

    h = harness_with(build)
    h.engine.warm.set()
    h.app.start_building()
    with ThreadPoolExecutor(1) as pool:
        early = pool.submit(httpx.post, f"{h.url}/v1/completions", json={}, timeout=30)
        time.sleep(0.3)
        release.set()
        r = early.result()
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["type"] == "server_error" and "ImportError" in error["message"]
    assert [type(e) for e in h.failures] == [ImportError] and h.app.settled.is_set()
    assert isinstance(h.app.failed, ImportError)
    deadline = time.monotonic() + 15
    while h.server.started and not h.shutdowns and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h.shutdowns, "the server did not stop after the build failed"


def test_stopping_the_server_runs_the_shutdown_once(harness_with):
    h = harness_with(lambda: _api)
    h.app.start_building()
    h.server.should_exit = True
    deadline = time.monotonic() + 15
    while not h.shutdowns and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert len(h.shutdowns) == 1
