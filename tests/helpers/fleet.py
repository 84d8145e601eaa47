"""A real ``redis-server`` on a free 127.0.0.1 port for the shared-tier tests: started
without persistence, stopped, paused (SIGSTOP), resumed, flushed and configured through
redis-py, always killed at the end."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvsnap.tools.serverproc import free_port


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (apt-get install {tool}; .ci/run installs it)")
    return path


class RedisServer:
    def __init__(self, folder: Path, *args: str):
        self.folder = folder
        self.args = args
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        cmd = [need("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.folder), *self.args]
        log = open(self.folder / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except Exception:  # noqa: BLE001 - not listening yet: poll until the deadline
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"redis-server did not start (exit {self.proc.poll()})"
                    ) from None
            time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused server must see the kill
            self.proc.kill()
            self.proc.wait(10)

    def keys(self) -> list[str]:
        return sorted(k.decode() for k in self.client().scan_iter(match="kvsnap:*", count=1000))

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
