"""What the ranks of a sharded model agree on: one writer per store folder (``elect_writers``),
with the ranks run as threads of one process (``helpers.sharded.run_ranks``).

Every rank of a sharded mlx_lm.server prefills a warm prompt its store lacks; the logical state
is written once per folder. Two ranks writing one folder (one host, or a network share) race
on the same paths; a host whose folder no rank writes keeps missing the entry."""

from __future__ import annotations

from pathlib import Path

from helpers.sharded import run_ranks

from kvsnap.runtime.sharding.agreement import PROBE_PREFIX, elect_writers


def _elect(folders: list[Path | None], writable: list[bool]) -> list[bool]:
    return run_ranks(
        len(folders), lambda ranks: elect_writers(ranks, folders[ranks.rank], writable[ranks.rank])
    )


def test_ranks_sharing_one_folder_elect_rank_0_alone_and_leave_no_probe(tmp_path):
    shared = tmp_path / "store"
    shared.mkdir()
    assert _elect([shared, shared], [True, True]) == [True, False]
    assert _elect([shared] * 3, [True] * 3) == [True, False, False]
    assert not list(shared.iterdir())


def test_ranks_on_hosts_of_their_own_each_write_their_folder(tmp_path):
    folders = [tmp_path / "host0", tmp_path / "host1"]
    for folder in folders:
        folder.mkdir()
    assert _elect(folders, [True, True]) == [True, True]
    assert not [p for folder in folders for p in folder.glob(f"{PROBE_PREFIX}*")]


def test_the_lowest_rank_that_can_write_a_shared_folder_writes_it(tmp_path):
    """Rank 0 cannot write (a read-only mount, or no --warm-prompts to write back on its host):
    rank 1 writes the folder, rank 2 beside it does not."""
    shared = tmp_path / "store"
    shared.mkdir()
    assert _elect([shared] * 3, [False, True, True]) == [False, True, False]
    assert _elect([None, shared, shared], [True, True, True]) == [False, True, False]
    assert _elect([shared, shared], [False, False]) == [False, False]
