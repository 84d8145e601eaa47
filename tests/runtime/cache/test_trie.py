"""The prefix trie answers exactly as a scan over every entry would (the lookup it replaced).

No model: cache states are plain lists. hypothesis draws entry sets over a tiny alphabet
(so prefixes collide, edges split and merge) and checks every lookup against a brute-force
reference, also after entries are discarded, unloaded, loaded again and evicted.
"""

from __future__ import annotations

from helpers.prefix_scan import scan_lookup
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap.prompts import common_prefix_length
from kvsnap.runtime.cache.prefix import Entry, PrefixCache
from kvsnap.runtime.cache.trie import TokenTrie

NAMESPACES = (None, "", "tenant-a/")


def reference_lookup(entries: list[Entry], tokens, namespace: str):
    """The linear scan kvsnap used before the trie: (tokens saved, (pinned, loaded)) of the best
    entry, or None."""
    best = scan_lookup(entries, tuple(tokens), namespace)
    return None if best is None else (best[0], best[1:3])


def usable_by(entry: Entry, tokens) -> int:
    """What ``entry`` may save for ``tokens`` under the lookup rules (0: not usable)."""
    tokens = tuple(tokens)
    n = len(entry.tokens)
    if n < len(tokens) and tokens[:n] == entry.tokens:
        return n
    if entry.trimmable:
        return max(0, min(common_prefix_length((entry.tokens, tokens)), len(tokens) - 1))
    return 0


def assert_same_as_reference(cache: PrefixCache, tokens, namespace: str) -> None:
    expected = reference_lookup(cache.entries, tokens, namespace)
    match = cache.lookup(tokens, namespace)
    if expected is None:
        assert match is None, (tokens, namespace, match)
        return
    assert match is not None, (tokens, namespace, expected)
    e = match.entry
    assert (match.n_cached, (e.pinned, e.loaded)) == expected, (tokens, namespace)
    assert e in cache.entries and (e.namespace is None or e.namespace == namespace)
    assert usable_by(e, tokens) == match.n_cached  # the entry really saves what the match says


def list_cache(max_bytes: int = 10**9) -> PrefixCache:
    return PrefixCache(
        max_bytes=max_bytes, copy_state=list, trim_state=lambda s, n: s[: len(s) - n]
    )


tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=8).map(tuple)
entry_st = st.builds(
    lambda tokens, trimmable, pinned, loaded, has_loader, ns, nbytes: (
        tokens,
        trimmable,
        pinned,
        loaded,
        has_loader,
        ns,
        nbytes,
    ),
    tokens_st,
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from(NAMESPACES),
    st.integers(1, 40),
)


def make_entry(spec) -> Entry:
    tokens, trimmable, pinned, loaded, has_loader, ns, nbytes = spec
    loader = (lambda t=tokens, b=nbytes: (list(t), b)) if (has_loader or not loaded) else None
    return Entry(
        tokens=tokens,
        state=list(tokens) if loaded else None,
        nbytes=nbytes,
        trimmable=trimmable,
        pinned=pinned and ns is None,
        source="snapshot" if loader else "request",
        loader=loader,
        namespace=ns,
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(entry_st, max_size=14),
    queries=st.lists(
        st.tuples(tokens_st, st.sampled_from(("", "tenant-a/", "tenant-b/"))),
        min_size=1,
        max_size=10,
    ),
)
def test_the_trie_lookup_equals_a_scan_over_every_entry(specs, queries):
    cache = list_cache()
    for spec in specs:
        cache.add(make_entry(spec))
    for tokens, ns in queries:
        assert_same_as_reference(cache, tokens, ns)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(entry_st, min_size=1, max_size=14),
    ops=st.lists(
        st.tuples(
            st.sampled_from(("discard", "fetch", "add-small-budget", "drop-requests")),
            st.integers(0, 13),
            tokens_st,
        ),
        max_size=12,
    ),
    queries=st.lists(
        st.tuples(tokens_st, st.sampled_from(("", "tenant-a/"))), min_size=1, max_size=8
    ),
)
def test_the_trie_stays_equal_to_the_scan_through_discards_loads_unloads_and_evictions(
    specs, ops, queries
):
    cache = list_cache(max_bytes=60)
    for spec in specs:
        cache.add(make_entry(spec))
    for op, i, tokens in ops:
        entries = cache.entries
        if op == "discard" and entries:
            cache.discard(entries[i % len(entries)])
        elif op == "fetch":
            # may load a lazy entry and unload others for the budget
            cache.fetch(tokens, "tenant-a/")
        elif op == "add-small-budget":
            # evicts by LRU
            cache.add(make_entry((tokens, True, False, True, False, "tenant-a/", 30)))
        elif op == "drop-requests":
            cache.drop_request_prefixes()
        for q, ns in queries:
            assert_same_as_reference(cache, q, ns)


def test_edges_split_and_merge_back_as_entries_come_and_go():
    trie = TokenTrie()
    long = Entry(
        tokens=(1, 2, 3, 4, 5), state=[1], nbytes=1, trimmable=False, pinned=True, source="snapshot"
    )
    short = Entry(
        tokens=(1, 2), state=[1], nbytes=1, trimmable=False, pinned=True, source="snapshot"
    )
    trie.insert(long)
    assert trie.best((1, 2, 3, 4, 5, 6)).usable == 5
    trie.insert(short)  # splits the edge (1,2,3,4,5) at 2
    split = trie._root.children[1]
    assert split.edge == (1, 2) and split.entry is short and split.children[3].edge == (3, 4, 5)
    assert trie.best((1, 2, 3, 9)).entry is short
    trie.remove(short)  # merges it back: one edge, no empty node left behind
    assert trie._root.children[1].edge == (1, 2, 3, 4, 5) and trie._root.children[1].entry is long
    assert trie.best((1, 2, 3, 9)) is None and trie.best((1, 2, 3, 4, 5, 0)).entry is long
    trie.remove(long)
    assert not trie._root.children and len(trie) == 0


def test_a_trie_walks_only_the_requests_path():
    """Entries under other branches are never visited: a lookup over 2,000 disjoint entries
    touches only the nodes the request's tokens pass through."""
    trie = TokenTrie()
    for i in range(2000):
        trie.insert(
            Entry(
                tokens=(i, *range(10_000, 10_050)),
                state=[1],
                nbytes=1,
                trimmable=True,
                pinned=False,
                source="request",
            )
        )
    path, partial, matched = trie._walk((7, *range(10_000, 10_020), 99))
    assert [d for _, d in path] == [0] and partial is not None and matched == 21
    best = trie.best((7, *range(10_000, 10_020), 99))
    assert best.usable == 21 and best.entry.tokens[0] == 7


def test_an_unload_moves_the_tie_to_the_entry_still_in_memory():
    cache = list_cache(max_bytes=50)
    lazy = Entry(
        tokens=(1, 2, 3, 4),
        state=None,
        nbytes=40,
        trimmable=True,
        pinned=True,
        source="snapshot",
        loader=lambda: ([1, 2, 3, 4], 40),
    )
    warm = Entry(
        tokens=(1, 2, 3, 5),
        state=[1, 2, 3, 5],
        nbytes=10,
        trimmable=True,
        pinned=True,
        source="snapshot",
        resident=True,
    )
    cache.add(lazy)
    cache.add(warm)
    assert cache.lookup([1, 2, 3, 9]).entry is warm  # same tokens saved: the loaded one
    cache.load(lazy)
    cache.discard(warm)
    assert cache.lookup([1, 2, 3, 9]).entry is lazy and lazy.loaded


def test_an_entry_unloaded_for_the_budget_loses_the_tie_to_one_loaded_since():
    """The trie's (pinned, loaded) counts follow loads and unloads, not the state at insertion."""
    cache = list_cache(max_bytes=50)
    a = Entry(
        tokens=(1, 2, 3, 4),
        state=[1, 2, 3, 4],
        nbytes=40,
        trimmable=True,
        pinned=True,
        source="snapshot",
        loader=lambda: ([1, 2, 3, 4], 40),
    )
    b = Entry(
        tokens=(1, 2, 3, 5),
        state=None,
        nbytes=40,
        trimmable=True,
        pinned=True,
        source="snapshot",
        loader=lambda: ([1, 2, 3, 5], 40),
    )
    cache.add(a)
    cache.add(b)
    assert cache.lookup([1, 2, 3, 9]).entry is a  # same tokens saved: the one in memory
    assert cache.fetch([1, 2, 3, 5, 9])[1] == 4  # loads b, which unloads a for the budget
    assert b.loaded and not a.loaded
    assert cache.lookup([1, 2, 3, 9]).entry is b


@settings(max_examples=300, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 2), max_size=12), max_size=4))
def test_common_prefix_length_equals_a_token_by_token_count(seqs):
    n = 0
    while seqs and all(len(s) > n for s in seqs) and all(s[n] == seqs[0][n] for s in seqs):
        n += 1
    assert common_prefix_length(seqs) == n
    assert common_prefix_length(tuple(s) for s in seqs) == n  # lists and tuples alike
