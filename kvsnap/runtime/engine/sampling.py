"""Per-request samplers: greedy, or temperature/top-p with the request's own seeded RNG key.

Each request owns its key, so a seeded request samples the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

import random
from typing import Callable

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx  # noqa: E402
from mlx_lm.sample_utils import apply_top_p  # noqa: E402

Sampler = Callable[[mx.array], mx.array]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_request_sampler(
    temperature: float, top_p: float = 1.0, seed: int | None = None
) -> Sampler:
    if temperature <= 0:
        return greedy
    # mlx takes a uint64 seed; a negative int64 seed maps onto it one to one.
    key = mx.random.key(seed % 2**64 if seed is not None else random.getrandbits(31))

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1 / temperature), key=sub)

    return sample
