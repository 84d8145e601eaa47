"""Per-request samplers at the edges of what a request may send (issue 39): a top_k of the
vocabulary or more, a temperature that overflows 1/T, a top_p that underflows float32."""

from __future__ import annotations

import pytest

from kvsnap.runtime.engine.sampling import (
    TEMPERATURE_FLOOR,
    greedy,
    make_request_sampler,
    top_k_applies,
)


@pytest.fixture(scope="module")
def logprobs():
    import mlx.core as mx

    mx.random.seed(3)
    logits = mx.random.normal((1, 64))
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def draws(sampler, logprobs, n: int = 24) -> list[int]:
    return [int(sampler(logprobs).item()) for _ in range(n)]


@pytest.mark.parametrize("top_k", [64, 65, 2**31 - 1])
def test_a_top_k_of_the_vocabulary_or_more_is_off_as_zero_is(logprobs, top_k):
    # mlx-lm's apply_top_k raised for these, failing every request of the batch
    assert draws(make_request_sampler(1.0, seed=7, top_k=top_k), logprobs) == draws(
        make_request_sampler(1.0, seed=7, top_k=0), logprobs
    )
    assert not top_k_applies(top_k, 64) and top_k_applies(63, 64)


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 5e-324, TEMPERATURE_FLOOR / 2])
def test_a_temperature_below_the_floor_is_greedy(logprobs, temperature):
    import mlx.core as mx

    sampler = make_request_sampler(temperature, seed=11)
    assert sampler is greedy
    assert set(draws(sampler, logprobs)) == {int(mx.argmax(logprobs).item())}


def test_a_temperature_at_the_floor_still_samples_and_picks_the_top_token(logprobs):
    import mlx.core as mx

    sampler = make_request_sampler(TEMPERATURE_FLOOR, seed=11)
    assert sampler is not greedy
    assert set(draws(sampler, logprobs)) == {int(mx.argmax(logprobs).item())}


@pytest.mark.parametrize("top_p", [1e-50, 1e-44, 1e-30])
def test_a_tiny_top_p_keeps_the_most_likely_token(logprobs, top_p):
    # below ~1e-45, top_p times the mass is 0 in float32 and every token was dropped: the
    # draw from all -inf was uniform
    import mlx.core as mx

    sampler = make_request_sampler(1.0, top_p=top_p, seed=13)
    assert set(draws(sampler, logprobs)) == {int(mx.argmax(logprobs).item())}


@pytest.mark.parametrize("min_p", [5e-324, 1e-300, 1.0])
def test_min_p_at_its_edges_samples(logprobs, min_p):
    import mlx.core as mx

    got = draws(make_request_sampler(1.0, min_p=min_p, seed=17), logprobs)
    if min_p == 1.0:
        assert set(got) == {int(mx.argmax(logprobs).item())}
    else:
        assert len(set(got)) > 1
