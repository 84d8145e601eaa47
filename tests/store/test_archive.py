"""`kvsnap pack` / `unpack`: a store as a plain tarball, verified and installed atomically; escapes
refused."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tarfile
from pathlib import Path

import pytest
from helpers.cli import run_kvsnap
from helpers.stores import build_store, flip_byte, no_stage_dirs, store_files, tree

from kvsnap.store.archive import ArchiveError, pack, unpack
from kvsnap.store.local import MANIFEST, Store
from kvsnap.store.shipping import ShipError


@pytest.fixture()
def existing(built, tmp_path) -> Path:
    """A store already in place (a copy of the built one) that a failed unpack must not touch."""
    dest = tmp_path / "dest"
    shutil.copytree(built, dest)
    return dest


# --- round trip ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["snaps.tar", "snaps.tar.gz"])
def test_pack_unpack_round_trip_verifies_and_keeps_modes(built, tmp_path, name):
    archive = tmp_path / name
    r = run_kvsnap("pack", built, "-o", archive)
    assert r.returncode == 0, r.stdout + r.stderr
    # the manifest, 2 records, their blocks
    assert f"packed {len(store_files(built))} file(s)" in r.stdout and len(store_files(built)) > 3
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    names = sorted(m.name for m in members)
    # manifest, records and their blocks only: no .lock, no temp files
    assert names == sorted(store_files(built))
    assert all(m.isreg() and m.mode == 0o600 and m.uid == 0 and m.uname == "" for m in members)

    r = run_kvsnap("unpack", archive, tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all verified" in r.stdout
    out = tmp_path / "out"
    assert store_files(out) == store_files(built)
    assert (
        stat.S_IMODE(out.stat().st_mode) == 0o700
        and stat.S_IMODE((out / "snapshots").stat().st_mode) == 0o700
    )
    assert all(
        stat.S_IMODE(p.stat().st_mode) == 0o600
        for p in [out / MANIFEST, *(out / "snapshots").iterdir(), *(out / "blocks").iterdir()]
    )
    assert stat.S_IMODE((out / "blocks").stat().st_mode) == 0o700
    assert run_kvsnap("verify", out).returncode == 0
    assert no_stage_dirs(tmp_path)


def test_unpack_into_an_existing_store_adds_and_keeps_other_files(built, lm, tmp_path):
    other = build_store(
        lm,
        tmp_path / "other",
        [
            {
                "name": "solo",
                "messages": [{"role": "system", "content": "You are the solo agent, alone."}],
            }
        ],
    )
    archive = pack(built, tmp_path / "snaps.tar").archive
    before = store_files(other)
    report = unpack(archive, other)
    after = store_files(other)

    def records(root):
        return set(json.loads((root / MANIFEST).read_text())["records"])

    # merged: both stores' records
    assert records(other) == records(built) | {r for r in json.loads(before[MANIFEST])["records"]}
    assert {k for k in before if k != MANIFEST} <= set(after)  # nothing removed
    assert set(after) == set(before) | set(store_files(built))
    assert sorted(report.files) == sorted(store_files(built))
    assert no_stage_dirs(tmp_path)


# --- refused input: error, store unchanged, nothing written outside -------------------------


def _tar_with(
    path: Path,
    built: Path,
    extra: list[tuple[tarfile.TarInfo, bytes | None]],
    with_store: bool = True,
) -> Path:
    with tarfile.open(path, "w") as tar:
        if with_store:
            for rel, data in store_files(built).items():
                info = tarfile.TarInfo(rel)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes = b"evil") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


KEY_NAME = "snapshots/" + "0" * 32 + ".safetensors"
BAD_ENTRIES = {
    "dotdot": ([_file("../evil.txt")], r"escapes the store folder"),
    "absolute": ([_file("/tmp/kvsnap-evil-abs.txt")], r"escapes the store folder"),
    "inner-dotdot": ([_file("snapshots/../../evil.txt")], r"escapes the store folder"),
    "symlink": (
        [_special(KEY_NAME, tarfile.SYMTYPE, "/etc/passwd")],
        r"is a symbolic link .*refusing it",
    ),
    "hardlink": (
        [_special(KEY_NAME, tarfile.LNKTYPE, "manifest.json")],
        r"is a hard link .*refusing it",
    ),
    "char-device": ([_special("snapshots/dev", tarfile.CHRTYPE)], r"is a device; refusing it"),
    "fifo": ([_special(KEY_NAME, tarfile.FIFOTYPE)], r"is a FIFO; refusing it"),
    "unknown-file": ([_file("notes.txt")], r"'notes.txt' is not a store file"),
    "lock-file": ([_file(".lock")], r"'.lock' is not a store file"),
    "folder": ([_special("snapshots/sub", tarfile.DIRTYPE)], r"not a store file"),
    "duplicate": ([_file(MANIFEST, b"{}")], r"appears twice"),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_unpack_refuses_entries_that_escape_or_are_not_store_files(built, existing, tmp_path, case):
    extra, message = BAD_ENTRIES[case]
    archive = _tar_with(tmp_path / f"{case}.tar", built, extra)
    before = tree(existing)
    with pytest.raises(ArchiveError, match=message):
        unpack(archive, existing)
    assert tree(existing) == before
    with pytest.raises(ArchiveError, match=message):
        unpack(archive, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert (
        not (tmp_path / "evil.txt").exists()
        and not (tmp_path.parent / "evil.txt").exists()
        and not Path("/tmp/kvsnap-evil-abs.txt").exists()
    )
    assert no_stage_dirs(tmp_path)


def test_unpack_escape_is_one_line_exit_2_on_the_cli(built, existing, tmp_path):
    archive = _tar_with(tmp_path / "evil.tar", built, [_file("../evil.txt")])
    before = tree(existing)
    r = run_kvsnap("unpack", archive, existing)
    assert r.returncode == 2 and r.stdout == ""
    assert (
        len(r.stderr.strip().splitlines()) == 1
        and "kvsnap unpack: error:" in r.stderr
        and "escapes the store folder" in r.stderr
    )
    assert tree(existing) == before


def test_unpack_refuses_a_snapshot_that_fails_its_checksum(built, existing, tmp_path):
    files = store_files(built)
    snap = next(k for k in files if k.startswith("snapshots/"))
    bad = bytearray(files[snap])
    bad[-1] ^= 1  # in the data (a record is mostly header): only the whole-file checksum can tell
    archive = tmp_path / "tampered.tar"
    with tarfile.open(archive, "w") as tar:
        for rel, data in files.items():
            i = tarfile.TarInfo(rel)
            data = bytes(bad) if rel == snap else data
            i.size = len(data)
            tar.addfile(i, io.BytesIO(data))
    before = tree(existing)
    with pytest.raises(
        ShipError, match=rf"{snap}: (checksum mismatch|tokens do not match).*nothing was changed"
    ):
        unpack(archive, existing)
    assert tree(existing) == before
    r = run_kvsnap("unpack", archive, tmp_path / "fresh")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "fresh").exists() and no_stage_dirs(tmp_path)


def test_unpack_refuses_a_bad_manifest(built, existing, tmp_path):
    archive = tmp_path / "badman.tar"
    with tarfile.open(archive, "w") as tar:
        info, data = _file(MANIFEST, b"{not json")
        tar.addfile(info, io.BytesIO(data))
    before = tree(existing)
    with pytest.raises(ShipError, match="manifest.json is not valid JSON"):
        unpack(archive, existing)
    assert tree(existing) == before


def test_truncated_or_foreign_archives_are_one_line_errors(built, existing, tmp_path):
    good = pack(built, tmp_path / "snaps.tar").archive
    cut = tmp_path / "cut.tar"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    before = tree(existing)
    for archive, message in (
        (cut, r"truncated or corrupt|checksum|nothing was changed"),
        (built / MANIFEST, r"not a readable tar archive"),
    ):
        r = run_kvsnap("unpack", archive, existing)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert __import__("re").search(message, r.stderr), r.stderr
    r = run_kvsnap("unpack", tmp_path / "nope.tar", existing)
    assert r.returncode == 2 and "no such archive file" in r.stderr
    assert tree(existing) == before and no_stage_dirs(tmp_path)
    empty = _tar_with(tmp_path / "empty.tar", built, [], with_store=False)
    with pytest.raises(ArchiveError, match="no store files inside"):
        unpack(empty, existing)


def test_unpack_refuses_a_destination_that_is_a_file_or_a_foreign_folder(built, tmp_path):
    archive = pack(built, tmp_path / "snaps.tar").archive
    (tmp_path / "afile").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "photo.jpg").write_text("x")
    for dest, message in (
        (tmp_path / "afile", "is a file, not a directory"),
        (tmp_path / "foreign", "not empty and not a kvsnap store"),
    ):
        r = run_kvsnap("unpack", archive, dest)
        assert r.returncode == 2 and message in r.stderr, r.stderr
    assert (tmp_path / "afile").read_text() == "x" and sorted(os.listdir(tmp_path / "foreign")) == [
        "photo.jpg"
    ]


def test_pack_refuses_a_bad_store_and_writes_nothing(built, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(built, bad)
    victim = Store.open(bad).snapshot_files()[0]
    flip_byte(victim)
    r = run_kvsnap("pack", bad, "-o", tmp_path / "out.tar")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert victim.name in r.stderr and "refusing to ship" in r.stderr
    assert not (tmp_path / "out.tar").exists() and not [
        p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")
    ]
    r = run_kvsnap("pack", built, "-o", built / "inside.tar")
    assert r.returncode == 2 and "inside the store" in r.stderr


def test_shipping_modules_do_not_import_mlx():
    import subprocess
    import sys

    code = (
        "import sys, kvsnap.store.archive, kvsnap.store.oci, kvsnap.commands.cli; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'transformers')]; "
        "assert not heavy, "
        "heavy"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# --- progress -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["snaps.tar", "snaps.tar.xz"])
def test_pack_and_unpack_report_every_byte_they_move(built, tmp_path, name):
    """The CLI's byte bar is fed by these callbacks: a total first, then chunks summing to it."""
    archive = tmp_path / name
    totals: list[int] = []
    chunks: list[int] = []
    packed = pack(built, archive, on_bytes=chunks.append, on_total=totals.append)
    assert totals == [packed.nbytes] and sum(chunks) == packed.nbytes
    assert len(chunks) >= len(packed.files) and min(chunks) > 0

    totals, chunks = [], []
    unpacked = unpack(archive, tmp_path / "out", on_bytes=chunks.append, on_total=totals.append)
    size = archive.stat().st_size
    assert totals == [size] and sum(chunks) == size and min(chunks) > 0
    assert unpacked.nbytes == packed.nbytes and store_files(tmp_path / "out") == store_files(built)
