"""Connections before they are requests: a cap on open connections, a deadline for each
request head, and accept errors logged as one line per interval, never a flood.

uvicorn bounds neither how long a request head may take nor (short of answering 503 after
reading it) how many sockets are open, so a client trickling one header line every few
seconds over thousands of connections exhausts the file descriptors (slowloris). The
protocol class made here closes a connection whose head is not complete in time; at the
cap, a new connection evicts the one that has waited longest for its head (a slow client,
never a request being served), and is refused only when every slot serves a request.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from dataclasses import dataclass, field

from kvsnap.errors import UsageError

log = logging.getLogger("kvsnap.http.server")

FD_RESERVE = 128  # descriptors kept free beyond the connection cap: model, store files, threads
MIN_CONNECTIONS = 8
LOG_INTERVAL_S = 10.0
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass
class RateLimitedLog:
    """Counts events by kind; writes at most one line per kind per ``interval_s``."""

    interval_s: float = LOG_INTERVAL_S
    _counts: dict = field(default_factory=dict)
    _last: dict = field(default_factory=dict)

    def event(self, kind: str, message: str) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval_s) >= self.interval_s:
            n, self._counts[kind] = self._counts[kind], 0
            self._last[kind] = now
            log.warning("[kvsnap] %s (%d in the last %.0fs)", message, n, self.interval_s)


@dataclass
class ConnectionGuard:
    """One server's connection bookkeeping (no module-level state)."""

    max_connections: int
    header_timeout_s: float
    flood_log: RateLimitedLog = field(default_factory=RateLimitedLog)
    open: set = field(default_factory=set)
    waiting_head: dict = field(default_factory=dict)  # protocol -> None, oldest first

    def admit(self, proto) -> bool:
        """Room for ``proto``: evict the connection waiting longest for its head, if needed."""
        if len(self.open) >= self.max_connections:
            oldest = next(iter(self.waiting_head), None)
            if oldest is None:
                self.flood_log.event(
                    "refused",
                    f"connections refused: all {self.max_connections} "
                    "serve requests (--max-connections)",
                )
                return False
            self.flood_log.event(
                "evicted",
                f"slow connections closed to make room (--max-connections {self.max_connections})",
            )
            oldest.close_slow()
        self.open.add(proto)
        return True

    def exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """asyncio's handler, except that running out of descriptors is counted, not logged each
        time."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in ACCEPT_ERRNOS:
            self.flood_log.event(
                "accept",
                f"accept failed: {exc.strerror}; lower --max-connections "
                "or raise the open-files limit (ulimit -n)",
            )
            return
        loop.default_exception_handler(context)


def guarded_protocol(base: type, guard: ConnectionGuard) -> type:
    """``base`` (uvicorn's h11 protocol) with the cap and the head deadline of ``guard``."""

    class GuardedProtocol(base):
        _refused = False
        _head_timer = None
        _head_cycle = None

        def connection_made(self, transport) -> None:
            if not guard.admit(self):
                self._refused = True
                transport.abort()  # nothing read, nothing answered: the cheapest refusal
                return
            super().connection_made(transport)
            self._await_head()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            guard.open.discard(self)
            self._head_done()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._head_cycle:
                self._head_cycle = self.cycle  # a whole head arrived: a request now runs
                self._head_done()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_head()  # the next request's head has its own deadline

        def _await_head(self) -> None:
            self._head_done()
            guard.waiting_head[self] = None
            self._head_timer = self.loop.call_later(guard.header_timeout_s, self._head_late)

        def _head_done(self) -> None:
            guard.waiting_head.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            guard.flood_log.event(
                "head-timeout",
                "connections closed: no complete request head "
                f"within {guard.header_timeout_s:g}s (--header-timeout)",
            )
            self.close_slow()

        def close_slow(self) -> None:
            self._head_done()
            self.transport.abort()

    GuardedProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedProtocol


def raise_open_files_limit(cap: int = 65536) -> int:
    """Raise the soft RLIMIT_NOFILE toward the hard one (at most ``cap``); returns the soft
    limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # macOS refuses some values: keep what we have
            log.debug("[kvsnap] could not raise the open-files limit to %d: %s", target, exc)
    return soft


def effective_max_connections(requested: int, soft_limit: int) -> int:
    """``requested``, lowered to stay ``FD_RESERVE`` descriptors below the open-files limit."""
    room = soft_limit - FD_RESERVE
    if room < MIN_CONNECTIONS:
        raise UsageError(
            f"the open-files limit is {soft_limit}, too low to serve; raise it "
            f"(ulimit -n {FD_RESERVE + 256} or more)"
        )
    if requested > room:
        log.warning(
            "[kvsnap] --max-connections %d lowered to %d: the open-files limit is %d "
            "(ulimit -n) and %d descriptors stay free for the model and the store",
            requested,
            room,
            soft_limit,
            FD_RESERVE,
        )
        return room
    return requested
