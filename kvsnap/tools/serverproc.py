"""Start and stop a `kvsnap serve` process on loopback (quickstart, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path
    launched_at: float

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Poll /health until 200 (warm); returns seconds since launch. Raises if the process
        died."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"kvsnap serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.perf_counter() - self.launched_at
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"kvsnap serve not warm after {timeout}s:\n{self.log()[-3000:]}")

    def status(self, api_key: str | None = None, timeout: float = 10.0) -> dict:
        """``GET /v1/status`` as data: the warm-up report is its ``warmup`` (an admin key, or none
        configured)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        resp = httpx.get(f"{self.url}/v1/status", headers=headers, timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def log(self) -> str:
        """The server's output, for people reading a failure; tools and tests read ``status()``."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def under_hard_limit(cmd: list[str], limit_s: int) -> list[str]:
    """``cmd`` under ``timeout -k 5 limit_s`` so it never outlives a stuck session.

    ``--foreground`` keeps timeout from re-sending a forwarded SIGINT to its whole process
    group: without it the server sees Ctrl-C twice, uvicorn force-exits and skips the
    lifespan shutdown (a traceback in the log, seen as a flaky test).
    """
    if not os.path.exists("/usr/bin/timeout"):
        return cmd
    return ["/usr/bin/timeout", "--foreground", "-k", "5", str(limit_s), *cmd]


def start_server(
    model: str | Path,
    args: list[str],
    log_path: Path,
    port: int | None = None,
    env: dict | None = None,
    limit_s: int = 900,
    prefix: list[str] | None = None,
) -> ServerProcess:
    """Launch `kvsnap serve` under `timeout -k` so it can never outlive ``limit_s``."""
    port = port or free_port()
    cmd = [
        *(prefix or []),
        sys.executable,
        "-m",
        "kvsnap",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    cmd = under_hard_limit(cmd, limit_s)
    full_env = {**os.environ, **(env or {})}
    log_file = open(log_path, "wb")
    launched = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    log_file.close()
    return ServerProcess(
        proc=proc, url=f"http://127.0.0.1:{port}", log_path=log_path, launched_at=launched
    )


@contextlib.contextmanager
def serving(
    model: str | Path,
    args: list[str],
    log_path: Path,
    env: dict | None = None,
    limit_s: int = 900,
    ready_s: float = 120.0,
) -> Iterator[ServerProcess]:
    """``start_server``, ready before the block runs, stopped however the block ends."""
    server = start_server(model, args, log_path, env=env, limit_s=limit_s)
    try:
        server.wait_ready(ready_s)
        yield server
    finally:
        server.stop()
