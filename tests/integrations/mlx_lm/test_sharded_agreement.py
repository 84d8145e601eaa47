"""The entries a sharded mlx_lm.server's ranks agree to pin (``ShardedSource.agree``), in seconds:
the ranks run as threads of one process (``helpers.sharded.run_ranks``), each with its own
host's copy of one store, reading snapshots whole (this process's model is not sharded).

Every rank looks up the same prompts in lockstep, so every rank must pin the same entries: one
a rank cannot use, because its copy is damaged or because its host has no copy at all, is
skipped on every rank (a hit on one rank and a miss on another hangs or answers wrong). The
two-rank end-to-end runs are in test_sharded.py (slow)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.sharded import run_ranks
from helpers.stores import AGENTS, build_store

from kvsnap.integrations.common.warm_plan import StateSource
from kvsnap.integrations.mlx_lm.sharded import ShardedSource
from kvsnap.snapshot.shard_view import TENSOR, ShardView
from kvsnap.store.local import Store


class WholeReads(ShardedSource):
    """A rank's warm-up as a sharded server's, each snapshot read whole (the model is not)."""

    def load(self, store, info, identity, shapes):
        return StateSource.load(self, store, info, identity, shapes)


def _source(ranks) -> WholeReads:
    return WholeReads(ranks, ShardView(TENSOR, ranks.rank, ranks.size))


@pytest.mark.parametrize("on_rank_1", ["missing", "damaged"])
def test_an_entry_one_rank_lacks_or_cannot_read_is_used_by_no_rank(on_rank_1):
    """Two entries, both loaded on rank 0; rank 1's host has the second's file missing (no
    snapshot found there) or damaged (its read failed). Every rank uses the first alone."""
    a, b = (SimpleNamespace(path=Path(f"/store/snapshots/{n}.safetensors")) for n in "ab")
    reason = "blocks/k.safetensors: checksum mismatch"
    mine = {
        0: ([a, b], [None, None]),
        1: ([a, None], [None, None]) if on_rank_1 == "missing" else ([a, b], [None, reason]),
    }

    def rank(ranks):
        source = _source(ranks)
        return source.agree(*mine[ranks.rank]), source.refused

    (verdict0, refused0), (verdict1, refused1) = run_ranks(2, rank)
    assert verdict0 == verdict1 == [True, False]
    if on_rank_1 == "missing":
        expected = (1, "(none on this host)", "missing")
    else:
        expected = (1, str(b.path), reason)
    assert refused0 == refused1 == [expected]


@pytest.fixture(scope="module")
def built(demo_models, tmp_path_factory) -> Path:
    lm = demo_models.load("dense")
    return build_store(lm, tmp_path_factory.mktemp("sharded-agreement") / "store", AGENTS)


def _reviewer(root: Path):
    return next(i for i in Store.open(root, readonly=True).scan()[0] if i.name == "reviewer")


@pytest.mark.parametrize("gone", ["record", "block"])
def test_a_snapshot_missing_on_one_ranks_host_is_pinned_on_no_rank(
    built, demo_models, tmp_path, caplog, gone
):
    """Each rank's host holds its own copy of the store; rank 1's lacks the reviewer's record
    (its agent was never copied there) or one block of its chain. Both ranks pin the planner
    alone, and rank 0 says once which rank lacks which file."""
    from kvsnap.integrations.mlx_lm.cache import PinnedPromptCache
    from kvsnap.integrations.mlx_lm.warm import pin_store
    from kvsnap.key import DigestCache

    lm = demo_models.load("dense")
    identity = lm.identity(DigestCache())
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for host in hosts:
        shutil.copytree(built, host)
    reviewer = _reviewer(hosts[1])
    if gone == "record":
        missing = reviewer.path
    else:
        missing = hosts[1] / "blocks" / f"{reviewer.chain.blocks[-1][0]}.safetensors"
    missing.unlink()

    def rank(ranks):
        cache = PinnedPromptCache(4)
        store = Store.open(hosts[ranks.rank], readonly=True)
        source = _source(ranks)
        report = pin_store(cache, "m", store, identity, lm, source=source)
        return {tokens for _, tokens in cache.pinned_keys}, report, source.refused

    with caplog.at_level("WARNING", logger="kvsnap.mlx_lm"):
        (pinned0, report0, refused0), (pinned1, _, refused1) = run_ranks(2, rank)
    planner = next(i for i in Store.open(hosts[0], readonly=True).scan()[0] if i.name != "reviewer")
    store0 = Store.open(hosts[0], readonly=True)
    assert pinned0 == pinned1 == {tuple(store0.read_tokens(planner))}, report0
    assert report0.completed == 1, report0
    [refusal] = refused0
    assert refused0 == refused1 and refusal[0] == 1, refused0
    if gone == "record":
        assert refusal[1:] == ("(none on this host)", "missing"), refusal
    else:
        assert refusal[1] == str(reviewer.path) and str(missing) in refusal[2], refusal
    warnings = [r.getMessage() for r in caplog.records if "cannot use snapshot" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("[kvsnap] rank 1 cannot use"), warnings
