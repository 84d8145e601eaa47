"""A fetched record's blocks received into one buffer per tensor, all its tokens in a row.

A record's KV arrives as blocks, each a part whose tensors hold its tokens ``(..., t, dim)``.
Received one buffer per part, the first request on the record concatenated them (the batch's
shared prefix: 1.1-4.4 s at 8k fp32 tokens on 2 cores, fresh memory written once more), where
a local hit reads its kept prefix as it is. Here each block's tensor is received straight
into its tokens' place in one buffer ``(..., n + room, dim)`` per tensor (a part's tensor is
one contiguous run per leading row there), and the part's arrays are views of it: the state is
its blocks as before and also one contiguous prefix (``RecordBuffers``, the state's
``whole``). The ``room`` after the record's tokens takes the tokens of the request that
continues it, so that request keeps its prompt as views too (``RecordBuffers.extend``)
instead of copying all of the KV into fresh memory. The bytes are checked as they arrive, as
for a part's own buffer (``tier_values.receive_part``).

No mlx import at module level: the buffers are made on the fetch's mlx thread
(``on_mlx_thread``), each when a block first reaches its tensor (so making them overlaps the
receiving), and zeroed by mlx (a fetch runs beside the engine's steps: see
``fileio.zeroed_buffer``).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

from kvsnap.snapshot.file import Header, TensorEntry
from kvsnap.snapshot.format import DTYPES
from kvsnap.store.part_readers import on_mlx_thread

# Tokens of room after a fetched record's in its buffers: the next turn's prompt and reply
# (a longer one copies the KV as before). 1,024 fp32 tokens of the Qwen3-0.6B shape: 235 MB.
ROOM_TOKENS = 1024


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
    ``n_tokens``)) are received. ``place`` is called once per block on the mlx thread;
    ``buffers`` once every block was placed."""

    def __init__(
        self, spans: Sequence[tuple[str, int, int]], n_tokens: int, room: int = ROOM_TOKENS
    ):
        self.spans = {key: (start, end) for key, start, end in spans}
        self.n_tokens = n_tokens
        self.capacity = n_tokens + max(0, room)
        self._forms: dict[str, tuple] = {}  # tensor name -> (leading shape, dim, dtype)
        self._arrays: dict[str, Any] = {}  # tensor name -> (..., capacity, dim)
        self._bytes: dict[str, memoryview] = {}  # the same buffers, writable bytes
        self._placed: set[str] = set()
        self._refused = False

    def place(self, key: str, header: Header) -> tuple[Iterator[memoryview], dict] | None:
        """Block ``key``'s data as runs of the record's buffers, in the data's byte order (an
        iterator: a buffer is made when the first block reaches its tensor), and the dict its
        tensors' views fill once the runs are all taken; None when the block does not fit
        (another span, an unknown dtype or shape): the caller receives it into a buffer of its
        own and the record has no ``buffers``."""
        span = self.spans.get(key)
        entries = sorted(header.tensors.values(), key=lambda e: e.start)
        if span is None or key in self._placed or not all(self._fits(e, span) for e in entries):
            self._refused = True
            return None
        for e in entries:
            self._forms.setdefault(e.name, _form(e))
        self._placed.add(key)
        views: dict = {}
        return self._runs(entries, span, views), views

    def _runs(self, entries: list, span: tuple[int, int], views: dict) -> Iterator[memoryview]:
        start, end = span
        for e in entries:
            if e.name not in self._bytes:
                on_mlx_thread(self._make, e.name)
            row = e.shape[-1] * DTYPES[e.dtype][1]  # one token's bytes in one leading row
            whole = self._bytes[e.name]
            for lead in range(math.prod(e.shape[:-2])):
                at = (lead * self.capacity + start) * row
                yield whole[at : at + (end - start) * row]
        views.update(on_mlx_thread(self._views, [e.name for e in entries], start, end))

    def _fits(self, e: TensorEntry, span: tuple[int, int]) -> bool:
        if (
            e.dtype not in DTYPES
            or len(e.shape) < 2
            or e.shape[-2] != span[1] - span[0]
            or e.nbytes != math.prod(e.shape) * DTYPES[e.dtype][1]
        ):
            return False
        return self._forms.get(e.name, _form(e)) == _form(e)

    def _make(self, name: str) -> None:
        """The record's buffer for tensor ``name`` (mlx thread), zeroed by mlx: its bytes and
        a typed view of them."""
        import mlx.core as mx

        if name in self._bytes:  # another block's thread asked first
            return
        lead, dim, dtype = self._forms[name]
        mlx_name, size = DTYPES[dtype]
        shape = (*lead, self.capacity, dim)
        buf = mx.zeros((max(1, math.prod(shape) * size),), dtype=mx.uint8)
        typed = buf.view(getattr(mx, mlx_name)).reshape(shape)
        mx.eval(buf, typed)
        self._arrays[name] = typed
        self._bytes[name] = memoryview(buf)  # type: ignore[arg-type]

    def _views(self, names: list[str], start: int, end: int) -> dict:
        import mlx.core as mx

        views = {name: self._arrays[name][..., start:end, :] for name in names}
        mx.eval(list(views.values()))
        return views

    @property
    def buffers(self) -> RecordBuffers | None:
        """The record's buffers once every block was placed here and filled (None otherwise:
        a block received elsewhere left its tokens' place unfilled)."""
        if self._refused or self._placed != set(self.spans) or set(self._bytes) != set(self._forms):
            return None
        return RecordBuffers(dict(self._arrays), dict(self._bytes), self.n_tokens, self.capacity)


def _form(e: TensorEntry) -> tuple:
    return (tuple(e.shape[:-2]), e.shape[-1], e.dtype)
