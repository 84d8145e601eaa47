"""The store on disk: atomic writes, permissions, refusing bad files, incremental builds, gc.

Real files, real tiny demo models (the ``dense`` one), the real build pipeline; no mocks
except the two seams the store has for this (``fault`` and ``fsync``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import struct
import threading
from pathlib import Path

import pytest
from helpers.local_store import (
    FAULTS,
    agents,
    build,
    flip_kv_byte,
    flip_layer_offset,
    header_bounds,
    stamps,
    tree,
    write_agents,
)

from kvsnap.errors import SnapshotError, StoreError
from kvsnap.snapshot.file import OutTensor
from kvsnap.snapshot.format import (
    MANIFEST,
    SNAPSHOT_REL_RE,
    relpath_of_file,
    snapshot_relpath,
)
from kvsnap.store.local import TMP_PREFIX, Store

KEY = "0123456789abcdef0123456789abcdef"
OTHER_KEY = "fedcba9876543210fedcba9876543210"


# --- helpers (the ones tests/commands/test_cli.py shares: tests/helpers/local_store.py) ------


def statuses(report) -> dict[str, str]:
    return {e.name: e.status for e in report.entries}


def keys(report) -> dict[str, str]:
    return {e.name: e.key for e in report.entries}


def raw_tensors() -> list[OutTensor]:
    data = struct.pack("<4i", 1, 2, 3, 4)
    return [OutTensor("tokens", "I32", (4,), memoryview(data))]


# --- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense(demo_models):
    return demo_models.load("dense")


@pytest.fixture(scope="module")
def dense_seed1(demo_models):
    """Same architecture and shapes as ``dense``, other weights and tokenizer."""
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    return load_model(make_demo_model(demo_models.root / "dense-seed1", DemoSpec(seed=1)))


@pytest.fixture(scope="module")
def base_store(dense, tmp_path_factory) -> Path:
    """Three good snapshots; tests copy it before changing anything."""
    d = tmp_path_factory.mktemp("base")
    report = build(
        dense, write_agents(d / "agents.json", agents(["alpha", "beta", "gamma"])), d / "store"
    )
    assert statuses(report) == {"alpha": "built", "beta": "built", "gamma": "built"}
    return d / "store"


@pytest.fixture()
def store_copy(base_store, tmp_path) -> Store:
    shutil.copytree(base_store, tmp_path / "store", symlinks=True)
    return Store.open(tmp_path / "store")


# --- 1. atomic writes -----------------------------------------------------------------


class FsyncSpy:
    """Records what each fsync hit: file or folder, its inode, and whether ``watch`` existed yet."""

    def __init__(self, watch: Path):
        self.watch = watch
        self.calls: list[tuple[str, int, bool]] = []

    def __call__(self, fd: int) -> None:
        st = os.fstat(fd)
        self.calls.append(
            ("dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino, self.watch.exists())
        )
        os.fsync(fd)


def test_put_fsyncs_the_temp_file_then_renames_then_fsyncs_the_directory(tmp_path):
    store = Store.open(tmp_path / "s", create=True)
    target = store.path_for(KEY)
    store.fsync = spy = FsyncSpy(target)
    with store.lock():
        assert store.put(KEY, raw_tensors(), {"a": "b"}) == target
    # the very file now at target was synced before it got its name, then the folder after
    assert spy.calls == [
        ("file", target.stat().st_ino, False),
        ("dir", store.snapshots_dir.stat().st_ino, True),
    ]
    assert store.temp_files() == [] and sorted(os.listdir(store.snapshots_dir)) == [target.name]


def test_manifest_updates_fsync_the_file_and_the_root(tmp_path):
    store = Store.open(tmp_path / "s", create=True)
    manifest = store.root / MANIFEST
    for n in (1, 2):  # creating it, then replacing it
        old_ino = manifest.stat().st_ino if manifest.exists() else None
        store.fsync = spy = FsyncSpy(manifest)
        store.update_record(
            f"r{n}", lambda r: {"entries": [{"name": "a", "file": snapshot_relpath(KEY)}]}
        )
        new_ino = manifest.stat().st_ino
        assert new_ino != old_ino
        assert spy.calls == [("file", new_ino, n == 2), ("dir", store.root.stat().st_ino, True)]
        assert sorted(json.loads(manifest.read_text())["records"]) == [
            f"r{i}" for i in range(1, n + 1)
        ]
        assert store.temp_files() == []


def test_files_are_0600_and_folders_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = Store.open(tmp_path / "s", create=True)
        with store.lock():
            store.put(KEY, raw_tensors(), {})
        store.update_record("r", lambda r: {"entries": []})
    finally:
        os.umask(old)
    for folder in (store.root, store.snapshots_dir):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for f in (store.path_for(KEY), store.root / MANIFEST, store.root / ".lock"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_a_built_store_has_private_modes_and_no_temp_files(base_store):
    for dirpath, _dirnames, filenames in os.walk(base_store):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
        for name in filenames:
            assert not name.startswith(TMP_PREFIX)
            assert stat.S_IMODE(os.stat(os.path.join(dirpath, name)).st_mode) == 0o600, name


def enospc_at(wanted: str):
    def fault(point: str) -> None:
        if point == wanted:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return fault


@pytest.mark.parametrize("point", ["mid-write", "after-write", "after-fsync"])
def test_put_hitting_enospc_leaves_the_store_exactly_as_before(store_copy, point):
    before = tree(store_copy.root)
    existing = store_copy.snapshot_files()[0].name.removesuffix(".safetensors")
    store = Store.open(store_copy.root, fault=enospc_at(point))
    for key in (KEY, existing):  # a new snapshot, and a replacement of an existing one
        with pytest.raises(
            StoreError,
            match=r"cannot write snapshot .*No space left on device.*the store is unchanged; free "
            r"some disk space",
        ):
            with store.lock():
                store.put(key, raw_tensors(), {})
    assert tree(store_copy.root) == before


def test_manifest_update_hitting_enospc_keeps_the_manifest_bytes(store_copy):
    before = tree(store_copy.root)
    store = Store.open(store_copy.root, fault=enospc_at("after-write"))
    with pytest.raises(
        StoreError,
        match=r"cannot write .*manifest.json .*No space left on device"
        r".*previous manifest is intact",
    ):
        store.update_record("r", lambda r: {"entries": []})
    assert tree(store_copy.root) == before


def test_a_build_on_a_full_disk_fails_every_entry_and_changes_nothing(dense, store_copy, tmp_path):
    agents_file = write_agents(tmp_path / "agents.json", agents(["alpha", "beta", "gamma"]))
    before = tree(store_copy.root)
    report = build(dense, agents_file, store_copy.root, fault=enospc_at("after-write"), force=True)
    assert (
        statuses(report) == {"alpha": "failed", "beta": "failed", "gamma": "failed"}
        and not report.ok
    )
    assert all("No space left on device" in e.error for e in report.entries)
    assert tree(store_copy.root) == before


@pytest.mark.parametrize(
    "bad_key",
    [
        "../../../etc/passwd",
        "../" + KEY,
        KEY + "/../x",
        KEY.upper(),
        KEY[:-1],
        KEY + "0",
        KEY + "\n",
        "\n" + KEY,
        "",
        "/" + KEY[1:],
        KEY[:16] + "." + KEY[17:],
        None,
    ],
)
def test_path_for_refuses_anything_but_32_lowercase_hex(tmp_path, bad_key):
    store = Store.open(tmp_path / "s", create=True)
    with pytest.raises(StoreError, match="not 32 lowercase hex digits"):
        store.path_for(bad_key)
    assert store.path_for(KEY).parent == store.snapshots_dir


# --- 2. bad files are refused by name, neighbours untouched ----------------------------


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_bad_file_is_refused_by_verify_and_load_and_nothing_else_is_touched(
    store_copy, tmp_path, fault
):
    files = store_copy.snapshot_files()
    victim, donor = files[0], files[1]
    indexed = store_copy.inspect(victim)  # what a server indexed before the file went bad
    before = {p: p.read_bytes() for p in files if p != victim}
    original = victim.read_bytes()
    damage, reason = FAULTS[fault]
    damage(victim, donor=donor, outside=tmp_path / "outside")

    with pytest.raises(SnapshotError) as exc:
        store_copy.verify_file(victim)
    assert exc.value.path == str(victim) and str(victim) in str(exc.value)
    assert re.search(reason, exc.value.reason), exc.value.reason
    with pytest.raises(SnapshotError) as exc:
        store_copy.load_arrays(indexed)
    assert exc.value.path == str(victim) and re.search(reason, exc.value.reason), exc.value.reason

    good, bad = store_copy.scan()  # header-only: may or may not see it, must not raise
    assert {i.path for i in good} >= set(before)
    for p, data in before.items():
        assert p.read_bytes() == data
        store_copy.verify_file(p)
    if fault == "symlink-outside-store":
        assert (tmp_path / "outside" / victim.name).read_bytes() == original


def test_regression_one_flipped_digit_in_a_layer_offset_is_caught(store_copy):
    """v1 checksummed only the data: this header edit verified and loaded a KVCache whose offset
    lied."""
    victim = store_copy.snapshot_files()[0]
    flip_layer_offset(victim)
    header_json = victim.read_bytes()[slice(*header_bounds(victim.read_bytes()))]
    assert json.loads(header_json)  # still a perfectly valid header
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        store_copy.verify_file(victim)


def test_load_arrays_refuses_a_file_swapped_after_indexing(store_copy):
    """A scan indexed A; A's file now holds B's valid bytes under A's name."""
    a, b = store_copy.snapshot_files()[:2]
    info_a = store_copy.inspect(a)
    shutil.copyfile(b, a)
    with pytest.raises(SnapshotError, match="file name does not match its key"):
        store_copy.load_arrays(info_a)


def test_load_arrays_returns_the_arrays_of_a_good_file(dense, store_copy):
    info = store_copy.inspect(store_copy.snapshot_files()[0])
    arrays = store_copy.load_arrays(info, expected=dense.identity())
    assert arrays["tokens"].size == info.n_tokens
    assert store_copy.read_tokens(info) == arrays["tokens"].tolist()


def test_a_snapshot_of_another_model_is_refused_when_the_model_is_given(
    dense, dense_seed1, store_copy, tmp_path
):
    agents_file = write_agents(tmp_path / "agents.json", agents(["alpha"]))
    report = build(dense_seed1, agents_file, store_copy.root)
    foreign = store_copy.path_for(report.entries[0].key)
    before = tree(store_copy.root)
    mine = dense.identity()
    store_copy.verify_file(foreign)  # well-formed on its own
    with pytest.raises(
        SnapshotError, match=r"built for another model or KV setting \(differs in: .*weights"
    ) as exc:
        store_copy.verify_file(foreign, mine)
    assert exc.value.path == str(foreign)
    with pytest.raises(SnapshotError, match="built for another model"):
        store_copy.load_arrays(store_copy.inspect(foreign), expected=mine)
    good, bad = store_copy.scan(mine)
    assert [p.path for p in bad] == [foreign] and len(good) == 3
    assert tree(store_copy.root) == before


# --- 4. incremental builds ----------------------------------------------------------------


class Recorder:
    """A fault hook that only records which write-path points ran."""

    def __init__(self):
        self.points: list[str] = []

    def __call__(self, point: str) -> None:
        self.points.append(point)


@pytest.fixture()
def fresh(dense, tmp_path):
    """A store built from an agents file this test may edit."""
    agents_file = write_agents(tmp_path / "agents.json", agents(["alpha", "beta", "gamma"]))
    report = build(dense, agents_file, tmp_path / "store")
    return agents_file, Store.open(tmp_path / "store"), report


def test_an_unchanged_rebuild_prefills_nothing_and_rewrites_no_snapshot(dense, fresh, monkeypatch):
    import kvsnap.build.pipeline

    agents_file, store, first = fresh
    before = stamps(store)
    manifest_before = (store.root / MANIFEST).read_bytes()
    prefills = []
    real_prefill = kvsnap.build.pipeline.prefill_in_blocks
    monkeypatch.setattr(
        kvsnap.build.pipeline,
        "prefill_in_blocks",
        lambda lm, tokens, *a, **k: (
            prefills.append(len(tokens)) or real_prefill(lm, tokens, *a, **k)
        ),
    )
    rec = Recorder()
    report = build(dense, agents_file, store.root, fault=rec)
    assert (
        statuses(report) == {"alpha": "reused", "beta": "reused", "gamma": "reused"} and report.ok
    )
    assert keys(report) == keys(first)
    # a marker only: no prefill, no snapshot write, no manifest write
    assert prefills == [] and rec.points == ["model-loaded"]
    assert stamps(store) == before
    assert (store.root / MANIFEST).read_bytes() == manifest_before


def test_editing_one_system_prompt_rebuilds_only_that_entry(dense, fresh):
    agents_file, store, first = fresh
    before = stamps(store)
    entries = agents(["alpha", "beta", "gamma"])
    entries[1]["messages"][0]["content"] += " Also review the docs."
    write_agents(agents_file, entries)
    report = build(dense, agents_file, store.root)
    assert statuses(report) == {"alpha": "reused", "beta": "built", "gamma": "reused"}
    assert keys(report)["beta"] != keys(first)["beta"]
    after = stamps(store)
    for name in ("alpha", "gamma"):
        f = f"{keys(first)[name]}.safetensors"
        assert after[f] == before[f]
    record = next(iter(store.read_manifest()["records"].values()))
    assert {e["name"]: e["key"] for e in record["entries"]} == keys(report)


def test_kv_bits_8_rebuilds_everything_under_new_keys(demo_models, fresh):
    agents_file, store, first = fresh
    before = stamps(store)
    report = build(demo_models.load("dense", kv_bits=8), agents_file, store.root)
    assert set(statuses(report).values()) == {"built"}
    assert not set(keys(report).values()) & set(keys(first).values())
    after = stamps(store)
    assert {k: after[k] for k in before} == before  # the fp snapshots are still there, untouched


def test_another_model_of_the_same_architecture_rebuilds_everything(dense_seed1, fresh):
    agents_file, store, first = fresh
    report = build(dense_seed1, agents_file, store.root)
    assert set(statuses(report).values()) == {"built"}
    assert not set(keys(report).values()) & set(keys(first).values())
    assert len(store.read_manifest()["records"]) == 2


def test_force_rewrites_every_snapshot(dense, fresh):
    agents_file, store, first = fresh
    before = stamps(store)
    report = build(dense, agents_file, store.root, force=True)
    assert set(statuses(report).values()) == {"built"} and keys(report) == keys(first)
    after = stamps(store)
    assert after.keys() == before.keys()
    assert all(after[f][0] != before[f][0] for f in before)  # new inodes: replaced by rename
    for p in store.snapshot_files():
        store.verify_file(p, dense.identity())


def test_a_bad_snapshot_under_the_right_name_is_rebuilt(dense, fresh):
    agents_file, store, first = fresh
    victim = store.path_for(keys(first)["beta"])
    flip_kv_byte(victim)
    report = build(dense, agents_file, store.root)
    assert statuses(report) == {"alpha": "reused", "beta": "built", "gamma": "reused"}
    assert any("replacing a bad snapshot" in w for w in report.entries[1].warnings)
    store.verify_file(victim, dense.identity())


def test_a_build_refuses_a_damaged_manifest_before_prefilling(dense, fresh):
    agents_file, store, _ = fresh
    (store.root / MANIFEST).write_text("{ not json")
    before = tree(store.root)
    with pytest.raises(StoreError, match="manifest.json cannot be read"):
        build(dense, agents_file, store.root, force=True)
    assert tree(store.root) == before


# --- gc -----------------------------------------------------------------------------------


def test_gc_removes_a_dropped_entry_but_never_one_another_model_uses(dense, dense_seed1, tmp_path):
    from kvsnap.snapshot.blocks import BlockSettings

    # blocks on a fixed grid: short prompts share whole 4-token blocks
    small = BlockSettings(4, 1024)
    agents_file = write_agents(tmp_path / "agents.json", agents(["alpha", "beta", "gamma"]))
    first = build(dense, agents_file, tmp_path / "store", blocks=small)
    store = Store.open(tmp_path / "store")
    # a second record in the same store
    other = build(dense_seed1, agents_file, store.root, blocks=small)
    write_agents(agents_file, agents(["alpha", "beta"]))  # gamma leaves the agents file
    report = build(dense, agents_file, store.root, blocks=small)
    assert statuses(report) == {"alpha": "reused", "beta": "reused"}
    from kvsnap.store.paths import chain_relpaths

    gone = store.path_for(keys(first)["gamma"])
    staying = [
        store.inspect(store.path_for(k)) for k in [*keys(report).values(), *keys(other).values()]
    ]
    shared = {rel for info in staying for rel in chain_relpaths(info)}
    own = [store.root / rel for rel in chain_relpaths(store.inspect(gone)) if rel not in shared]
    # gamma has blocks of its own and shares its preamble's
    assert own and set(chain_relpaths(store.inspect(gone))) & shared
    before = tree(store.root)

    doomed, freed = store.gc(apply=False)
    assert sorted(doomed) == sorted([gone, *own]) and freed == sum(p.stat().st_size for p in doomed)
    assert tree(store.root) == before  # a dry run deletes nothing

    doomed, _ = store.gc(apply=True)
    assert sorted(doomed) == sorted([gone, *own]) and not gone.exists()
    kept = store.path_for(keys(other)["gamma"])  # the other model's record still lists it
    # never a shared block
    assert kept.exists() and all((store.root / rel).exists() for rel in shared)
    for p in store.snapshot_files():
        store.verify_file(p)
    assert store.gc(apply=True) == ([], 0)


def test_gc_removes_leftover_temp_files_but_not_folders(store_copy):
    leftovers = [
        store_copy.root / f"{TMP_PREFIX}manifest.json.x1",
        store_copy.snapshots_dir / f"{TMP_PREFIX}{KEY}.safetensors.x2",
    ]
    for p in leftovers:
        p.write_bytes(b"half a file")
    folder = store_copy.snapshots_dir / f"{TMP_PREFIX}folder"
    folder.mkdir()
    live = tree(store_copy.root)
    doomed, _ = store_copy.gc(apply=False)
    assert sorted(doomed) == sorted(leftovers)
    store_copy.gc(apply=True)
    assert not any(p.exists() for p in leftovers) and folder.is_dir()
    after = tree(store_copy.root)
    assert {k: v for k, v in live.items() if k in after} == after and len(after) == len(live) - 2


def test_gc_without_a_manifest_keeps_every_snapshot(store_copy):
    (store_copy.root / MANIFEST).unlink()
    (store_copy.snapshots_dir / f"{TMP_PREFIX}x").write_bytes(b"junk")
    doomed, _ = store_copy.gc(apply=True)
    assert [p.name for p in doomed] == [f"{TMP_PREFIX}x"]
    assert len(store_copy.snapshot_files()) == 3


def test_gc_with_a_damaged_manifest_deletes_nothing(store_copy):
    (store_copy.root / MANIFEST).write_text('{"records": 7}')
    (store_copy.snapshots_dir / f"{TMP_PREFIX}x").write_bytes(b"junk")
    before = tree(store_copy.root)
    with pytest.raises(StoreError, match="not a kvsnap manifest"):
        store_copy.gc(apply=True)
    assert tree(store_copy.root) == before


def test_gc_removes_an_unused_symlink_but_not_its_target(store_copy, tmp_path):
    target = tmp_path / "precious.safetensors"
    target.write_bytes(b"not yours")
    link = store_copy.snapshots_dir / f"{KEY}.safetensors"
    link.symlink_to(target)
    doomed, _ = store_copy.gc(apply=True)
    assert doomed == [link] and not link.is_symlink() and target.read_bytes() == b"not yours"


def test_regression_gc_during_a_build_cannot_delete_a_snapshot_before_its_record(dense, tmp_path):
    """The file and its manifest record are written under one lock hold, so gc sees both or
    neither."""
    agents_file = write_agents(tmp_path / "agents.json", agents(["alpha", "beta"]))
    root = tmp_path / "store"
    # a manifest exists
    Store.open(root, create=True).update_record("unrelated", lambda r: {"entries": []})
    results, threads = [], []

    def gc_as_soon_as_a_file_lands(point: str) -> None:
        if point == "after-rename":
            t = threading.Thread(target=lambda: results.append(Store.open(root).gc(apply=True)))
            t.start()
            threads.append(t)

    report = build(dense, agents_file, root, fault=gc_as_soon_as_a_file_lands)
    for t in threads:
        t.join(timeout=30)
    assert len(threads) == 2 and all(not t.is_alive() for t in threads)
    assert statuses(report) == {"alpha": "built", "beta": "built"}
    assert all(doomed == [] for doomed, _ in results)
    store = Store.open(root)
    for e in report.entries:
        store.verify_file(store.path_for(e.key), dense.identity())


# --- 5. relative paths, movable store -------------------------------------------------------


def test_manifest_paths_are_relative_and_a_moved_store_still_verifies(
    dense, dense_seed1, fresh, tmp_path
):
    agents_file, store, _ = fresh
    build(dense_seed1, agents_file, store.root)
    manifest = store.read_manifest()
    files = [e["file"] for r in manifest["records"].values() for e in r["entries"]]
    assert len(files) == 6
    for f in files:
        assert not os.path.isabs(f) and ".." not in Path(f).parts and SNAPSHOT_REL_RE.fullmatch(f)
    assert str(store.root) not in (store.root / MANIFEST).read_text()

    moved = tmp_path / "elsewhere" / "deploy" / "snaps"
    moved.parent.mkdir(parents=True)
    os.rename(store.root, moved)
    there = Store.open(moved)
    good, bad = there.scan()
    assert len(good) == 6 and bad == []
    assert {relpath_of_file(p.name) for p in there.snapshot_files()} == there.referenced()
    for p in there.snapshot_files():
        there.verify_file(p)
    assert statuses(build(dense, agents_file, moved)) == {
        "alpha": "reused",
        "beta": "reused",
        "gamma": "reused",
    }
