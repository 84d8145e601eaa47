"""Limits come before the expensive work: oversized chat requests are
counted and refused before normalising or rendering, the work runs off the event loop a few
at a time, and requests being prepared count toward 429. A real `kvsnap serve` on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvsnap.tools.serverproc import start_server

N_CONCURRENT = 8
# /health answers while the flood is refused; rendering it would take far longer. Loose enough
# that a busy 2-core machine is slow, not failing.
HEALTH_BOUND_S = 3.0


@pytest.fixture(scope="module")
def small_server(demo_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    args = ["--max-batch-size", "1", "--max-queued-requests", "1"]
    server = start_server(
        demo_models.path("dense"),
        args,
        tmp / "serve.log",
        limit_s=300,
        env={"KVSNAP_CACHE_DIR": str(tmp / "cache")},
    )
    try:
        server.wait_ready(120)
        yield server
    finally:
        server.stop()


def _flood(url: str, body: bytes) -> tuple[list[httpx.Response], list[float]]:
    """``N_CONCURRENT`` posts of ``body`` while /health is timed; returns both."""
    answers: list[httpx.Response] = []
    health: list[float] = []
    done = threading.Event()

    # Each body's last byte waits for all the others: the requests reach the route together
    # even when a loaded machine uploads them at different speeds.
    sent_but_last = threading.Barrier(N_CONCURRENT, timeout=60)

    def content():
        yield body[:-1]
        sent_but_last.wait()
        yield body[-1:]

    def post():
        with httpx.Client(timeout=120) as c:
            answers.append(
                c.post(
                    f"{url}/v1/chat/completions",
                    content=content(),
                    headers={
                        "content-type": "application/json",
                        "content-length": str(len(body)),
                    },
                )
            )

    threads = [threading.Thread(target=post) for _ in range(N_CONCURRENT)]
    for t in threads:
        t.start()
    with httpx.Client(timeout=30) as c:
        deadline = time.monotonic() + 60
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:  # bounded
            t0 = time.monotonic()
            assert c.get(f"{url}/health").status_code == 200
            health.append(time.monotonic() - t0)
            time.sleep(0.1)
    for t in threads:
        t.join(60)
    done.set()
    return answers, health


def test_a_hundred_thousand_messages_are_refused_before_rendering_and_health_stays_fast(
    small_server,
):
    messages = [{"role": "user", "content": "x"}] * 100_000
    body = json.dumps({"model": "dense", "messages": messages, "max_tokens": 1}).encode()
    assert len(body) > 3_000_000
    t0 = time.monotonic()
    answers, health = _flood(small_server.url, body)
    assert time.monotonic() - t0 < 20
    assert len(answers) == N_CONCURRENT
    for r in answers:
        assert r.status_code == 400, r.text[:300]
        assert (
            r.json()["error"]["param"] == "messages"
            and "--max-messages" in r.json()["error"]["message"]
        )
    assert max(health, default=0) < HEALTH_BOUND_S, health


def test_requests_being_prepared_count_toward_429(small_server):
    """Heavy prompts under the message cap that render beyond the context: before, every one
    was rendered (none counted toward 429) and then refused; now at most 2 hold slots."""
    messages = [{"role": "user", "content": "word " * 300}] * 2000
    body = json.dumps({"model": "dense", "messages": messages, "max_tokens": 1}).encode()
    answers, health = _flood(small_server.url, body)
    codes = sorted(r.status_code for r in answers)
    # the whole list and any unexpected answer's body: pytest shortens a bare list to "..."
    odd = [f"{r.status_code}: {r.text[:300]}" for r in answers if r.status_code not in (400, 429)]
    assert codes.count(429) >= N_CONCURRENT - 2, f"{codes} {odd}"
    assert all(c in (400, 429) for c in codes), f"{codes} {odd}"
    for r in answers:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
    assert max(health, default=0) < HEALTH_BOUND_S, health
