"""Connections before they are requests: a cap on open connections, a deadline for each
request head, for each request body and for a response the client stops reading, and accept
errors logged as one line per interval, never a flood.

uvicorn bounds neither how long a request head or body may take nor (short of answering 503
after reading the head) how many sockets are open, so a client trickling one header line, or
one body byte, every few seconds over thousands of connections exhausts the connection slots
and the file descriptors (slowloris, slow POST). The protocol class made here closes a
connection whose head is not complete in time, and one whose body is not complete in time
after its head (a total, so trickling never extends it), and one whose response the client
has not read for a while (the send buffer full the whole time: a client that never reads a
long streamed answer would hold its slot for ever); at the cap, a new connection evicts the
one that has waited longest for its head, its body or its reader (a slow client, never a
request being served), and is refused only when every slot serves a request.
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
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0  # 8 MiB (the default --max-request-bytes) at 140 KB/s
DEFAULT_WRITE_TIMEOUT_S = 60.0
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
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    flood_log: RateLimitedLog = field(default_factory=RateLimitedLog)
    open: set = field(default_factory=set)
    # protocol -> "head", "body" or "reader": what it waits for, oldest wait first
    waiting: dict = field(default_factory=dict)

    def admit(self, proto) -> bool:
        """Room for ``proto``: evict the connection waiting longest for a head, a body or its
        client to read, if needed (whoever holds the key it sent: the wait is what a slow
        client controls)."""
        if len(self.open) >= self.max_connections:
            oldest = next(iter(self.waiting), None)
            if oldest is None:
                self.flood_log.event(
                    "refused",
                    f"connections refused: all {self.max_connections} "
                    "serve requests (--max-connections)",
                )
                return False
            self.flood_log.event(
                "evicted",
                "slow connections (waiting for a request head or body, or for the client to "
                "read) closed to make room "
                f"(--max-connections {self.max_connections})",
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
    """``base`` (uvicorn's h11 protocol) with the cap and the head, body and reader deadlines
    of ``guard``."""

    class GuardedProtocol(base):
        _refused = False
        _deadline = None
        _waits_for = ""  # "head", "body", or "" while a request is served
        _seen_cycle = None
        _stall = None  # the deadline of a response its client has stopped reading

        def connection_made(self, transport) -> None:
            if not guard.admit(self):
                self._refused = True
                transport.abort()  # nothing read, nothing answered: the cheapest refusal
                return
            super().connection_made(transport)
            self._await("head")

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            guard.open.discard(self)
            self._wait_done()
            self._reader_back()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self.cycle is not self._seen_cycle:
                self._follow_request()  # a pipelined request started at once
            else:
                self._await("head")  # the next request's head has its own deadline

        def pause_writing(self) -> None:
            super().pause_writing()
            # The transport's buffer is full: the client has stopped reading, for now.
            guard.waiting.setdefault(self, "reader")
            if self._stall is None:
                self._stall = self.loop.call_later(guard.write_timeout_s, self._unread)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._reader_back()

        def _reader_back(self) -> None:
            if guard.waiting.get(self) == "reader":
                del guard.waiting[self]
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _unread(self) -> None:
            self._stall = None
            guard.flood_log.event(
                "write-timeout",
                "connections closed: the client read none of its response "
                f"for {guard.write_timeout_s:g}s (--write-timeout)",
            )
            self.close_slow()

        def _follow_request(self) -> None:
            """Move to the deadline of where the current request now is."""
            cycle = self.cycle
            if cycle is not None and cycle is not self._seen_cycle:
                self._seen_cycle = cycle  # a whole head arrived: a request now runs
                if cycle.more_body:
                    self._await("body")  # its body has a deadline of its own, from now
                else:
                    self._wait_done()
            elif self._waits_for == "body" and cycle is not None and not cycle.more_body:
                self._wait_done()  # the whole body is in

        def _await(self, what: str) -> None:
            self._wait_done()
            self._waits_for = what
            guard.waiting[self] = what
            timeout = guard.header_timeout_s if what == "head" else guard.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._late)

        def _wait_done(self) -> None:
            if guard.waiting.get(self, "reader") != "reader":  # a stalled reader stays evictable
                del guard.waiting[self]
            self._waits_for = ""
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if self._waits_for == "head":
                guard.flood_log.event(
                    "head-timeout",
                    "connections closed: no complete request head "
                    f"within {guard.header_timeout_s:g}s (--header-timeout)",
                )
            else:
                guard.flood_log.event(
                    "body-timeout",
                    "connections closed: request body not complete "
                    f"within {guard.body_timeout_s:g}s of its head (--body-timeout)",
                )
            self.close_slow()

        def close_slow(self) -> None:
            self._wait_done()
            self._reader_back()
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
