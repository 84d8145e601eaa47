"""Issue 41 item 3: a finished request keeps its prompt + reply, so the next turn of a
conversation, which re-renders the reply to the tokens that were generated, reuses them.

Real engines on the tiny dense, hybrid (SSM layers: untrimmable) and sliding-window demo
models, greedy. The generated token ids come from the request's own log-probabilities, so
the next turn's tokens are exactly what a client re-rendering the reply sends. The oracle is
an engine with no prefix cache (``cache_memory_mb=0``): a cold full prefill.
"""

from __future__ import annotations

import pytest
from helpers.models import LONG_SYSTEM

ARCHES = ["dense", "hybrid", "sliding"]
MAX_TOKENS = 12
REPLY_PERSISTED = 24  # more than request_cache.MIN_PERSISTED_REPLY tokens: persisted
FIRST = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "hello there"}]
# the next turn's tail after the reply (ChatML, as the demo template renders it)
TAIL = "<|im_end|>\n<|im_start|>user\nand the tests?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def digest_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSNAP_CACHE_DIR", str(tmp_path_factory.mktemp("kvsnap-cache")))
    yield
    mp.undo()


class Engines:
    def __init__(self, demo_models):
        self.demo_models, self.started = demo_models, []

    def start(self, name: str, **config):
        from kvsnap.runtime.engine.engine import Engine, EngineConfig

        lm = self.demo_models.load(name)
        engine = Engine(
            EngineConfig(model=str(self.demo_models.path(name)), settings=lm.settings, **config)
        )
        self.started.append(engine)
        engine.start()
        assert engine.wait_warm(120)
        return engine

    def shutdown(self):
        for engine in self.started:
            engine.shutdown()


@pytest.fixture()
def engines(demo_models, digest_dir):
    made = Engines(demo_models)
    yield made
    made.shutdown()


@pytest.fixture(scope="module")
def cold(demo_models, digest_dir):
    """Answers of a cold full prefill, one engine per model with no prefix cache."""
    made = Engines(demo_models)
    engines: dict = {}

    def answer(name: str, tokens: list[int]) -> list[int]:
        if name not in engines:
            engines[name] = made.start(name, cache_memory_mb=0)
        state = run(engines[name], tokens)
        assert state.cached_tokens == 0
        return generated(state)

    yield answer
    made.shutdown()


def run(engine, tokens, max_tokens: int = MAX_TOKENS, stop=(), namespace: str = "", wait=True):
    from kvsnap.runtime.engine.types import GenerationRequest

    request = GenerationRequest(
        tokens=list(tokens),
        max_tokens=max_tokens,
        stop=tuple(stop),
        namespace=namespace,
        top_logprobs=0,  # the generated token ids, to re-render the reply exactly
    )
    state = engine.submit(request, lambda s, k, p: None)
    if wait:
        assert state.done.wait(120), "the request did not finish"
        engine.call(lambda: None)  # the engine thread has run the finish's capture
    return state


def generated(state) -> list[int]:
    return [lp.token for lp in state.logprobs]


def tokens_of(lm, messages) -> list[int]:
    from kvsnap.chat import request_tokens

    return request_tokens(lm.tokenizer, messages)


def own_entries(engine, namespace: str = "") -> dict[int, bool]:
    """The request entries of ``namespace``: token count -> trimmable."""
    return {
        len(e.tokens): e.trimmable
        for e in engine.prefix.entries
        if e.namespace == namespace and e.source == "request"
    }


@pytest.mark.parametrize("arch", ARCHES)
def test_the_next_turn_reuses_prompt_and_reply_and_answers_as_a_cold_prefill(
    arch, demo_models, engines, cold
):
    lm = demo_models.load(arch)
    engine = engines.start(arch)
    first_tokens = tokens_of(lm, FIRST)
    first = run(engine, first_tokens)
    assert first.finish_reason == "length"
    reply = generated(first)
    assert len(reply) == MAX_TOKENS
    held = len(first_tokens) + len(reply)  # mlx-lm feeds each token it returns
    kept = own_entries(engine)
    assert held in kept, kept
    if kept[held]:  # trimmable: the reply entry supersedes the prompt's
        assert len(first_tokens) - 1 not in kept, kept
    else:  # a hybrid or a window past its size: the prompt checkpoint stays too
        assert len(first_tokens) - 1 in kept, kept

    second_tokens = first_tokens + reply + list(lm.tokenizer.encode(TAIL))
    second = run(engine, second_tokens)
    assert second.cached_tokens == held and second.cache_source == "request"
    assert generated(second) == cold(arch, second_tokens)


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_a_changed_reply_still_reuses_the_prompt(arch, demo_models, engines, cold):
    """A template that re-renders the reply differently (Qwen3 strips <think>): the prompt's
    prefix is reused as before the reply was kept (trimmed on dense, the checkpoint on a
    hybrid)."""
    lm = demo_models.load(arch)
    engine = engines.start(arch)
    first_tokens = tokens_of(lm, FIRST)
    run(engine, first_tokens)
    other = list(lm.tokenizer.encode("A different answer." + TAIL))
    second_tokens = first_tokens + other
    second = run(engine, second_tokens)
    assert second.cached_tokens >= len(first_tokens) - 1
    assert generated(second) == cold(arch, second_tokens)


def test_a_stop_string_keeps_the_tokens_the_cache_holds(demo_models, engines, cold):
    """Ended by kvsnap's own stop string (the slot freed by ``gen.remove``): the entry is read
    before the removal and holds every generated token."""
    lm = demo_models.load("dense")
    engine = engines.start("dense")
    first_tokens = tokens_of(lm, FIRST)
    probe = run(engine, first_tokens, namespace="probe")
    text = lm.tokenizer.decode(generated(probe)[:6])
    stop = text.strip()[-2:] or text[-1:]
    first = run(engine, first_tokens, stop=[stop], namespace="s")
    assert first.finish_reason == "stop" and first.stop_sequence == stop
    reply = generated(first)
    assert 0 < len(reply) < MAX_TOKENS
    assert len(first_tokens) + len(reply) in own_entries(engine, "s")
    second_tokens = first_tokens + reply + list(lm.tokenizer.encode(TAIL))
    second = run(engine, second_tokens, namespace="s")
    assert second.cached_tokens == len(first_tokens) + len(reply)
    assert generated(second) == cold("dense", second_tokens)


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_a_cancelled_request_keeps_no_reply(arch, demo_models, engines):
    lm = demo_models.load(arch)
    engine = engines.start(arch)
    first_tokens = tokens_of(lm, FIRST)
    state = run(engine, first_tokens, max_tokens=2000, wait=False)
    while not state.logprobs and not state.done.is_set():
        state.done.wait(0.01)
    engine.cancel(state)
    assert state.done.wait(60) and state.finish_reason == "cancelled"
    engine.call(lambda: None)
    assert max(own_entries(engine)) == len(first_tokens) - 1  # the prompt's only


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_persisted_prompt_and_reply_serve_the_next_turn_after_a_restart(
    arch, demo_models, engines, cold, tmp_path
):
    from kvsnap.runtime.persist.options import PersistOptions
    from kvsnap.store.conversations import conversation_files
    from kvsnap.store.local import Store

    lm = demo_models.load(arch)
    store = tmp_path / "snaps"
    Store.open(store, create=True)
    config = dict(snapshots=str(store), persist=PersistOptions(), write_back=False)
    before = engines.start(arch, **config)
    first_tokens = tokens_of(lm, FIRST)
    reply = generated(run(before, first_tokens, max_tokens=REPLY_PERSISTED))
    assert len(reply) == REPLY_PERSISTED
    short = run(before, tokens_of(lm, FIRST[:1] + [{"role": "user", "content": "hi"}]))
    before.shutdown()  # writes what is queued
    lengths = {Store.open(store).inspect(p).n_tokens for p in conversation_files(store)}
    # the prompt's record and the prompt + reply's; a reply of a few tokens is not persisted
    assert lengths == {
        len(first_tokens) - 1,
        len(first_tokens) + len(reply),
        short.prompt_tokens - 1,
    }, lengths

    after = engines.start(arch, **config)
    second_tokens = first_tokens + reply + list(lm.tokenizer.encode(TAIL))
    second = run(after, second_tokens)
    assert second.cached_tokens == len(first_tokens) + len(reply)
    assert second.cache_source == "persisted"
    assert generated(second) == cold(arch, second_tokens)


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_one_request_at_a_time_keeps_the_reply_but_its_unfed_last_token(
    arch, demo_models, engines, cold
):
    """With continuous batching off (as with a quantized KV) the decode loop never feeds the
    last generated token: prompt + reply but that token is kept, and serves the next turn."""
    lm = demo_models.load(arch)
    engine = engines.start(arch, continuous_batching=False)
    first_tokens = tokens_of(lm, FIRST)
    reply = generated(run(engine, first_tokens))
    held = len(first_tokens) + len(reply) - 1
    assert held in own_entries(engine)
    second_tokens = first_tokens + reply + list(lm.tokenizer.encode(TAIL))
    second = run(engine, second_tokens)
    assert second.cached_tokens == held and second.cache_source == "request"
    assert generated(second) == cold(arch, second_tokens)
