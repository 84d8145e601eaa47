"""The prefix cache policy: longest strict prefix, private copies, LRU within a byte budget, pinned
entries.

Most tests use plain lists as cache states (the policy never looks inside them); the
copy-isolation tests use real mlx-lm caches of the tiny demo models.
"""

from __future__ import annotations

import pytest

from kvsnap.runtime.cache.prefix import Entry, PrefixCache


def list_cache(max_bytes: int = 1000, **kwargs) -> PrefixCache:
    return PrefixCache(
        max_bytes=max_bytes, copy_state=list, trim_state=lambda s, n: s[: len(s) - n], **kwargs
    )


def stored(cache: PrefixCache, tokens, namespace=None) -> Entry | None:
    """The entry the cache holds for exactly ``tokens`` in ``namespace`` (None: shared)."""
    return next(
        (e for e in cache.entries if e.tokens == tuple(tokens) and e.namespace == namespace), None
    )


def entry(
    tokens,
    nbytes=10,
    pinned=False,
    trimmable=True,
    resident=None,
    loader=None,
    loaded=True,
    source="request",
) -> Entry:
    tokens = tuple(tokens)
    return Entry(
        tokens=tokens,
        state=list(tokens) if loaded else None,
        nbytes=nbytes,
        trimmable=trimmable,
        pinned=pinned,
        source=source,
        loader=loader,
        resident=pinned and loaded if resident is None else resident,
    )


# --- lookup -----------------------------------------------------------------------


def test_longest_strict_prefix_wins_and_state_is_a_copy():
    cache = list_cache()
    cache.add(entry([1, 2]))
    cache.add(entry([1, 2, 3, 4]))
    cache.add(entry([9, 9, 9, 9, 9]))
    state, n, match = cache.fetch([1, 2, 3, 4, 5, 6])
    assert n == 4 and state == [1, 2, 3, 4] and match.entry.tokens == (1, 2, 3, 4)
    state.append(99)  # the caller's copy; the stored state is untouched
    assert stored(cache, [1, 2, 3, 4]).state == [1, 2, 3, 4]
    assert cache.stats.hits == 1 and cache.stats.tokens_saved == 4


def test_no_minimum_prefix_length():
    cache = list_cache()
    cache.add(entry([7]))
    state, n, _ = cache.fetch([7, 8])
    assert (state, n) == ([7], 1)


def test_miss_is_counted_and_returns_nothing():
    cache = list_cache()
    cache.add(entry([1, 2, 3]))
    assert cache.fetch([5, 6]) == (None, 0, None)
    assert cache.stats.misses == 1


def test_trimmable_entry_is_trimmed_to_the_common_prefix_leaving_one_token():
    cache = list_cache()
    cache.add(entry([1, 2, 3, 4, 5]))
    state, n, _ = cache.fetch([1, 2, 3, 8, 9])  # diverges after 3
    assert (state, n) == ([1, 2, 3], 3)
    state, n, _ = cache.fetch([1, 2, 3, 4, 5])  # equal prompt: one token must stay to compute
    assert (state, n) == ([1, 2, 3, 4], 4)
    assert stored(cache, [1, 2, 3, 4, 5]).state == [1, 2, 3, 4, 5]


def test_prompt_equal_to_untrimmable_entry_falls_back_to_a_shorter_entry_or_cold():
    cache = list_cache()
    cache.add(entry([1, 2, 3, 4], trimmable=False))
    assert cache.fetch([1, 2, 3, 4]) == (None, 0, None)  # nothing shorter: cold prefill
    assert cache.fetch([1, 2, 3, 5]) == (None, 0, None)  # diverges inside an untrimmable state
    cache.add(entry([1, 2], trimmable=False))
    state, n, _ = cache.fetch([1, 2, 3, 4])
    assert (state, n) == ([1, 2], 2)


def test_an_untrimmable_entry_that_differs_only_at_its_last_token_is_not_used():
    """Regression (mutation run): a lookup that skipped the entry's last token served (1,2,3) to
    [1,2,4,5] with 3 cached."""
    cache = list_cache()
    cache.add(entry([1, 2, 3], trimmable=False))
    assert cache.lookup([1, 2, 4, 5]) is None
    assert cache.fetch([1, 2, 4, 5]) == (None, 0, None)
    cache.add(entry([1, 2], trimmable=False))
    assert cache.fetch([1, 2, 4, 5])[:2] == ([1, 2], 2)  # the shorter strict prefix serves instead
    # and the full entry where it is a strict prefix
    assert cache.fetch([1, 2, 3, 5])[:2] == ([1, 2, 3], 3)


def test_a_trimmable_entry_that_differs_only_at_its_last_token_is_trimmed_before_it():
    cache = list_cache()
    cache.add(entry([1, 2, 3]))
    assert cache.fetch([1, 2, 4, 5])[:2] == ([1, 2], 2)


def test_ties_prefer_the_pinned_warm_entry():
    cache = list_cache()
    cache.add(entry([1, 2, 3, 4, 5, 6], source="request"))  # trimmable to 3 below
    cache.add(entry([1, 2, 3], pinned=True, source="snapshot"))
    _, n, match = cache.fetch([1, 2, 3, 9])
    assert n == 3 and match.entry.pinned


# --- budget -----------------------------------------------------------------------


def test_lru_evicts_request_prefixes_within_budget_and_never_pinned_entries():
    cache = list_cache(max_bytes=100)
    cache.add(entry([50, 1], nbytes=60, pinned=True))  # warm, resident: outside the LRU
    cache.add(entry([1, 1], nbytes=20))
    cache.add(entry([2, 2], nbytes=20))
    assert cache.current_bytes == 100 and cache.stats.evictions == 0
    cache.fetch([1, 1, 5])  # [1, 1] is now more recent than [2, 2]
    cache.add(entry([3, 3], nbytes=20))
    assert stored(cache, [2, 2]) is None, "the least recently used request prefix goes first"
    assert stored(cache, [1, 1]) is not None and stored(cache, [3, 3]) is not None
    assert cache.current_bytes <= 100 and cache.stats.evictions == 1
    cache.add(entry([4, 4], nbytes=40))  # needs both remaining request prefixes gone
    assert (
        stored(cache, [1, 1]) is None
        and stored(cache, [3, 3]) is None
        and stored(cache, [4, 4]) is not None
    )
    assert stored(cache, [50, 1]) is not None, "a pinned entry is never evicted"
    assert cache.current_bytes <= 100 and cache.stats.evictions == 3


def test_a_request_prefix_larger_than_the_budget_is_refused():
    cache = list_cache(max_bytes=100)
    cache.add(entry([1], nbytes=30))
    assert cache.add(entry([2], nbytes=500)) is False
    assert stored(cache, [2]) is None and cache.current_bytes <= 100


def test_pinned_entries_beyond_the_budget_refuse_request_prefixes_but_stay():
    cache = list_cache(max_bytes=50)
    assert cache.add(entry([1, 2, 3], nbytes=80, pinned=True))
    assert cache.add(entry([5, 6], nbytes=10)) is False
    assert stored(cache, [1, 2, 3]).loaded


def test_a_pinned_entry_is_never_replaced_by_a_request_prefix():
    cache = list_cache()
    cache.add(entry([1, 2, 3], pinned=True, source="snapshot"))
    assert cache.add(entry([1, 2, 3], source="request")) is False
    assert stored(cache, [1, 2, 3]).pinned and stored(cache, [1, 2, 3]).source == "snapshot"


def test_lazy_snapshot_entry_loads_on_first_hit_and_unloads_under_pressure_but_stays_indexed():
    loads = []

    def loader():
        loads.append(1)
        return [1, 2, 3], 40

    cache = list_cache(max_bytes=50)
    cache.add(entry([1, 2, 3], nbytes=40, pinned=True, loaded=False, resident=False, loader=loader))
    assert cache.current_bytes == 0 and len(cache) == 1
    state, n, _ = cache.fetch([1, 2, 3, 4])
    assert (state, n) == ([1, 2, 3], 3) and cache.stats.loads == 1 and cache.current_bytes == 40
    cache.add(entry([7, 7], nbytes=30))  # over budget: the snapshot is unloaded, not forgotten
    lazy = stored(cache, [1, 2, 3])
    assert lazy is not None and not lazy.loaded and cache.stats.unloads == 1
    state, n, _ = cache.fetch([1, 2, 3, 9])
    assert n == 3 and len(loads) == 2 and cache.stats.loads == 2


def test_a_snapshot_that_fails_to_load_is_dropped_and_the_next_best_entry_serves():
    class BadFile(Exception):
        pass

    def loader():
        raise BadFile("checksum mismatch")

    reported = []
    cache = list_cache(
        load_errors=(BadFile,), on_load_error=lambda e, exc: reported.append((e.tokens, str(exc)))
    )
    cache.add(entry([1, 2], pinned=True))
    cache.add(entry([1, 2, 3, 4], pinned=True, loaded=False, resident=False, loader=loader))
    state, n, _ = cache.fetch([1, 2, 3, 4, 5])
    assert (state, n) == ([1, 2], 2)
    assert reported == [((1, 2, 3, 4), "checksum mismatch")]
    assert stored(cache, [1, 2, 3, 4]) is None and cache.stats.load_errors == 1


def test_other_loader_errors_propagate():
    def loader():
        raise KeyError("a bug, not a bad file")

    cache = list_cache(load_errors=(OSError,))
    cache.add(entry([1, 2], loaded=False, loader=loader))
    with pytest.raises(KeyError):
        cache.fetch([1, 2, 3])


def test_clear_empties_everything():
    cache = list_cache()
    cache.add(entry([1], pinned=True))
    cache.add(entry([2]))
    assert cache.clear() == 2 and len(cache) == 0 and cache.current_bytes == 0


# --- real mlx caches ------------------------------------------------------------------


def _prefill(lm, tokens):
    from kvsnap.runtime.prefill.chunked import prefill

    return prefill(lm, tokens)


def _live(cache) -> dict:
    """Each layer's live arrays (KV sliced to the tokens held) and metadata, as a snapshot stores
    them."""
    from kvsnap.snapshot.codec import encode_layer

    arrays: dict = {}
    metas = [encode_layer(c, str(i), arrays) for i, c in enumerate(cache)]
    return {"meta": metas, "arrays": arrays}


def _assert_same(a, b):
    import mlx.core as mx

    x, y = _live(a), _live(b)
    assert x["meta"] == y["meta"] and sorted(x["arrays"]) == sorted(y["arrays"]) and x["arrays"]
    for name, v in x["arrays"].items():
        w = y["arrays"][name]
        assert v.shape == w.shape and v.dtype == w.dtype and mx.array_equal(v, w).item(), name


def _run(lm, cache, tokens):
    """Extend a fetched copy in place, as a request's prefill and decode would."""
    import mlx.core as mx

    lm.model(mx.array([list(tokens)], dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_fetching_a_pinned_entry_three_times_through_a_trim_leaves_it_unchanged(demo_models, name):
    from kvsnap.snapshot.codec import copy_cache, is_trimmable, trim_cache

    lm = demo_models.load(name)
    tokens = tuple(range(40, 70))
    state = _prefill(lm, tokens)
    reference = copy_cache(state)
    cache = PrefixCache(max_bytes=1 << 30, copy_state=copy_cache, trim_state=trim_cache)
    cache.add(_entry_of(state, state, tokens))

    first, n1, _ = cache.fetch(tokens + (5, 6))
    assert n1 == len(tokens)
    _run(lm, first, [5, 6])  # the first request extends its copy
    if is_trimmable(state):
        second, n2, _ = cache.fetch(tokens[:20] + (9, 9, 9))  # served through a trim
        assert n2 == 20 and all(c.offset == 20 for c in second)
        _run(lm, second, [9, 9, 9])  # and writes into the trimmed buffer
    else:
        second, n2, _ = cache.fetch(tokens + (9,))
        assert n2 == len(tokens)
        _run(lm, second, [9])  # advances the copy's SSM state
    third, n3, _ = cache.fetch(tokens + (5, 6))
    assert n3 == len(tokens)
    fresh, _, _ = cache.fetch(tokens + (1,))
    _assert_same(third, reference)
    _assert_same(fresh, reference)
    _assert_same(stored(cache, tokens).state, reference)


def test_a_trimmed_copy_extended_matches_a_fresh_prefill(demo_models):
    """Trim + extend of a private copy gives the state a prefill of those tokens gives."""
    import mlx.core as mx

    from kvsnap.snapshot.codec import copy_cache, trim_cache

    lm = demo_models.load("dense")
    base = _prefill(lm, list(range(40, 70)))
    copy = trim_cache(copy_cache(base), 10)
    _run(lm, copy, [3, 4, 5])
    direct = _prefill(lm, list(range(40, 60)) + [3, 4, 5])
    for a, b in zip(copy, direct):
        assert a.offset == b.offset == 23
        assert mx.allclose(a.keys[..., :23, :], b.keys[..., :23, :], atol=1e-5).item()
        assert mx.allclose(a.values[..., :23, :], b.values[..., :23, :], atol=1e-5).item()
    # The 20 kept tokens are the original prefill's, untouched by the trim: bitwise.
    for a, b in zip(copy, base):
        assert (
            mx.array_equal(a.keys[..., :20, :], b.keys[..., :20, :]).item()
            and mx.array_equal(a.values[..., :20, :], b.values[..., :20, :]).item()
        )


def _entry_of(held, state, tokens) -> Entry:
    """A pinned entry holding ``held`` (``state`` itself or its composed form)."""
    from kvsnap.snapshot.codec import cache_nbytes_of, is_trimmable

    return Entry(
        tokens=tuple(tokens),
        state=held,
        nbytes=cache_nbytes_of(state),
        trimmable=is_trimmable(state),
        pinned=True,
        source="snapshot",
        resident=True,
    )


def _composed(state, cut: int, n: int):
    """``state`` (a dense prefill of ``n`` tokens) as a composed state of two pooled blocks,
    [0, cut) and [cut, n), as a block record loads."""
    from kvsnap.runtime.cache.composed import Block, ComposedState
    from kvsnap.snapshot.cache_classes import layers_at

    live = _live(state)
    first = {k: v[..., :cut, :] for k, v in live["arrays"].items()}
    second = {k: v[..., cut:, :] for k, v in live["arrays"].items()}
    blocks = [
        (0, cut, Block("b0", first, layers_at(live["meta"], cut))),
        (cut, n, Block("b1", second, live["meta"])),
    ]
    return ComposedState(blocks=blocks, checkpoint=None, layers=live["meta"], n_tokens=n)


@pytest.mark.parametrize("form", ["cache", "composed"])
def test_a_partial_match_copies_only_the_tokens_it_uses(demo_models, form):
    """A request sharing 20 of an entry's 30 tokens gets a copy holding those 20 (plus room),
    not the whole entry trimmed: a 1-token match on a 2k-token snapshot used to copy all of
    its KV on the request's first write. The copy extends as a fresh prefill does, and the
    entry is untouched."""
    import mlx.core as mx

    from kvsnap.runtime.cache.composed import copy_state, copy_state_head, room_for
    from kvsnap.snapshot.codec import copy_cache, trim_cache

    lm = demo_models.load("dense")
    tokens = tuple(range(40, 70))
    state = _prefill(lm, tokens)
    reference = copy_cache(state)
    held = state if form == "cache" else _composed(state, 16, len(tokens))
    cache = PrefixCache(
        max_bytes=1 << 30,
        copy_state=copy_state,
        copy_with_room=copy_state,
        copy_head=copy_state_head,
        trim_state=trim_cache,
    )
    cache.add(_entry_of(held, state, tokens))

    served, n, _ = cache.fetch(tokens[:20] + (3, 4, 5))
    assert n == 20
    for layer in served:
        assert layer.offset == 20
        # the buffer holds the 20 tokens used (a composed copy: and room for the 3 added)
        assert layer.keys.shape[-2] == (20 if form == "cache" else 20 + room_for(3))
    _run(lm, served, [3, 4, 5])
    direct = _prefill(lm, list(tokens[:20]) + [3, 4, 5])
    for a, b in zip(served, direct):
        assert a.offset == b.offset == 23
        assert mx.allclose(a.keys[..., :23, :], b.keys[..., :23, :], atol=1e-5).item()
        assert mx.allclose(a.values[..., :23, :], b.values[..., :23, :], atol=1e-5).item()
    whole, n_whole, _ = cache.fetch(tokens + (1,))
    assert n_whole == len(tokens)
    _assert_same(whole, reference)
