"""A running build's records that the manifest does not list yet stay through gc while the build
holds its pending file, and go (with the file) once the build is dead; a held file gc cannot
trust stops gc before it deletes anything.

Real tiny model and store; the build that holds a pending file is a real second process
(``flock`` is what says it is alive), killed with SIGKILL as a crash would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.local_store import agents, build, tree, write_agents

from kvsnap.errors import StoreError
from kvsnap.snapshot.format import snapshot_relpath
from kvsnap.store.local import Store
from kvsnap.store.pending import PENDING_PREFIX, PendingRecords, held_references, pending_files

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvsnap.store.pending import PendingRecords
    pending = PendingRecords(Path(sys.argv[1]))
    for rel in sys.argv[2:]:
        pending.add(rel)
    print(pending.path, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture()
def unlisted(lm, tmp_path) -> tuple[Store, str]:
    """A store whose record 'beta' was committed but is not in the manifest (as a build leaves
    it between its commit and its next manifest write)."""
    agents_file = write_agents(tmp_path / "agents.json", agents(["alpha", "beta"]))
    report = build(lm, agents_file, tmp_path / "store")
    store = Store.open(tmp_path / "store")
    (rid,) = store.read_manifest()["records"]
    store.update_record(
        rid, lambda r: {**r, "entries": [e for e in r["entries"] if e["name"] != "beta"]}
    )
    beta = {e.name: e.key for e in report.entries}["beta"]
    return store, snapshot_relpath(beta)


def _hold(root: Path, *relpaths: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), *relpaths],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_gc_keeps_a_running_builds_unlisted_record_and_removes_it_once_the_build_died(unlisted):
    store, beta = unlisted
    proc, path = _hold(store.root, beta)
    try:
        assert path.parent == store.root and path.name.startswith(PENDING_PREFIX)
        assert store.gc(apply=True) == ([], 0)  # held: beta's record stays, so do its blocks
        assert (store.root / beta).exists() and path.exists()
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: nothing removes the pending file
        proc.wait(30)
    assert path.exists()
    doomed, _ = store.gc(apply=True)
    assert store.root / beta in doomed and path in doomed
    assert not (store.root / beta).exists() and pending_files(store.root) == []
    assert store.gc(apply=False) == ([], 0)


def test_a_pending_file_is_removed_while_held_so_gc_never_finds_it_unheld(tmp_path):
    pending = PendingRecords(tmp_path)
    assert pending_files(tmp_path) == []  # made on the first record only
    pending.add(snapshot_relpath("a" * 32))
    assert held_references(tmp_path) == ({snapshot_relpath("a" * 32)}, [])
    pending.clear()
    assert held_references(tmp_path) == (set(), [])
    pending.close()
    assert pending_files(tmp_path) == []
    with pytest.raises(ValueError, match="not a store record path"):
        pending.add("../../etc/passwd")


@pytest.mark.parametrize("content", [b"../../etc/passwd\n", b"\xff\xfe\n"], ids=["path", "bytes"])
def test_a_held_pending_file_listing_garbage_stops_gc_before_it_deletes_anything(unlisted, content):
    store, beta = unlisted
    proc, path = _hold(store.root, beta)
    try:
        with open(path, "ab") as f:
            f.write(content)
        before = tree(store.root)
        with pytest.raises(
            StoreError, match=r"pending file of a running build.*nothing was removed"
        ):
            store.gc(apply=True)
        assert tree(store.root) == before
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def test_a_link_named_like_a_pending_file_is_removed_as_a_link_and_a_fifo_is_left(
    unlisted, tmp_path
):
    store, beta = unlisted
    target = tmp_path / "elsewhere"
    target.write_text("not yours")
    link, fifo = store.root / f"{PENDING_PREFIX}link", store.root / f"{PENDING_PREFIX}fifo"
    link.symlink_to(target)
    os.mkfifo(fifo)
    doomed, _ = store.gc(apply=True)
    assert link in doomed and fifo not in doomed and store.root / beta in doomed
    assert not link.is_symlink() and target.read_text() == "not yours" and fifo.exists()
