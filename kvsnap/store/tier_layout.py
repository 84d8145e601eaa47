"""A fetched record's blocks received into one buffer per tensor, all its tokens in a row.

A record's KV arrives as blocks, each a part whose tensors hold its tokens ``(..., t, dim)``.
Received one buffer per part, the first request on the record concatenated them (the batch's
shared prefix: 1.1-4.4 s at 8k fp32 tokens on 2 cores, fresh memory written once more), where
a local hit reads its kept prefix as it is. Here each block's tensor is received straight
into its tokens' place in one buffer ``(..., n + room, dim)`` per tensor (a part's tensor is
one contiguous run per leading row there), and the part's arrays are views of it: the state is
its blocks as before and also one contiguous prefix (``RecordBuffers``, the state's
``buffers``). The ``room`` after the record's tokens takes the tokens of the request that
continues it, so that request keeps its prompt as views too (``RecordBuffers.extend``)
instead of copying all of the KV into fresh memory. The bytes are checked as they arrive, as
for a part's own buffer (``tier_values.receive_part``).

No mlx import at module level: the buffers are made on an mlx thread of the caller's, beside
the receiving (``ChainLayout``), and zeroed by mlx (a fetch runs beside the engine's steps: see
``fileio.zeroed_buffer``).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from kvsnap.snapshot.file import FormatError, Header, TensorEntry
from kvsnap.snapshot.format import DTYPES
from kvsnap.store.tier_values import ReceivedPart

log = logging.getLogger("kvsnap.tier")

# Tokens of room after a fetched record's in its buffers: the next turn's prompt and reply
# (a longer one copies the KV as before). 1,024 fp32 tokens of the Qwen3-0.6B shape: 235 MB.
ROOM_TOKENS = 1024
# How long past the fetch's deadline ``finish`` waits for the buffers before serving the
# record block by block (its blocks are all in buffers of their own by then).
FINISH_SLACK_S = 0.5
WAIT_SLICE_S = 0.05  # how often a wait for the buffers looks for an ``abandon``


class _Wait:
    """``ChainLayout.place``'s answer while the buffers are being made (with ``wait``)."""

    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()


class RecordBuffers:
    """One buffer per tensor, ``(..., capacity, dim)``: a record's ``n`` tokens, then room.
    ``head(k)``: views of the first ``k`` tokens; ``extend``: tokens written after what is
    there, once per token (a branch that differs from what was written gets None)."""

    def __init__(self, arrays: dict, byte_views: dict, n: int, capacity: int):
        self.arrays, self._bytes = arrays, byte_views
        self.n, self.capacity = n, capacity
        self.written: tuple[int, ...] = ()  # the tokens put after n so far

    def head(self, k: int) -> dict:
        return {name: a[..., :k, :] for name, a in self.arrays.items()}

    def extend(self, tokens: Sequence[int], tails: dict) -> dict | None:
        """Views of the first ``n + len(tokens)`` tokens, the room holding ``tokens`` (their KV:
        ``tails``, ``(..., len(tokens), dim)`` by tensor, evaluated here); None when they do not
        fit the room, a tensor is missing or of another form, or the room holds other tokens
        (it is written once: the views of another request read it)."""
        import mlx.core as mx

        tokens = tuple(tokens)
        done, fresh = len(self.written), len(tokens) - len(self.written)
        if (
            not tokens
            or self.n + len(tokens) > self.capacity
            or tokens[:done] != self.written[: len(tokens)]
            or tails.keys() != self.arrays.keys()
        ):
            return None
        for name, tail in tails.items():
            a = self.arrays[name]
            if (
                tuple(tail.shape[:-2]) != tuple(a.shape[:-2])
                or tail.shape[-1] != a.shape[-1]
                or tail.dtype != a.dtype
                or tail.shape[-2] != len(tokens)
            ):
                return None
        if fresh > 0:
            rows = {name: mx.contiguous(tail[..., done:, :]) for name, tail in tails.items()}
            mx.eval(list(rows.values()))
            for name, tail in rows.items():
                data = memoryview(tail).cast("B")  # type: ignore[arg-type]
                row = tail.shape[-1] * tail.itemsize  # one token in one leading row
                run = fresh * row
                for lead in range(math.prod(tail.shape[:-2])):
                    at = (lead * self.capacity + self.n + done) * row
                    self._bytes[name][at : at + run] = data[lead * run : (lead + 1) * run]
            self.written = tokens
        views = self.head(self.n + len(tokens))
        mx.eval(list(views.values()))
        return views


class ChainLayout:
    """Where the blocks of one record (``spans``: ``(key, start, end)`` tiling [0,
    ``n_tokens``)) are received. ``place`` is called once per block on the fetch's mlx
    thread; ``finish`` once every block was received and checked (``abandon`` instead when the
    fetch failed).

    The buffers are made (zeroed: ~1.2 CPU s per 2 GB on these cores, nearly all of it the
    kernel handing out fresh pages) by ``allocate`` (a function that runs a call on an mlx
    thread of its own and returns its Future), in ``pieces`` calls that run at once, when the
    first block names the tensors. With ``wait``, ``place`` waits for them (until
    ``deadline``) before a block is received: a block received into a buffer of its own pays
    that fresh memory a second time and a copy, beside the zeroing on the same cores (the
    fetch took 3.3-7.8 s so, 1.9 GB at 8k tokens). Without ``wait`` (or past the deadline, or
    when the making failed) the blocks placed before the buffers are ready are received into
    buffers of their own and copied in by ``finish``. Without ``allocate`` the first block
    makes them, there and then.

    A block's header is not authenticated until its data's MAC is checked, after ``place``:
    ``sizes`` (block key -> its file's size, from the record's sealed header) bound what a
    header may make here. A block whose file is not its sealed size is refused (FormatError),
    and no buffers are made past what the sealed sizes imply for ``n_tokens`` + room (a forged
    header would have a replica zero gigabytes). ``deadline`` (monotonic) bounds ``finish``'s
    wait for the buffers; ``record`` names the record in its warning."""

    def __init__(
        self,
        spans: Sequence[tuple[str, int, int]],
        n_tokens: int,
        room: int = ROOM_TOKENS,
        allocate: Callable[[Callable[[], None]], Future] | None = None,
        sizes: Mapping[str, int] | None = None,
        deadline: float | None = None,
        record: str = "a fetched record",
        pieces: int = 1,
        wait: bool = False,
    ):
        self.spans = {key: (start, end) for key, start, end in spans}
        self.n_tokens = n_tokens
        self.capacity = n_tokens + max(0, room)
        self._allocate = allocate
        self._sizes = sizes
        self._deadline = deadline
        self._record = record
        self._pieces = max(1, pieces)
        self._wait = wait
        self._made: list[Future] = []
        self._ready = False  # every buffer made
        self._forms: dict[str, tuple] = {}  # tensor name -> (leading shape, dim, dtype)
        self._arrays: dict[str, Any] = {}  # tensor name -> (..., capacity, dim)
        self._bytes: dict[str, memoryview] = {}  # the same buffers, writable bytes
        self._placed: set[str] = set()
        self._early: dict[str, list] = {}  # blocks received before the buffers: their entries
        self._refused = False
        self._abandoned = False

    def place(self, key: str, header: Header) -> tuple[list[memoryview], dict] | _Wait | None:
        """Block ``key``'s data as runs of the record's buffers, in the data's byte order, and
        its tensors as views of them (evaluated); WAIT (with ``wait``) while the buffers are
        being made: the caller waits (``wait_for_buffers``, on its own thread) and asks again;
        None when the buffers are not made yet (the caller receives it into a buffer of its
        own; ``finish`` copies it in) or it does not fit (another span, tensor, dtype or shape,
        or buffers past what the sealed sizes imply: the record then has no buffers).
        FormatError when its file is not the size its record sealed (it is not the block the
        record names)."""
        sealed = None if self._sizes is None else self._sizes.get(key)
        if sealed is not None and header.file_size != sealed:
            self._refused = True
            raise FormatError(
                f"block {key} of {self._record} is a {header.file_size}-byte file, its record "
                f"sealed {sealed} bytes (not the block the record names)"
            )
        span = self.spans.get(key)
        entries = sorted(header.tensors.values(), key=lambda e: e.start)
        if (
            span is None
            or key in self._placed
            or (self._sizes is not None and sealed is None)
            or not entries
            or not all(self._fits(e, span) for e in entries)
            or (self._forms and {e.name for e in entries} != self._forms.keys())
            or (not self._forms and not self._within_sealed(entries))
        ):
            self._refused = True
            return None
        if not self._forms:
            self._forms = {e.name: _form(e) for e in entries}
            if self._allocate is None:
                self._make(list(self._forms))
                self._ready = True
            else:
                names = list(self._forms)
                self._made = [
                    self._allocate(functools.partial(self._make, names[i :: self._pieces]))
                    for i in range(min(self._pieces, len(names)))
                ]
        if not self._ready:
            self._ready = self._buffers_made()
        if not self._ready and self._wait and not self._given_up():
            return WAIT
        self._placed.add(key)
        if not self._ready:
            self._early[key] = entries
            return None
        return self._runs(entries, span), self._views(entries, span)

    def abandon(self) -> None:
        """The fetch failed or gave up (any thread): the buffers are not made if not started
        yet, and a ``place`` waiting for them stops waiting."""
        self._abandoned = True
        for made in self._made:
            made.cancel()

    def wait_for_buffers(self) -> None:
        """(any thread but the one ``place`` runs on, which may have to serve the others) Until
        every buffer is made, one failed, the deadline passed or the fetch was abandoned."""
        deadline = self._deadline
        while self._made and deadline is not None and not self._given_up():
            left = deadline - time.monotonic()
            _, pending = futures_wait(self._made, timeout=max(0.0, min(left, WAIT_SLICE_S)))
            if not pending:
                return

    def _buffers_made(self) -> bool:
        return bool(self._made) and all(
            f.done() and not f.cancelled() and f.exception() is None for f in self._made
        )

    def _given_up(self) -> bool:
        """Whether ``place`` no longer waits: abandoned, a buffer failed, or past the deadline."""
        return (
            self._abandoned
            or self._deadline is None
            or time.monotonic() >= self._deadline
            or any(f.done() and (f.cancelled() or f.exception() is not None) for f in self._made)
        )

    def finish(self, received: Mapping[str, ReceivedPart]) -> RecordBuffers | None:
        """(the fetch's mlx thread, every block received and checked: ``received`` by block
        key) The record's buffers, the blocks received before them copied in (their parts then
        view the buffers, so their own are freed: ``received`` is updated); None when a block
        was refused, missing or not received, or the buffers could not be made by the
        deadline (+ FINISH_SLACK_S): the record is then served block by block, each block in
        its own buffers (a warning names the record and why)."""
        if self._refused or not set(self.spans) <= self._placed & set(received):
            self.abandon()
            return None
        if self._made:
            deadline = self._deadline
            try:
                for made in self._made:  # each waited for until the deadline (+ the slack)
                    wait = None
                    if deadline is not None:
                        wait = max(0.0, deadline - time.monotonic()) + FINISH_SLACK_S
                    made.result(timeout=wait)
            # made on another thread: out of memory, cancelled at shutdown, past the deadline
            except Exception as exc:
                self.abandon()
                log.warning(
                    "[kvsnap] shared tier: %s's buffers were not made (%s); it is served "
                    "block by block",
                    self._record,
                    f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
                )
                return None
            self._ready = True
        if not self._ready or not set(self._early) <= received.keys():
            return None
        updated = {}
        for key, entries in self._early.items():
            part = received[key]
            data = part.runs[0] if len(part.runs) == 1 else memoryview(b"".join(part.runs))
            runs = self._runs(entries, self.spans[key])
            at = 0
            for run in runs:  # the part's data in its byte order, as the runs take it
                run[:] = data[at : at + len(run)]
                at += len(run)
            updated[key] = replace(
                part, runs=tuple(runs), held=self._views(entries, self.spans[key])
            )
        if isinstance(received, dict):
            received.update(updated)
        return RecordBuffers(dict(self._arrays), dict(self._bytes), self.n_tokens, self.capacity)

    def _within_sealed(self, entries: list) -> bool:
        """The buffers ``entries`` imply (their tokens' bytes x capacity) are no more than the
        record's sealed block sizes imply (their sum x capacity / ``n_tokens``): always so for
        the record's own blocks, whose data is less than their files."""
        if self._sizes is None:
            return True
        per_token = sum(math.prod(e.shape[:-2]) * e.shape[-1] * DTYPES[e.dtype][1] for e in entries)
        return per_token * self.n_tokens <= sum(self._sizes.get(key, 0) for key in self.spans)

    def _runs(self, entries: list, span: tuple[int, int]) -> list[memoryview]:
        start, end = span
        runs = []
        for e in entries:
            row = e.shape[-1] * DTYPES[e.dtype][1]  # one token's bytes in one leading row
            whole = self._bytes[e.name]
            for lead in range(math.prod(e.shape[:-2])):
                at = (lead * self.capacity + start) * row
                runs.append(whole[at : at + (end - start) * row])
        return runs

    def _views(self, entries: list, span: tuple[int, int]) -> dict:
        import mlx.core as mx

        views = {e.name: self._arrays[e.name][..., span[0] : span[1], :] for e in entries}
        mx.eval(list(views.values()))
        return views

    def _fits(self, e: TensorEntry, span: tuple[int, int]) -> bool:
        if (
            e.dtype not in DTYPES
            or len(e.shape) < 2
            or e.shape[-2] != span[1] - span[0]
            or e.nbytes != math.prod(e.shape) * DTYPES[e.dtype][1]
        ):
            return False
        return self._forms.get(e.name, _form(e)) == _form(e)

    def _make(self, names: list[str]) -> None:
        """These tensors' buffers (an mlx thread), zeroed by mlx: their bytes and typed views."""
        import mlx.core as mx

        for name in names:
            lead, dim, dtype = self._forms[name]
            mlx_name, size = DTYPES[dtype]
            shape = (*lead, self.capacity, dim)
            buf = mx.zeros((max(1, math.prod(shape) * size),), dtype=mx.uint8)
            typed = buf.view(getattr(mx, mlx_name)).reshape(shape)
            mx.eval(buf, typed)
            self._arrays[name] = typed
            self._bytes[name] = memoryview(buf)  # type: ignore[arg-type]


def _form(e: TensorEntry) -> tuple:
    return (tuple(e.shape[:-2]), e.shape[-1], e.dtype)
