"""Per-request samplers (greedy, or temperature with top-p, min-p and top-k, on the request's
own seeded RNG key) and the log-probabilities a request may ask for.

Each request owns its key, so a seeded request samples the same tokens whatever else
shares its batch.
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


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_request_sampler(
    temperature: float,
    top_p: float = 1.0,
    seed: int | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
) -> Sampler:
    if temperature <= 0:
        return greedy
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
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        return mx.random.categorical(logprobs * (1 / temperature), key=sub)

    return sample


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
