"""The one-at-a-time runner's prefill makes room for the whole prompt at once (mlx-lm grows the
cache 256 tokens at a time, copying all of it each time), answers as the growing prefill
does, and leaves decode to mlx-lm's own growth. Real tiny model, a counting KVCache."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
from helpers.counting_cache import KVCache
from helpers.models import LONG_SYSTEM

from kvsnap.runtime.engine.accounting import TokenAccounts
from kvsnap.runtime.engine.sequential import SequentialRun
from kvsnap.runtime.engine.types import GenerationRequest, RequestState


def _run(lm, tokens: list[int], max_tokens: int, cache: list) -> RequestState:
    state = RequestState(
        id=1, request=GenerationRequest(tokens=tokens, max_tokens=max_tokens), on_event=print
    )
    state.detok = lm.tokenizer.detokenizer
    state.detok.reset()
    runner = SequentialRun(lm, state, cache, TokenAccounts(), set(), lambda: False, lambda c: None)
    runner.run(tokens)
    return state


def _greedy(lm, tokens: list[int], n: int) -> list[int]:
    """mlx-lm's growth throughout: the whole prompt in one call, then greedy steps."""
    cache = lm.make_cache()
    logits = lm.model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)[:, -1, :]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits, axis=-1).item()))
        logits = lm.model(mx.array([[out[-1]]], dtype=mx.int32), cache=cache)[:, -1, :]
    return out


def test_a_long_prompt_is_prefilled_into_one_buffer_per_layer_then_decode_grows_as_mlx_lm(
    demo_models,
):
    lm = dataclasses.replace(demo_models.load("dense"))
    tokens = lm.tokenizer.encode(LONG_SYSTEM * 3)
    assert len(tokens) > 2 * 256  # several of mlx-lm's growth steps

    cache = [KVCache() for _ in lm.make_cache()]
    state = _run(lm, tokens, 1, cache)  # the last prompt token is the only decode step
    assert state.finish_reason == "length"
    assert [c.replaced for c in cache] == [1] * len(cache)
    assert {c.keys.shape[2] for c in cache} == {len(tokens)}

    cache = [KVCache() for _ in lm.make_cache()]
    state = _run(lm, tokens, 3, cache)
    assert all("step" not in vars(c) for c in cache)
    # the third token needed room: mlx-lm's 256 more, not another prompt's worth
    assert {c.keys.shape[2] for c in cache} == {len(tokens) + 256}
    assert state.completion_tokens == 3
    assert state.text == lm.tokenizer.decode(_greedy(lm, tokens, 3))
