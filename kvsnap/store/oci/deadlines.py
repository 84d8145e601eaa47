"""Deadlines on every registry call: a total one per request and an idle one per read.

httpx bounds each socket read (``idle_s``) but not a whole request: a registry sending one
byte every few seconds would hold ``pull`` (and ``serve --kv-snapshots oci://…``) forever.
So every socket read and write of a request is also bounded by that request's deadline:
``total_s`` plus the bytes it moves at ``min_rate`` bytes per second. The deadline is
checked below httpx, in the network stream, so headers trickled byte by byte are caught too.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

import httpcore

from kvsnap.errors import UsageError

ENV_TIMEOUT = "KVSNAP_REGISTRY_TIMEOUT"
ENV_IDLE = "KVSNAP_REGISTRY_IDLE_TIMEOUT"
ENV_MIN_RATE = "KVSNAP_REGISTRY_MIN_RATE"


@dataclass(frozen=True)
class Deadlines:
    """How long one registry request may take: ``total_s`` + its bytes at ``min_rate``; ``idle_s``
    per read."""

    total_s: float = 120.0
    idle_s: float = 30.0
    min_rate: float = 256 * 1024  # bytes per second a blob must at least arrive at

    def __post_init__(self) -> None:
        for _name, value, flag in (
            ("total_s", self.total_s, "--registry-timeout"),
            ("idle_s", self.idle_s, "--registry-idle-timeout"),
            ("min_rate", self.min_rate, "--registry-min-rate"),
        ):
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise UsageError(f"{flag} is {value!r}; give a positive number")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Deadlines":
        """The defaults, each replaced by its environment variable when set."""
        values = {}
        for field_name, env in (
            ("total_s", ENV_TIMEOUT),
            ("idle_s", ENV_IDLE),
            ("min_rate", ENV_MIN_RATE),
        ):
            text = environ.get(env, "").strip()
            if not text:
                continue
            try:
                values[field_name] = float(text)
            except ValueError:
                raise UsageError(f"${env} is {text!r}; give a positive number") from None
            if not 0 < values[field_name] < float("inf"):
                raise UsageError(f"${env} is {text!r}; give a positive number")
        return cls(**values)

    def seconds_for(self, nbytes: int) -> float:
        return self.total_s + max(0, nbytes) / self.min_rate


class RequestClock:
    """The deadline of the request each thread is making (per client, never module-wide)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def start(self, seconds: float) -> None:
        self._local.deadline = time.monotonic() + seconds
        self._local.seconds = seconds

    def remaining(self) -> float | None:
        deadline = getattr(self._local, "deadline", None)
        return None if deadline is None else deadline - time.monotonic()

    def expired(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0

    @property
    def seconds(self) -> float:
        return getattr(self._local, "seconds", 0.0)

    def bound(self, timeout: float | None, exc: type[Exception]) -> float | None:
        """``timeout`` cut to what the deadline leaves; ``exc`` when nothing is left."""
        left = self.remaining()
        if left is None:
            return timeout
        if left <= 0:
            raise exc("the request's deadline passed")
        return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, clock: RequestClock):
        self.inner = inner
        self.clock = clock

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, self.clock.bound(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, self.clock.bound(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(
        self, ssl_context, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        bounded = self.clock.bound(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(
            self.inner.start_tls(ssl_context, server_hostname, bounded), self.clock
        )

    def get_extra_info(self, info: str):
        return self.inner.get_extra_info(info)


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's sync backend with every stream's reads and writes held to the clock's deadline."""

    def __init__(self, inner: httpcore.NetworkBackend, clock: RequestClock):
        self.inner = inner
        self.clock = clock

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable | None = None,
    ) -> httpcore.NetworkStream:
        bounded = self.clock.bound(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(
            self.inner.connect_tcp(host, port, bounded, local_address, socket_options), self.clock
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable | None = None
    ) -> httpcore.NetworkStream:
        return _DeadlineStream(
            self.inner.connect_unix_socket(
                path, self.clock.bound(timeout, httpcore.ConnectTimeout), socket_options
            ),
            self.clock,
        )

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


def deadline_transport(clock: RequestClock):
    """httpx's own transport whose connections run on the deadline backend."""
    import httpx

    transport = httpx.HTTPTransport()
    # httpx keeps its httpcore pool here (httpx 0.27-0.28); checked, not assumed
    pool = transport._pool
    if not isinstance(getattr(pool, "_network_backend", None), httpcore.NetworkBackend):
        raise RuntimeError(
            "this httpx/httpcore version hides its network backend; kvsnap cannot bound registry "
            "requests (report it)"
        )
    pool._network_backend = DeadlineBackend(pool._network_backend, clock)
    return transport
