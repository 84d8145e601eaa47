"""Shipped content is hostile -- installs merge and never shrink, never overwrite a good
file.

Real stores built with the tiny demo model, real tarballs, the real `gc` and `verify`.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
from helpers.cli import run_kvsnap
from helpers.stores import forged_copy, store_files

from kvsnap.store.archive import unpack
from kvsnap.store.local import MANIFEST, Store


@pytest.fixture(scope="module")
def model_dir(demo_models) -> Path:
    return demo_models.path("dense")


@pytest.fixture()
def store(built, tmp_path) -> Path:
    dest = tmp_path / "store"
    shutil.copytree(built, dest)
    return dest


def tarball(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def live_files(root: Path) -> dict[str, bytes]:
    return {k: v for k, v in store_files(root).items() if k != MANIFEST}


def test_regression_a_tiny_tarball_with_an_empty_record_cannot_erase_a_store(
    store, model_dir, tmp_path
):
    """Once: a 59-byte manifest naming an existing record with no entries replaced it; gc deleted
    15 files."""
    manifest = json.loads((store / MANIFEST).read_text())
    rid = next(iter(manifest["records"]))
    body = json.dumps({"format": manifest["format"], "records": {rid: {"entries": []}}}).encode()
    archive = tarball(tmp_path / "tiny.tar.gz", {MANIFEST: body})
    assert archive.stat().st_size < 200
    before = live_files(store)
    assert len(before) >= 3  # records and their blocks

    unpack(archive, store)
    assert json.loads((store / MANIFEST).read_text())["records"][rid] == manifest["records"][rid]
    gc = run_kvsnap("gc", store, "--yes")
    assert gc.returncode == 0 and "removed 0 file(s)" in gc.stdout, gc.stdout + gc.stderr
    assert live_files(store) == before
    v = run_kvsnap("verify", store, "--model", model_dir)
    assert (
        v.returncode == 0 and f"{len(Store.open(store).snapshot_files())} ok, 0 bad" in v.stdout
    ), v.stdout + v.stderr


def test_an_existing_record_only_gains_entries_from_a_shipped_one(store, tmp_path):
    """A shipped record with the same id adds the entries it lacks and keeps every one it has."""
    manifest = json.loads((store / MANIFEST).read_text())
    rid, record = next(iter(manifest["records"].items()))
    kept, other = record["entries"][0], record["entries"][1:]
    extra = {**kept, "name": "renamed-agent"}
    shipped = {
        "format": manifest["format"],
        "records": {rid: {**record, "entries": [extra], "model_path": "/elsewhere"}},
    }
    unpack(tarball(tmp_path / "one.tar.gz", {MANIFEST: json.dumps(shipped).encode()}), store)
    merged = json.loads((store / MANIFEST).read_text())["records"][rid]
    assert merged["entries"] == [kept, *other, extra]
    assert merged["model_path"] == record["model_path"]  # the store's own fields stay


def test_regression_unpack_never_overwrites_a_good_block_with_a_forged_one(store, tmp_path):
    """Block keys name content but do not hash it: shipped bytes under an existing name are
    reported, not installed."""
    from kvsnap.store.checking import check_part

    block = sorted((store / "blocks").iterdir())[0]
    forged = forged_copy(block)
    assert forged != block.read_bytes()
    planted = tmp_path / "planted" / "blocks" / block.name
    planted.parent.mkdir(parents=True)
    planted.write_bytes(forged)
    # the forgery passes its own checks
    check_part(Store.open(store), "block", block.stem, path=planted)
    before = store_files(store)
    archive = tarball(tmp_path / "forged.tar.gz", {f"blocks/{block.name}": forged})
    report = unpack(archive, store)
    assert report.kept == [f"blocks/{block.name}"]
    assert store_files(store) == before
    r = run_kvsnap("unpack", archive, store)
    assert (
        r.returncode == 0 and f"blocks/{block.name}" in r.stdout and "not installed" in r.stdout
    ), r.stdout + r.stderr
    assert store_files(store) == before


def test_a_damaged_file_under_a_shipped_name_is_repaired_by_the_install(store, built, tmp_path):
    """The other side of the rule: a copy that fails its own checks is replaced by the verified
    shipped one."""
    block = sorted((store / "blocks").iterdir())[0]
    good = block.read_bytes()
    block.write_bytes(good[:-1] + bytes([good[-1] ^ 0x01]))
    report = unpack(tarball(tmp_path / "good.tar.gz", {f"blocks/{block.name}": good}), store)
    assert report.kept == [] and block.read_bytes() == good


# --- expansion limits and stale stages ----------------------------------------------------------


class Zeros(io.RawIOBase):
    """``n`` zero bytes, read in chunks (a bomb is made without holding it in memory)."""

    def __init__(self, n: int):
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        k = min(len(buf), self.left)
        buf[:k] = bytes(k)
        self.left -= k
        return k


def test_regression_a_gzip_bomb_is_refused_before_anything_is_written(store, tmp_path):
    """Once: a 1 MB .tar.gz expanded to 1 GiB in the stage folder before any check."""
    from kvsnap.store.archive import ArchiveError

    size = 1 << 30
    bomb = tmp_path / "bomb.tar.gz"
    with tarfile.open(bomb, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("blocks/" + "0" * 32 + ".safetensors")
        info.size = size
        tar.addfile(info, io.BufferedReader(Zeros(size), 1 << 20))
    assert bomb.stat().st_size < 8 << 20
    before = store_files(store)
    with pytest.raises(
        ArchiveError, match=r"expands to 1073741824 bytes from a \d+-byte archive, over 50 times"
    ):
        unpack(bomb, store)
    assert store_files(store) == before and not [
        p for p in tmp_path.iterdir() if p.name.startswith(".kvsnap-stage-")
    ]


@pytest.mark.parametrize(
    "limit, expected",
    [
        ({"max_files": 2}, r"holds more than 2 entries \(\$KVSNAP_UNPACK_MAX_FILES raises it\)"),
        ({"max_file_bytes": 100}, r"declares \d+ bytes, over the 100-byte limit for one file"),
        ({"max_total_bytes": 1000}, r"expands past 1000 bytes in all"),
    ],
)
def test_unpack_limits_on_entries_and_sizes(built, tmp_path, limit, expected):
    from kvsnap.store.archive import ArchiveError, pack
    from kvsnap.store.tar_limits import UnpackLimits

    archive = pack(built, tmp_path / "snaps.tar").archive
    with pytest.raises(ArchiveError, match=expected):
        unpack(archive, tmp_path / "new", limits=UnpackLimits(**limit))
    assert not (tmp_path / "new").exists()


def test_a_huge_pax_header_is_refused_before_tarfile_reads_it(store, tmp_path):
    from kvsnap.store.archive import ArchiveError

    archive = tmp_path / "pax.tar"
    # a pax header entry declaring 2 GiB: tarfile would read it whole
    with open(archive, "wb") as f:
        first = tarfile.TarInfo(MANIFEST)
        first.size = len((store / MANIFEST).read_bytes())
        data = (store / MANIFEST).read_bytes()
        f.write(first.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512))
        header = tarfile.TarInfo("././@PaxHeader")
        header.type, header.size = tarfile.XHDTYPE, 2 << 30
        f.write(header.tobuf(tarfile.USTAR_FORMAT) + bytes(1024))
    with pytest.raises(ArchiveError, match=r"metadata entry of 2147483648 bytes"):
        unpack(archive, store)


def test_stale_stages_nobody_holds_are_removed_and_live_ones_kept(built, tmp_path):
    import fcntl
    import os
    import time

    from kvsnap.store.archive import pack

    archive = pack(built, tmp_path / "snaps.tar").archive
    old = time.time() - 7 * 3600
    stages = {}
    for name in ("dead-old", "live-old", "dead-young"):
        folder = tmp_path / f".kvsnap-stage-snaps-{name}"
        (folder / "blocks").mkdir(parents=True)
        (folder / "blocks" / "x").write_bytes(b"left by a killed unpack")
        if "old" in name:
            for p in (folder / "blocks", folder):
                os.utime(p, (old, old))
        stages[name] = folder
    held = os.open(stages["live-old"], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # a live install elsewhere holds its stage
    try:
        unpack(archive, tmp_path / "snaps")
    finally:
        os.close(held)
    assert not stages["dead-old"].exists()
    assert stages["live-old"].exists() and stages["dead-young"].exists()
