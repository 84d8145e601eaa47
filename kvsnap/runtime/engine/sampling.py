"""Per-request samplers (greedy, or temperature with top-p, min-p and top-k, on the request's
own seeded RNG key) and the log-probabilities a request may ask for.

Each request owns its key, so a seeded request samples the same tokens whatever else
shares its batch. Values at the edges of what a request may send are settled here, for
every route: a ``top_k`` of the vocabulary or more is off, a temperature below
``TEMPERATURE_FLOOR`` is greedy, a ``top_p`` below ``TOP_P_FLOOR`` keeps the top token.
"""

from __future__ import annotations

import random
from typing import Callable, cast

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx  # noqa: E402
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p  # noqa: E402

from kvsnap.runtime.engine.types import TokenLogprob  # noqa: E402

Sampler = Callable[[mx.array], mx.array]

# Below this a temperature is greedy: 1/T overflows float32 from 1e-39 (the scaled
# log-probabilities turn to NaN and the draw is uniform), and at 1e-5 a log-probability gap of
# 1e-3 is already a factor of e^-100, so only exact ties could be drawn otherwise.
TEMPERATURE_FLOOR = 1e-5
# top_p times the mass underflows float32 below about 1e-45 and the filter then drops every
# token; any top_p below this keeps only the most likely token, as the floor does.
TOP_P_FLOOR = 1e-30


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` samples as greedy (below the floor; NaN too)."""
    return not temperature >= TEMPERATURE_FLOOR


def top_k_applies(top_k: int, vocab: int) -> bool:
    """Whether ``top_k`` filters at all: 0 (or less) and the vocabulary or more keep every token
    (mlx-lm's ``apply_top_k`` raises for those, failing the whole batch)."""
    return 0 < top_k < vocab


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_request_sampler(
    temperature: float,
    top_p: float = 1.0,
    seed: int | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
) -> Sampler:
    if is_greedy(temperature):
        return greedy
    top_p = max(top_p, TOP_P_FLOOR)
    # mlx takes a uint64 seed; a negative int64 seed maps onto it one to one.
    key = mx.random.key(seed % 2**64 if seed is not None else random.getrandbits(31))

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        # mlx_lm.sample_utils.make_sampler's filters, in its order
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k_applies(top_k, logprobs.shape[-1]):
            logprobs = apply_top_k(logprobs, top_k)
        return mx.random.categorical(logprobs * (1 / temperature), key=sub)

    return sample


class OwnSampler:
    """A request's sampler in a shared batch: when it raises, the error is kept for the batch
    runner to end this request alone, and the batch gets a greedy token for its row."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.error: Exception | None = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.error is None:
            try:
                return self.sampler(logprobs)
            except Exception as exc:  # kept and reported: the runner fails this request
                self.error = exc
        return greedy(logprobs)


def batch_sampler(sampler: Sampler) -> Sampler:
    """``sampler`` as a batch row: greedy stays the one shared function (a batch of greedy
    requests samples in one call); any other is wrapped in ``OwnSampler``."""
    return sampler if sampler is greedy else OwnSampler(sampler)


def token_logprob(logprobs: mx.array, token: int, top_n: int) -> TokenLogprob:
    """``token``'s entry in one position's log-softmax (``logprobs``: the vocabulary's) and the
    ``top_n`` most likely, by mlx_lm.server's math (its ``_format_top_logprobs``)."""
    # mlx's stubs type item() and tolist() as any scalar or nested list; these are flat floats.
    chosen = cast(float, logprobs[token].item())
    if top_n <= 0:
        return TokenLogprob(token, chosen)
    top_n = min(top_n, logprobs.size)
    ids = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
    pairs = zip(cast(list[int], ids.tolist()), cast(list[float], logprobs[ids].tolist()))
    top = sorted(pairs, key=lambda p: -p[1])
    return TokenLogprob(token, chosen, tuple((int(i), float(v)) for i, v in top))
