"""Cold requests admitted together that share a system prompt compute it once."""

from __future__ import annotations

import pytest
from helpers.models import LONG_SYSTEM

from kvsnap.runtime.cache.shared_prefix import shared_groups

QUESTIONS = [
    "Check the parser.",
    "Explain the server fix.",
    "List the failing tests.",
    "What does the cache do?",
]


def test_groups_need_one_namespace_and_enough_shared_tokens():
    base = list(range(100))
    lists = [base + [1000], base + [1001, 5], base[:10] + [7] * 50, base + [1002]]
    groups = shared_groups(lists, ["a", "a", "a", "b"], min_shared=32)
    assert groups == [type(groups[0])(members=(0, 1), length=100)]
    # A member that is the shared part itself leaves a token to compute: length < shortest.
    assert shared_groups([base, base + [1]], ["", ""], min_shared=32)[0].length == 99
    assert shared_groups([base, base + [1]], ["", ""], min_shared=200) == []


def _engine(model, **config):
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(model), max_batch_size=8, **config))
    engine.start()
    assert engine.wait_warm(120)
    return engine


def _submit_together(engine, token_lists, namespace=""):
    from kvsnap.runtime.engine.engine import GenerationRequest

    states = []

    # Submitted from the engine thread itself: all four land in one admission.
    def submit_all():
        for tokens in token_lists:
            states.append(
                engine.submit(
                    GenerationRequest(tokens=tokens, max_tokens=12, namespace=namespace),
                    lambda *a: None,
                )
            )

    engine.call(submit_all)
    for s in states:
        assert s.done.wait(120)
    return states


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_concurrent_cold_requests_sharing_a_system_prompt_compute_it_once(
    arch, demo_models, tmp_path, monkeypatch
):
    from kvsnap.chat import request_tokens

    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    model = demo_models.path(arch)
    lm = demo_models.load(arch)
    token_lists = [
        request_tokens(
            lm.tokenizer,
            [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}],
        )
        for q in QUESTIONS
    ]
    shared = min(len(t) for t in token_lists)
    for t in token_lists[1:]:
        shared = min(shared, next(i for i, (a, b) in enumerate(zip(token_lists[0], t)) if a != b))

    together = _engine(model, continuous_batching=True)
    alone = _engine(model, continuous_batching=True)
    try:
        states = _submit_together(together, token_lists)
        status = together.status()
        assert status["shared_prefills"] == 1
        # mlx-lm's own counter plus the shared prefill: the system prompt ran once, not four times.
        assert status["tokens"]["computed"] == shared + sum(len(t) - shared for t in token_lists)
        assert all(s.cached_tokens == shared for s in states)
        # One lookup per request: the shared prefill's own lookup is no
        # request, and every member reused the shared prefix, so four hits and no miss.
        cache = status["cache"]
        assert (cache["hits"], cache["misses"], cache["tokens_saved"]) == (4, 0, 4 * shared), cache
        for tokens, st in zip(token_lists, states):
            alone.call(lambda: alone.prefix.clear())  # each one truly cold
            ref = _submit_together(alone, [tokens])[0]
            assert st.text == ref.text and st.completion_tokens == ref.completion_tokens
    finally:
        together.shutdown()
        alone.shutdown()


def test_requests_of_two_namespaces_never_share_a_computed_prefix(
    demo_models, tmp_path, monkeypatch
):
    from kvsnap.chat import request_tokens

    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    lm = demo_models.load("dense")
    token_lists = [
        request_tokens(
            lm.tokenizer,
            [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}],
        )
        for q in QUESTIONS[:2]
    ]
    engine = _engine(demo_models.path("dense"), continuous_batching=True)
    try:
        from kvsnap.runtime.engine.engine import GenerationRequest

        states = []

        def submit_two():
            for tokens, ns in zip(token_lists, ("tenant-a/", "tenant-b/")):
                states.append(
                    engine.submit(
                        GenerationRequest(tokens=tokens, max_tokens=4, namespace=ns),
                        lambda *a: None,
                    )
                )

        engine.call(submit_two)
        for s in states:
            assert s.done.wait(120)
        assert engine.status()["shared_prefills"] == 0 and all(s.cached_tokens == 0 for s in states)
    finally:
        engine.shutdown()
