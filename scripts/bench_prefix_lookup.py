"""Prefix lookup time at 10, 100 and 1,000 entries: the token trie against the scan it replaced.

Entries: a shared 12-token template header, then random tokens (vocabulary 32,000), 100 to
2,000 tokens each, a third of them exact-only (SSM state), some in a request namespace.
Queries (the same set at every size, built from the first 10 entries): a follow-up turn on
an entry, a prompt leaving an entry half-way, a prompt equal to an entry, and a miss after
the header. Each size reports the median of 21 rounds of the mean time per lookup.

    python scripts/bench_prefix_lookup.py            # prints a table and the 1000/10 ratio
    python scripts/bench_prefix_lookup.py --rounds 3 # quicker
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.prefix_scan import scan_lookup  # noqa: E402

from kvsnap.runtime.cache.prefix import Entry, PrefixCache  # noqa: E402

SIZES = (10, 100, 1000)
HEADER = tuple(range(1, 13))  # every agent's prompt starts with the same chat-template tokens
VOCAB = 32_000


def make_entries(n: int, rng: random.Random) -> list[Entry]:
    entries = []
    for i in range(n):
        length = rng.randint(100, 2000)
        tokens = HEADER + tuple(rng.randrange(VOCAB) for _ in range(length - len(HEADER)))
        namespace = None if i % 4 else f"tenant-{i % 3}/"
        entries.append(
            Entry(
                tokens=tokens,
                state=[i],
                nbytes=1,
                trimmable=i % 3 != 0,
                pinned=namespace is None,
                source="snapshot",
                namespace=namespace,
                resident=True,
            )
        )
    return entries


def make_queries(entries: list[Entry], rng: random.Random) -> list[tuple[tuple[int, ...], str]]:
    queries = []
    for e in entries[:10]:
        ns = e.namespace or ""
        queries.append((e.tokens + tuple(rng.randrange(VOCAB) for _ in range(30)), ns))  # next turn
        half = len(e.tokens) // 2
        # leaves it half-way
        queries.append((e.tokens[:half] + tuple(rng.randrange(VOCAB) for _ in range(40)), ns))
        queries.append((e.tokens, ns))  # the entry itself
        # a miss after the header
        queries.append((HEADER + tuple(rng.randrange(VOCAB) for _ in range(len(e.tokens))), ns))
    return queries


def time_per_lookup(lookups: dict, queries, rounds: int) -> dict:
    """Per size, the median over ``rounds`` of the mean seconds per lookup. The sizes take
    turns within each round (after one untimed round), so load on the host and warm-up
    fall on all of them alike."""
    samples: dict = {n: [] for n in lookups}
    for r in range(rounds + 1):
        for n, lookup in lookups.items():
            t0 = time.perf_counter()
            for tokens, ns in queries:
                lookup(tokens, ns)
            if r:
                samples[n].append((time.perf_counter() - t0) / len(queries))
    return {n: statistics.median(v) for n, v in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds per size (default 21)")
    args = parser.parse_args(argv)
    rng = random.Random(16)
    pool = make_entries(max(SIZES), rng)
    queries = make_queries(pool, rng)
    print(f"{len(queries)} queries; entries of 100-2000 tokens; median of {args.rounds} rounds")
    print(f"{'entries':>8} {'trie µs':>10} {'scan µs':>10}")
    caches = {}
    for n in SIZES:
        cache = PrefixCache(max_bytes=10**12, copy_state=list, trim_state=lambda s, k: s)
        for e in pool[:n]:
            cache.add(e)
        for tokens, ns in queries:  # the trie answers as the scan does (tokens saved)
            m, ref = cache.lookup(tokens, ns), scan_lookup(pool[:n], tokens, ns)
            assert (m.n_cached if m else None) == (ref[0] if ref else None), (
                "trie and scan disagree"
            )
        caches[n] = cache
    trie_s = time_per_lookup({n: c.lookup for n, c in caches.items()}, queries, args.rounds)
    scan_s = time_per_lookup(
        {n: (lambda t, ns, es=pool[:n]: scan_lookup(es, t, ns)) for n in SIZES},
        queries,
        max(1, args.rounds // 3),
    )
    for n in SIZES:
        print(f"{n:>8} {trie_s[n] * 1e6:>10.1f} {scan_s[n] * 1e6:>10.1f}")
    ratio = trie_s[max(SIZES)] / trie_s[min(SIZES)]
    print(f"ratio 1000/10 (trie): {ratio:.2f} (goal <= 2)")
    return 0 if ratio <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
