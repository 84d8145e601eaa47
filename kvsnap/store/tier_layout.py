"""A fetched record's blocks received into one buffer per tensor, all its tokens in a row.

A record's KV arrives as blocks, each a part whose tensors hold its tokens ``(..., t, dim)``.
Received one buffer per part, the first request on the record concatenated them (the batch's
shared prefix: 1.9-4.4 s at 8k fp32 tokens on 2 cores, fresh memory written once more), where
a local hit reads its kept prefix as it is. Here each block's tensor is received straight
into its tokens' place in one buffer ``(..., n, dim)`` per tensor (a part's tensor is one
contiguous run per leading row there), and the part's arrays are views of it: the state is
its blocks as before and also one contiguous prefix (``ComposedState.whole``). The bytes are
checked as they arrive, as for a part's own buffer (``tier_values.receive_part``).

No mlx import at module level: ``place`` runs on the fetch's mlx thread (``on_mlx_thread``),
and its buffers are zeroed by mlx (a fetch runs beside the engine's steps: see
``fileio.zeroed_buffer``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from kvsnap.snapshot.file import Header, TensorEntry
from kvsnap.snapshot.format import DTYPES


class ChainLayout:
    """Where the blocks of one record (``spans``: ``(key, start, end)`` tiling [0,
    ``n_tokens``)) are received. ``place`` is called once per block on one thread;
    ``whole`` once every block was placed."""

    def __init__(self, spans: Sequence[tuple[str, int, int]], n_tokens: int):
        self.spans = {key: (start, end) for key, start, end in spans}
        self.n_tokens = n_tokens
        self._arrays: dict[str, Any] = {}  # tensor name -> (..., n_tokens, dim)
        self._bytes: dict[str, memoryview] = {}  # the same buffers, writable bytes
        self._dtypes: dict[str, str] = {}  # their safetensors dtypes
        self._placed: set[str] = set()
        self._refused = False

    def place(self, key: str, header: Header) -> tuple[list[memoryview], dict] | None:
        """Block ``key``'s data as runs of the record's buffers, in the data's byte order, and
        its tensors as views of them (evaluated); None when the block does not fit (another
        span, an unknown dtype or shape): the caller receives it into a buffer of its own and
        the record has no ``whole``."""
        import mlx.core as mx

        span = self.spans.get(key)
        entries = sorted(header.tensors.values(), key=lambda e: e.start)
        if span is None or key in self._placed or not all(self._fits(e, span) for e in entries):
            self._refused = True
            return None
        start, end = span
        runs: list[memoryview] = []
        views = {}
        for e in entries:
            if e.name not in self._arrays:
                self._make(e)
            row = e.shape[-1] * DTYPES[e.dtype][1]  # one token's bytes in one leading row
            whole = self._bytes[e.name]
            for lead in range(math.prod(e.shape[:-2])):
                at = (lead * self.n_tokens + start) * row
                runs.append(whole[at : at + (end - start) * row])
            views[e.name] = self._arrays[e.name][..., start:end, :]
        mx.eval(list(views.values()))
        self._placed.add(key)
        return runs, views

    def _fits(self, e: TensorEntry, span: tuple[int, int]) -> bool:
        if (
            e.dtype not in DTYPES
            or len(e.shape) < 2
            or e.shape[-2] != span[1] - span[0]
            or e.nbytes != math.prod(e.shape) * DTYPES[e.dtype][1]
        ):
            return False
        made = self._arrays.get(e.name)
        return made is None or (
            tuple(made.shape[:-2]) == tuple(e.shape[:-2])
            and made.shape[-1] == e.shape[-1]
            and self._dtypes[e.name] == e.dtype
        )

    def _make(self, e: TensorEntry) -> None:
        """The record's buffer for tensor ``e``: zeroed by mlx, a byte view and a typed one."""
        import mlx.core as mx

        name, size = DTYPES[e.dtype]
        shape = (*e.shape[:-2], self.n_tokens, e.shape[-1])
        buf = mx.zeros((max(1, math.prod(shape) * size),), dtype=mx.uint8)
        typed = buf.view(getattr(mx, name)).reshape(shape)
        mx.eval(buf, typed)
        self._arrays[e.name] = typed
        self._bytes[e.name] = memoryview(buf)  # type: ignore[arg-type]
        self._dtypes[e.name] = e.dtype

    @property
    def whole(self) -> dict | None:
        """Every tensor's buffer, ``(..., n_tokens, dim)``, once every block was placed here
        (None otherwise: a block received elsewhere left its tokens' place unfilled)."""
        if self._refused or self._placed != set(self.spans):
            return None
        return dict(self._arrays)
