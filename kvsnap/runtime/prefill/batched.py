"""Warm-up prefill of several prompts as one batch, each state taken exactly at its last token."""

from __future__ import annotations

from typing import Any, Sequence

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx

from kvsnap.snapshot.codec import cache_arrays, check_captured_at, copy_cache


def prefill_batched(gen: Any, token_lists: Sequence[Sequence[int]]) -> list:
    """Run several warm prefixes through one BatchGenerator prompt batch and take each
    state exactly at the end of its tokens (a dummy last segment is never run).

    ``gen`` is a fresh mlx-lm BatchGenerator sized for ``len(token_lists)``; it is closed here.
    """
    n = len(token_lists)
    uids = gen.insert_segments([[list(t), [0]] for t in token_lists], max_tokens=[1] * n)
    index = {uid: i for i, uid in enumerate(uids)}
    out: list = [None] * n
    try:
        while any(c is None for c in out):
            prompt_responses, generation_responses = gen.next()
            if generation_responses:  # cannot happen: each sequence is removed at its boundary
                raise RuntimeError("warm-up prefill reached a decode step")
            for r in prompt_responses:
                i = index.get(r.uid)
                if i is None or out[i] is not None or not r.end_of_segment or r.end_of_prompt:
                    continue
                cache = copy_cache(gen.extract_cache([r.uid])[r.uid][0])
                mx.eval([a for c in cache for a in cache_arrays(c)])
                check_captured_at(cache, len(token_lists[i]))
                out[i] = cache
                gen.remove([r.uid])
    finally:
        gen.close()
    return out
