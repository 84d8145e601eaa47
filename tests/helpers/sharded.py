"""Sharded runs on one host: ``mlx.launch -n N --backend ring`` over 127.0.0.1, each launch on
its own ring ports, stopped as a process group so no rank outlives a test; and ranks as threads
of one process (``run_ranks``), for the agreement logic in seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvsnap.tools.serverproc import ServerProcess, free_port

LAUNCH = str(Path(sys.executable).parent / "mlx.launch")


def ring_port(n: int) -> int:
    """A base port with ``n`` free ports after it (mlx.launch's ring takes consecutive ones)."""
    for _ in range(50):
        base = free_port()
        if base + n < 65535 and all(_free(base + i) for i in range(1, n + 1)):
            return base
    raise RuntimeError("no run of free ports for mlx.launch's ring")


def _free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch_argv(n: int, args: list[str]) -> list[str]:
    """``kvsnap ARGS`` as ``n`` ring ranks on this host."""
    return [
        LAUNCH,
        "-n",
        str(n),
        "--backend",
        "ring",
        "--starting-port",
        str(ring_port(n)),
        "--",
        sys.executable,
        "-m",
        "kvsnap",
        *args,
    ]


def launch_env(extra: dict | None = None) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


@dataclass
class Launched:
    server: ServerProcess

    def stop(self) -> None:
        proc = self.server.proc
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        # ranks mlx.launch started in the same group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def serve_sharded(
    model: str | Path, extra: list[str], log: Path, n: int = 2, env: dict | None = None
) -> Launched:
    """``kvsnap mlx-lm serve --model MODEL EXTRA`` as ``n`` ranks; rank 0 serves HTTP."""
    port = free_port()
    argv = launch_argv(
        n,
        [
            "mlx-lm",
            "serve",
            "--model",
            str(model),
            *extra,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=launch_env(env), start_new_session=True
        )
    server = ServerProcess(
        proc=proc, url=f"http://127.0.0.1:{port}", log_path=log, launched_at=time.perf_counter()
    )
    return Launched(server)


def run_sharded(args: list[str], n: int = 2, env: dict | None = None, timeout: float = 300):
    """``kvsnap ARGS`` as ``n`` ranks to completion: (exit status of mlx.launch, output)."""
    proc = subprocess.run(
        launch_argv(n, args),
        capture_output=True,
        text=True,
        env=launch_env(env),
        timeout=timeout,
        start_new_session=True,
    )
    return proc.returncode, proc.stdout + proc.stderr


class _Mailbox:
    """What ranks run as threads exchange: one slot per rank, filled and read between barriers."""

    def __init__(self, n: int, timeout: float):
        self.barrier = threading.Barrier(n, timeout=timeout)
        self.slots = [b""] * n

    def swap(self, rank: int, data: bytes) -> list[bytes]:
        self.slots[rank] = data
        self.barrier.wait()  # every rank wrote
        out = list(self.slots)
        self.barrier.wait()  # every rank read, before the next collective writes
        return out


def thread_ranks() -> type:
    """``RankGroup`` over a ``_Mailbox``: kvsnap's collectives of small values (bytes, JSON, rank
    0's value, barriers) between threads. A rank that skips a collective its peers make breaks
    the barrier (BrokenBarrierError) where mlx's would hang. Arrays do not cross."""
    from kvsnap.runtime.sharding.ranks import RankGroup

    class ThreadRanks(RankGroup):
        def gather_bytes(self, data: bytes) -> list[bytes]:
            return self.group.swap(self.rank, bytes(data))

        def barrier(self) -> None:
            self.group.swap(self.rank, b"")

        def all_gather(self, x: Any) -> Any:
            raise NotImplementedError("ranks run as threads exchange no arrays")

    return ThreadRanks


def run_ranks(n: int, body: Callable[[Any], Any], timeout: float = 60.0) -> list:
    """``body(ranks)`` on ``n`` threads, each one rank of a group; every rank's result, in rank
    order. A rank that raises breaks the others' next collective, and its error is raised."""
    mailbox = _Mailbox(n, timeout)
    group = thread_ranks()

    def one(rank: int) -> Any:
        try:
            return body(group(mailbox, rank, n))
        except BaseException:
            mailbox.barrier.abort()
            raise

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, rank) for rank in range(n)]
        return [f.result() for f in futures]
