"""`kvsnap serve` against floods of connections (and a port already in use).

Real `kvsnap serve` processes on 127.0.0.1 with the tiny dense demo model. The slow
clients are bounded (a few hundred sockets, a few seconds) and the caps lowered by flag.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvsnap.tools.serverproc import free_port, start_server

N_SLOW = 300
HEADER_TIMEOUT_S = 2.0


def _open_slow(url_port: int, n: int) -> list[socket.socket]:
    """``n`` connections that each send a request line and then nothing complete."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", url_port))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            s.close()  # refused or reset at the cap: the guard at work
            continue
        socks.append(s)
    return socks


def _trickle(socks: list[socket.socket]) -> int:
    """One more header line on each; returns how many are still open."""
    alive = 0
    for s in socks:
        try:
            s.sendall(b"X-Slow: 1\r\n")
            alive += 1
        except OSError:
            pass
    return alive


def _closed_by_server(s: socket.socket) -> bool:
    s.settimeout(0.2)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True  # reset


def _health_latency(url: str) -> float:
    t0 = time.monotonic()
    r = httpx.get(f"{url}/health", timeout=5)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


@pytest.fixture()
def slow_server(demo_models, tmp_path):
    args = ["--max-connections", "64", "--header-timeout", str(HEADER_TIMEOUT_S)]
    server = start_server(
        demo_models.path("dense"),
        args,
        tmp_path / "serve.log",
        limit_s=300,
        env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")},
    )
    try:
        server.wait_ready(120)
        yield server
    finally:
        server.stop()


def test_slowloris_connections_are_closed_and_health_still_answers(slow_server):
    port = int(slow_server.url.rsplit(":", 1)[1])
    log_before = slow_server.log_path.stat().st_size
    socks = _open_slow(port, N_SLOW)
    try:
        latencies = []
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 3
        while time.monotonic() < deadline:  # bounded: a few seconds of trickling
            _trickle(socks)
            latencies.append(_health_latency(slow_server.url))
            time.sleep(0.5)
        assert max(latencies) < 1.0, latencies
        # Every slow connection has been closed by now: trickling does not reset the deadline.
        still_open = [s for s in socks if not _closed_by_server(s)]
        assert not still_open, f"{len(still_open)} of {len(socks)} slow connections still open"
    finally:
        for s in socks:
            s.close()
    grown = slow_server.log_path.stat().st_size - log_before
    assert grown < 20_000, slow_server.log()[-3000:]  # counted lines, not one per connection


SLOW_BODY_CAP = 64
N_SLOW_BODIES = 96  # more than the cap: the cap must push some out
BODY_TIMEOUT_S = 2.0
KEY_A, KEY_B = "tenant-a-key-1111", "tenant-b-key-2222"


def _open_slow_bodies(port: int, n: int, key: str) -> list[socket.socket]:
    """``n`` connections that each send a whole request head (a valid key, a body of 100,000
    bytes declared) and then the body's first byte only."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: 100000\r\n\r\n{{"
    ).encode()
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(head)
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def _trickle_body(socks: list[socket.socket]) -> None:
    for s in socks:
        try:
            s.sendall(b" ")
        except OSError:
            pass  # closed by the server: the guard at work


@pytest.fixture()
def slow_body_server(demo_models, tmp_path):
    args = [
        "--max-connections",
        str(SLOW_BODY_CAP),
        "--header-timeout",
        "30",  # only the body's deadline may close the slow bodies
        "--body-timeout",
        str(BODY_TIMEOUT_S),
    ]
    server = start_server(
        demo_models.path("dense"),
        args,
        tmp_path / "serve.log",
        limit_s=300,
        env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache"), "KVSNAP_API_KEY": f"{KEY_A},{KEY_B}"},
    )
    try:
        server.wait_ready(120)
        yield server
    finally:
        server.stop()


def test_slow_bodies_from_one_valid_key_lock_out_neither_health_nor_another_key(
    slow_body_server,
):
    """More connections than the cap, each with a whole head and a body trickling one byte at a
    time, all under tenant A's valid key: the cap pushes the longest-waiting out (not only
    connections still waiting for a head), so /health and tenant B are served during the
    attack, and each slow body is closed --body-timeout after its head however it trickles."""
    url = slow_body_server.url
    port = int(url.rsplit(":", 1)[1])
    log_before = slow_body_server.log_path.stat().st_size
    socks = _open_slow_bodies(port, N_SLOW_BODIES, KEY_A)
    assert len(socks) >= SLOW_BODY_CAP
    try:
        latencies, answered_b = [], 0
        # Past the body deadline, and at least three answers to tenant B however slow the
        # machine; bounded all the same.
        deadline = time.monotonic() + BODY_TIMEOUT_S + 3
        give_up = deadline + 60
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < deadline or (answered_b < 3 and time.monotonic() < give_up):
                _trickle_body(socks)
                try:
                    latencies.append(_health_latency(url))
                    r = client.post(
                        f"{url}/v1/completions",
                        json={"model": "dense", "prompt": "hello", "max_tokens": 1},
                        headers={"Authorization": f"Bearer {KEY_B}"},
                    )
                except httpx.TransportError as exc:
                    pytest.fail(f"a real client was refused during the attack: {exc!r}")
                assert r.status_code == 200, r.text
                answered_b += 1
                time.sleep(0.3)
        # Answered at all is the point; the bound only says not stuck behind the attack (a
        # busy machine is slow, not wrong).
        assert answered_b >= 3 and max(latencies) < 10.0, latencies
        still_open = [s for s in socks if not _closed_by_server(s)]
        assert not still_open, f"{len(still_open)} of {len(socks)} slow bodies still open"
    finally:
        for s in socks:
            s.close()
    log = slow_body_server.log()[log_before:]
    assert "--body-timeout" in log and "--max-connections" in log, log[-3000:]


def test_the_connection_cap_stays_below_the_open_files_limit(demo_models, tmp_path):
    """A cap above the descriptors the process may open is lowered, with a reserve, at start."""
    server = start_server(
        demo_models.path("dense"),
        ["--max-connections", "100000"],
        tmp_path / "s.log",
        limit_s=300,
        env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")},
        prefix=["prlimit", "--nofile=4096:4096", "--"],
    )
    try:
        server.wait_ready(120)
        assert "--max-connections 100000 lowered to 3968" in server.log()
        assert "at most 3968 connections" in server.log()
    finally:
        server.stop()


def test_accept_errors_from_running_out_of_descriptors_are_logged_rate_limited(caplog):
    """EMFILE on accept() is reported by asyncio once per attempt: the guard counts them
    and writes one line per interval with the count."""
    import asyncio
    import errno
    import logging

    from kvsnap.http.connections import ConnectionGuard

    guard = ConnectionGuard(max_connections=8, header_timeout_s=1)
    loop = asyncio.new_event_loop()
    try:
        loop.set_exception_handler(guard.exception_handler)
        with caplog.at_level(logging.WARNING):
            for _ in range(2000):
                exc = OSError(errno.EMFILE, "Too many open files")
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource", "exception": exc}
                )
    finally:
        loop.close()
    lines = [r for r in caplog.records if "accept failed" in r.getMessage()]
    assert len(lines) == 1 and "Too many open files" in lines[0].getMessage()
    assert len(caplog.records) == 1  # asyncio's own handler never saw them


def test_a_busy_port_fails_before_the_model_loads_with_exit_2(demo_models, tmp_path):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        t0 = time.monotonic()
        # A model folder that does not exist: the port check must come first to name the port.
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvsnap",
                "serve",
                str(tmp_path / "no-model"),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "already in use" in r.stderr and "--port" in r.stderr
    assert took < 30


STREAM_CHUNK = b"x" * 65536
STREAM_BYTES = 64 * 2**20  # far beyond any socket buffer: an unread stream stalls its writer


async def _streaming_app(scope, receive, send):
    """An ASGI app answering every request with up to 64 MiB streamed: a long answer that
    outruns the kernel's buffers at once (a model would take minutes to say as much)."""
    if scope["type"] != "http":
        return
    size = 2 if scope["path"] == "/health" else STREAM_BYTES
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(max(size // len(STREAM_CHUNK), 1)):
        await send({"type": "http.response.body", "body": STREAM_CHUNK[:size], "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture()
def streaming_server():
    """A real uvicorn server on 127.0.0.1 through the connection guard, cap 8, unread answers
    closed after 1.5 s."""
    import threading

    from kvsnap.http.connections import ConnectionGuard
    from kvsnap.http.listen import bind_socket, make_server

    guard = ConnectionGuard(max_connections=8, header_timeout_s=30, write_timeout_s=1.5)
    sock = bind_socket("127.0.0.1", free_port())
    server = make_server(_streaming_app, guard, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def _unread_stream(port: int) -> socket.socket:
    """A connection that asks for a long answer and never reads a byte of it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(2)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    return s


def _server_closed(s: socket.socket) -> bool:
    """Reads what is buffered; True once the server has closed or reset the connection."""
    s.settimeout(0.05)
    try:
        while data := s.recv(2**20):
            del data
        return True
    except socket.timeout:
        return False
    except OSError:
        return True


def test_clients_that_never_read_a_long_answer_hold_no_slot_for_ever(streaming_server):
    """A full cap of clients that asked for a long streamed answer and read none of it: a new
    connection pushes the longest-stalled one out (so /health answers), and every one is
    closed --write-timeout after its answer stalled, while a client that reads on gets the
    whole answer."""
    port = streaming_server
    url = f"http://127.0.0.1:{port}"
    unread = [_unread_stream(port) for _ in range(8)]
    try:
        time.sleep(1.0)  # each answer fills the buffers and its writer stalls
        t0 = time.monotonic()
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 200 and time.monotonic() - t0 < 5
        with httpx.stream("GET", f"{url}/stream", timeout=10) as reader:
            got = 0
            for chunk in reader.iter_bytes():
                got += len(chunk)
                if got % (8 * 2**20) < len(chunk):
                    time.sleep(0.5)  # pauses shorter than the write timeout are no stall
        assert got == STREAM_BYTES
        time.sleep(2.0)
        still_open = [s for s in unread if not _server_closed(s)]
        assert not still_open, f"{len(still_open)} of 8 unread answers still hold a slot"
    finally:
        for s in unread:
            s.close()
