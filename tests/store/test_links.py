"""Symbolic links in a store never make kvsnap remove what lies outside it.

A store folder (``conversations/``, ``blocks/``, ``checkpoints/``, ``snapshots/``) that is a
link is refused, with an error naming it, by every lister and remover: `kvsnap gc`, the
unused-for drop, the disk budget and ``DELETE /v1/cache/prefix``. A record file that is a
link is removed as a link: what it points to stays. Real stores, real links pointing outside
the store, a real `kvsnap serve` (kvsnap/store/fileio.py ``store_folder``)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from helpers.cli import run_kvsnap
from helpers.models import LONG_SYSTEM
from helpers.persist_servers import (
    SHARED_SYSTEM,
    Chat,
    copy_store,
    persist_status,
    serve,
    settle,
)

from kvsnap.errors import StoreError
from kvsnap.store.conversation_space import drop_unused, evict_to_budget, purge
from kvsnap.store.conversations import conversation_files
from kvsnap.store.local import Store

FOLDERS = ("conversations", "blocks", "checkpoints", "snapshots")


def tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def outside_folder(tmp_path: Path, root: Path, name: str) -> Path:
    """``root/name`` moved out of the store and linked back, next to files that are not the
    store's: a model's weights and the operator's agent record."""
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir(exist_ok=True)
    if (root / name).exists():
        shutil.move(root / name, outside)
    else:
        outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"the weights of someone's model")
    agent = next((root / "snapshots").glob("*.safetensors"), None) if name != "snapshots" else None
    if agent is not None:
        shutil.copy2(agent, outside / f"{'e' * 32}.safetensors")
    old = time.time() - 3600  # older than any cutoff: an "unused" drop would take them
    for p in outside.iterdir():
        os.utime(p, (old, old))
    (root / name).symlink_to(outside, target_is_directory=True)
    return outside


@pytest.mark.parametrize("name", FOLDERS)
def test_regression_a_linked_store_folder_is_refused_and_nothing_outside_is_removed(
    conv_store, tmp_path, name
):
    """`kvsnap gc` listed a linked blocks/ (or checkpoints/, snapshots/, conversations/)
    through the link and deleted every file there no record reached: a model's weights, the
    operator's agent record. Every remover now refuses the link, naming it."""
    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    outside = outside_folder(tmp_path, root, name)
    before = tree(outside)
    link = root / name
    for args in (("gc", root, "--yes"), ("gc", root, "--conversations-unused-for", "1s", "--yes")):
        r = run_kvsnap(*args)
        assert r.returncode != 0, r.stdout
        assert f"{link} is a symbolic link" in r.stderr and "real folder" in r.stderr, r.stderr
    store = Store.open(root)
    for remove in (
        lambda: purge(store),
        lambda: evict_to_budget(store, 1),
        lambda: drop_unused(store, 1, apply=True),
    ):
        with pytest.raises(StoreError, match="symbolic link"):
            remove()
    assert tree(outside) == before


def test_regression_delete_prefix_cache_never_removes_through_a_linked_conversations_folder(
    base, tmp_path
):
    """DELETE /v1/cache/prefix on a store whose conversations/ linked to a model's folder
    removed the model's weights (an "unreadable conversation record"). Now the server persists
    nothing through the link (its budget and DELETE could not remove what it wrote), says so in
    its log and status naming the link, serves on, and removes nothing there."""
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    outside = outside_folder(tmp_path, root, "conversations")
    before = tree(outside)
    server = serve(model, root, tmp, "linked", "--persist-requests")
    warning = f"{root / 'conversations'} is a symbolic link"
    try:
        persist = persist_status(server)
        assert persist["enabled"] is False and warning in persist["note"], persist
        for n in range(2):
            Chat(f"l{n}", LONG_SYSTEM).send(server.url)
        r = httpx.delete(f"{server.url}/v1/cache/prefix", timeout=60)
        assert r.status_code == 200, r.text
        assert not r.json()["persisted_removed"]
        log = server.log()
    finally:
        server.stop()
    assert tree(outside) == before
    assert warning in log, log[-3000:]


def test_a_record_file_that_is_a_link_goes_as_a_link_and_its_target_stays(conv_store, tmp_path):
    """A link in conversations/ named like a record (to an agent record elsewhere, to a model's
    weights): the purge and the budget remove the link, never what it points to."""
    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    weights = elsewhere / "model.safetensors"
    weights.write_bytes(b"the weights of someone's model")
    agent = elsewhere / "agent.safetensors"
    shutil.copy2(next((root / "snapshots").glob("*.safetensors")), agent)
    before = tree(elsewhere)
    store = Store.open(root)
    for target, remove in ((weights, purge), (agent, lambda s: evict_to_budget(s, 1))):
        link = root / "conversations" / f"{'f' * 32}.safetensors"
        link.symlink_to(target)
        remove(store)
        assert not link.is_symlink() and conversation_files(root) == []
        assert tree(elsewhere) == before


@pytest.mark.parametrize("name", FOLDERS)
def test_build_into_a_store_with_a_linked_folder_is_refused_before_any_prefill(
    base, tmp_path, name
):
    """`kvsnap build` wrote a new agent's record and blocks through a linked snapshots/ (or
    blocks/), then verify, ls, gc and serve refused the store it had just built. It refuses
    the link first, naming it, and writes nothing anywhere."""
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    outside = outside_folder(tmp_path, root, name)
    before, inside = tree(outside), {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    agents = tmp_path / "agents.json"
    agents.write_text(
        '[{"name": "new", "messages": [{"role": "system", "content": "A new agent, never built. '
        + "Check every path. " * 40
        + '"}]}]'
    )
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    r = run_kvsnap("build", agents, "--model", model, "--out", root, env=env)
    assert r.returncode != 0, r.stdout
    assert f"{root / name} is a symbolic link" in r.stderr and "real folder" in r.stderr, r.stderr
    assert tree(outside) == before
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == inside


def test_gc_never_claims_to_remove_a_fifo_or_a_folder_it_leaves(conv_store, tmp_path):
    """`kvsnap gc --yes` listed a FIFO named like a block, checkpoint or agent record as
    "removed" (and counted it) though it never removes one (not a file a writer made): the
    report said what did not happen. Such entries are neither listed nor removed."""
    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    odd = [root / name / f"{'d' * 32}.safetensors" for name in ("blocks", "snapshots")]
    odd.append(root / "checkpoints" / f"{'e' * 32}.safetensors")
    odd[-1].parent.mkdir(exist_ok=True)
    for path in odd[:2]:
        os.mkfifo(path)
    odd[-1].mkdir()
    orphan = root / "blocks" / f"{'c' * 32}.safetensors"  # a real file no record reaches
    shutil.copy2(next(p for p in (root / "blocks").glob("*.safetensors") if p not in odd), orphan)
    for args in (("gc", root), ("gc", root, "--yes")):
        r = run_kvsnap(*args)
        assert r.returncode == 0, r.stdout + r.stderr
        assert str(orphan) in r.stdout, r.stdout
        assert not any(str(p) in r.stdout for p in odd), r.stdout
        assert "1 file(s)" in r.stdout, r.stdout
    assert not orphan.exists() and all(os.path.lexists(p) for p in odd)


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_never_made(conv_store, tmp_path):
    """The writers' lock file `.lock` a dangling link: every writer (gc, build, the persister)
    opened it with O_CREAT and so created its target, a file outside the store. A link there
    is refused, naming it; nothing outside is made or touched."""
    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    lock = root / ".lock"
    lock.unlink(missing_ok=True)
    target = tmp_path / "elsewhere" / "not-the-store's"
    target.parent.mkdir()
    lock.symlink_to(target)
    r = run_kvsnap("gc", root, "--yes")
    assert r.returncode != 0, r.stdout
    assert f"{lock} is a symbolic link" in r.stderr and "delete it" in r.stderr, r.stderr
    assert not target.exists() and lock.is_symlink()
    lock.unlink()
    assert run_kvsnap("gc", root, "--yes").returncode == 0


@pytest.mark.parametrize("name", ["conversations", "blocks"])
def test_a_folder_swapped_for_a_link_while_serving_gets_nothing_written_through_it(
    base, tmp_path, name
):
    """The persister refused a linked store folder at start only: one swapped for a link while
    the server ran got every later record and block written through it, outside the store.
    Each write checks the folders under the lock: that turn is not persisted, the warning names
    the link, the server serves on."""
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    server = serve(model, root, tmp, f"swapped-{name}", "--persist-requests")
    try:
        Chat("w1", SHARED_SYSTEM).send(server.url)
        settle(server, root, 1)
        outside = outside_folder(tmp_path, root, name)
        before = tree(outside)
        chat = Chat("w2", SHARED_SYSTEM + " Another one.")
        chat.send(server.url)
        deadline = time.monotonic() + 60
        while persist_status(server)["failed"] < 1:
            assert time.monotonic() < deadline, persist_status(server)
            time.sleep(0.05)
        assert persist_status(server)["written"] == 1
        chat.send(server.url)  # serves on
        log = server.log()
    finally:
        server.stop()
    assert tree(outside) == before
    assert f"{root / name} is a symbolic link" in log, log[-3000:]
