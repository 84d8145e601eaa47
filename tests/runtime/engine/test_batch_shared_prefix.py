"""Rows of mlx-lm's BatchGenerator that hit the same cached prefix read it shared
(``batch_cache.SharedPrefix``): the batch holds only each row's own tokens, and every answer
is a cold prefill's. Rows whose prefixes part late keep the common part shared; a row with
another prefix makes the batch plain again. A real demo model, greedy."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from kvsnap.runtime.engine.batch_cache import (
    RoomyBatchKVCache,
    install_shared_attention,
    shared_prefix_of,
    with_shared_prefix,
)

PREFIX, MAX_TOKENS = 300, 6


@pytest.fixture(scope="module")
def lm(demo_models):
    loaded = demo_models.load("dense")
    assert install_shared_attention(loaded.model)
    return loaded


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return [int(t) for t in mx.random.randint(3, vocab, (n,), key=mx.random.key(seed)).tolist()]


def _cold(lm, prompt: list[int]) -> list[int]:
    """Greedy tokens of a full prefill of ``prompt`` alone."""
    cache = lm.make_cache()
    logits = lm.model(mx.array([prompt]), cache=cache)[:, -1, :]
    out = []
    for _ in range(MAX_TOKENS):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits = lm.model(mx.array([[token]]), cache=cache)[:, -1, :]
    return out


def _hit(lm, prompt: list[int], n: int) -> list:
    """The shared prefix a request with ``prompt`` reads: its first ``n`` tokens computed."""
    cache = lm.make_cache()
    lm.model(mx.array([prompt[:n]]), cache=cache)
    mx.eval([c.state for c in cache])
    return with_shared_prefix(shared_prefix_of(cache, tuple(prompt[:n])), len(prompt) - n)


def _layer(gen: BatchGenerator) -> RoomyBatchKVCache:
    return gen._generation_batch.prompt_cache[0]


def test_rows_read_a_shared_hit_once_and_answer_as_a_cold_prefill(lm):
    vocab = lm.model.args.vocab_size
    base = _tokens(PREFIX, 1, vocab)
    a = base + _tokens(5, 2, vocab)
    b = base + _tokens(7, 3, vocab)
    c = base[:290] + _tokens(14, 4, vocab)  # parts from a and b 10 tokens before their hit ends
    d = _tokens(PREFIX + 4, 5, vocab)  # nothing in common
    gen = BatchGenerator(lm.model, stop_tokens=[], completion_batch_size=8, prefill_batch_size=8)
    got: dict[int, list[int]] = {}

    def run(until_joined: int) -> None:
        while len(gen._generation_batch) < until_joined:
            for r in gen.next()[1]:
                got.setdefault(r.uid, []).append(r.token)

    hits = [_hit(lm, a, PREFIX), _hit(lm, b, PREFIX)]
    uids = gen.insert([a[PREFIX:], b[PREFIX:]], [MAX_TOKENS] * 2, hits)
    run(2)
    layer = _layer(gen)
    assert layer.prefix is not None and layer.prefix.n == PREFIX
    assert layer.keys.shape[2] < PREFIX  # the rows hold their own tokens only
    uids += gen.insert([c[290:]], [MAX_TOKENS], [_hit(lm, c, 290)])
    run(3)
    assert _layer(gen).prefix.n == 290  # the part all three hold, still read once
    uids += gen.insert([d[PREFIX:]], [MAX_TOKENS], [_hit(lm, d, PREFIX)])
    run(4)
    assert _layer(gen).prefix is None  # a row with another prefix: each row holds its own
    while len(gen._generation_batch):
        for r in gen.next()[1]:
            got.setdefault(r.uid, []).append(r.token)
    for uid, prompt in zip(uids, (a, b, c, d)):
        assert got[uid] == _cold(lm, prompt), f"row {uid}"


def test_a_row_extracted_holds_the_prefix_then_its_own_tokens(lm):
    """What a finished row hands back (kept as the request's prompt + reply) is the prefix's
    tokens followed by the row's: a plain cache a later request copies."""
    vocab = lm.model.args.vocab_size
    prompt = _tokens(PREFIX, 7, vocab) + _tokens(6, 8, vocab)
    gen = BatchGenerator(lm.model, stop_tokens=[], completion_batch_size=4, prefill_batch_size=4)
    (uid,) = gen.insert([prompt[PREFIX:]], [3], [_hit(lm, prompt, PREFIX)])
    done = []
    while not done:
        done = [r for r in gen.next()[1] if r.finish_reason is not None]
    (row,) = done
    held = prompt[:PREFIX] + row.all_tokens  # the prefix, the suffix, each generated token
    assert row.prompt_cache[0].offset == len(held) == len(prompt) + 3
    cold = lm.make_cache()
    lm.model(mx.array([held]), cache=cold)
    for mine, want in zip(row.prompt_cache, cold):
        for a, b in ((mine.keys, want.keys), (mine.values, want.values)):
            assert mx.allclose(a[..., : len(held), :], b[..., : len(held), :], atol=1e-4).item()


def test_a_shared_row_keeps_its_prompt_copying_only_its_own_tokens(lm):
    """A finished row's kept prompt + reply shares the warm head's blocks and copies only the
    row's own tokens; slicing them from the prefix's concatenation computed all of it."""
    from kvsnap.runtime.cache.composed import Block, ComposedState
    from kvsnap.runtime.engine.request_cache import SharedHead, _kept_from_views
    from kvsnap.snapshot.codec import encode_cache
    from kvsnap.snapshot.format import TOKENS

    vocab = lm.model.args.vocab_size
    prompt = _tokens(PREFIX, 9, vocab) + _tokens(6, 10, vocab)
    warm = lm.make_cache()
    lm.model(mx.array([prompt[:PREFIX]]), cache=warm)
    arrays, layers = encode_cache(warm, prompt[:PREFIX])
    del arrays[TOKENS]
    mx.eval(arrays)
    head = SharedHead(
        ComposedState([(0, PREFIX, Block("b", arrays, layers))], None, layers, PREFIX), PREFIX
    )
    prefix_bytes = sum(a.nbytes for a in arrays.values())
    gen = BatchGenerator(lm.model, stop_tokens=[], completion_batch_size=4, prefill_batch_size=4)
    gen.insert([prompt[PREFIX:]], [3], [_hit(lm, prompt, PREFIX)])
    done = []
    while not done:
        done = [r for r in gen.next()[1] if r.finish_reason is not None]
    held = prompt[:PREFIX] + done[0].all_tokens
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    kept, computed = _kept_from_views(done[0].prompt_cache, tuple(held), head)
    mx.eval(computed)
    assert mx.get_peak_memory() - before < prefix_bytes / 4
    cold = lm.make_cache()
    lm.model(mx.array([held]), cache=cold)
    for mine, want in zip(kept, cold):
        n = len(held)
        assert mine.offset == n
        assert mx.allclose(mine.keys[..., :n, :], want.keys[..., :n, :], atol=1e-4).item()
