"""What the engine tests and the server tests both check about a served request."""

from __future__ import annotations


def warm_entry(engine, tokens):
    """The shared (warm) prefix entry holding exactly ``tokens``, or None."""
    return next(
        (e for e in engine.prefix.entries if e.tokens == tuple(tokens) and e.namespace is None),
        None,
    )


def assert_served_from_the_exact_snapshot_state(engine, warm, tokens) -> None:
    """Stronger than equal text (a zeroed key in one layer kept the greedy text).

    On the engine thread: the warm entry's state, and a private copy of it as a request gets,
    are bitwise a fresh prefill of the warm tokens; the first-token logits from the copy match
    a one-shot prefill of the whole request; and the prefix the request captured, which holds
    the KV the request attended to, starts with exactly those warm keys and values.
    """
    import mlx.core as mx

    from kvsnap.runtime.prefill.chunked import prefill_in_blocks
    from kvsnap.snapshot.codec import encode_cache

    warm = tuple(warm)

    def check():
        lm = engine.lm
        # A snapshot's state was prefilled block by block (at its chain's ends); the engine's own
        # warm-up prefill in one run.
        info = (
            next(
                (i for i in engine.store.scan()[0] if i.tokens == warm and i.chain is not None),
                None,
            )
            if engine.store is not None
            else None
        )
        ends = [end for _, _, end in info.chain.blocks] if info is not None else [len(warm)]
        fresh, _ = encode_cache(prefill_in_blocks(lm, warm, ends), warm)
        from kvsnap.runtime.cache.composed import ComposedState

        entry = warm_entry(engine, warm)
        copy = engine.prefix.copy_state(entry.state)
        # A snapshot is held as shared blocks; what it stores is what it materializes into.
        stored = (
            entry.state.materialize() if isinstance(entry.state, ComposedState) else entry.state
        )
        for label, state in (("stored", stored), ("private copy", copy)):
            got, _ = encode_cache(state, warm)
            assert sorted(got) == sorted(fresh), label
            for name, want in fresh.items():
                assert mx.array_equal(got[name], want).item(), (
                    f"{label} state differs from a fresh prefill at {name}"
                )
        logits = lm.model(mx.array([list(tokens[len(warm) :])], dtype=mx.int32), cache=copy)[
            :, -1, :
        ]
        one_shot = lm.model(mx.array([list(tokens)], dtype=mx.int32), cache=lm.make_cache())[
            :, -1, :
        ]
        worst = mx.abs(logits - one_shot).max().item()
        assert worst <= 1e-4 * max(1.0, mx.abs(one_shot).max().item()), (
            f"first-token logits differ by {worst}"
        )
        # its prompt prefix, or the prompt + reply entry that superseded it (issue 41)
        prompt = tuple(tokens[:-1])
        captured = [
            e
            for e in engine.prefix.entries
            if e.source == "request" and e.tokens[: len(prompt)] == prompt
        ]
        assert captured, "the request's prompt prefix was not captured"
        checked = 0
        for i, layer in enumerate(captured[0].state):
            # window and SSM layers no longer hold the warm part as such
            if type(layer).__name__ == "KVCache":
                n = len(warm)
                for part in ("keys", "values"):
                    assert mx.array_equal(
                        getattr(layer, part)[..., :n, :], fresh[f"{i}.{part}"]
                    ).item(), f"the request attended to other {part} in layer {i}"
                checked += 1
        assert checked > 0

    engine.call(check)
