"""Prefill of a warm prefix, one chunk at a time, so the engine can serve between chunks.

``prefill`` runs a cursor to its end: the bytes ``kvsnap build`` writes. The engine's
background re-warm advances a cursor one ``prefill_step_size`` chunk per loop turn, so a
re-warm never holds up serving for longer than one chunk. Every path reserves room for the
tokens it is about to run first (``reserve.py``), so a prefill allocates each layer's buffer
once instead of copying the whole cache every 256 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.prefill.reserve import release, reserve, reserved


def run_chunk(lm: LoadedModel, cache: list, chunk: Sequence[int]) -> None:
    """One model call over ``chunk``, then the KV quantization schedule, evaluated: a chunk of the
    server's prefill and of the build's alike."""
    import mlx.core as mx
    from mlx_lm.generate import maybe_quantize_kv_cache

    s = lm.settings
    lm.model(mx.array(list(chunk), dtype=mx.int32)[None], cache=cache)
    maybe_quantize_kv_cache(cache, s.quantized_kv_start, s.kv_group_size, s.kv_bits)
    mx.eval([c.state for c in cache])


@dataclass
class PrefillCursor:
    lm: LoadedModel
    tokens: tuple[int, ...]
    done_tokens: int = 0
    cache: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = tuple(self.tokens)
        if not self.cache:
            self.cache = self.lm.make_cache()
        reserve(self.cache, len(self.tokens) - self.done_tokens)

    @property
    def finished(self) -> bool:
        return self.done_tokens >= len(self.tokens)

    def step(self) -> int:
        """Run the next chunk; returns how many tokens it ran (0 once finished)."""
        chunk = self.tokens[
            self.done_tokens : self.done_tokens + self.lm.settings.prefill_step_size
        ]
        if not chunk:
            return 0
        run_chunk(self.lm, self.cache, chunk)
        self.done_tokens += len(chunk)
        if self.finished:
            release(self.cache)
        return len(chunk)


def prefill(lm: LoadedModel, tokens: Sequence[int]) -> list:
    """Run the model over exactly ``tokens`` in the shared step size, as the server's prefill
    does."""
    cursor = PrefillCursor(lm, tuple(tokens))
    while cursor.step():
        pass
    return cursor.cache


def prefill_in_blocks(
    lm: LoadedModel,
    tokens: Sequence[int],
    ends: Sequence[int],
    cache: list | None = None,
    start: int = 0,
    on_end=None,
    on_tokens: Callable[[int], None] | None = None,
) -> list:
    """Prefill ``tokens[start:]`` stopping at every block end (then in step-size chunks inside a
    block), so a block's state is the same whichever earlier block a build restored from;
    ``on_end(end, cache)`` runs at each end past ``start``, ``on_tokens(n)`` after each chunk
    of ``n`` tokens. Room for every token past ``start`` is reserved before the first chunk."""
    cache = cache if cache is not None else lm.make_cache()
    step = lm.settings.prefill_step_size
    done = start
    with reserved(cache, len(tokens) - start):
        for end in ends:
            if end <= done:
                continue
            for at in range(done, end, step):
                chunk = tokens[at : min(at + step, end)]
                run_chunk(lm, cache, chunk)
                if on_tokens is not None:
                    on_tokens(len(chunk))
            done = end
            if on_end is not None:
                on_end(end, cache)
    return cache
