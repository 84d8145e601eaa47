"""Where a store's files are: a record's path by key, a block's or checkpoint's, the parts a
record's chain reaches. Paths only: nothing here opens a file's contents.

A record (``snapshots/<key>.safetensors``, format 3) holds tokens and a chain; its state is
in ``blocks/`` (the attention KV of each run of tokens) and ``checkpoints/`` (the whole state of
layers that cannot be sliced, at chosen token counts).
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Iterable

from kvsnap.errors import SnapshotError, StoreError
from kvsnap.snapshot.chain import Chain
from kvsnap.snapshot.format import (
    BLOCK_KIND,
    BLOCKS,
    CHECKPOINT_KIND,
    CHECKPOINTS,
    KEY_RE,
    SNAPSHOTS,
    SUFFIX,
    block_relpath,
    checkpoint_relpath,
    snapshot_filename,
)
from kvsnap.snapshot.header import SnapshotInfo
from kvsnap.store.fileio import StoreFiles, store_files

FOLDER = {BLOCK_KIND: BLOCKS, CHECKPOINT_KIND: CHECKPOINTS}
FIX = "rebuild it with `kvsnap build` (the chain is prefilled from the last good block)"


def record_path(store: StoreFiles, key: str) -> Path:
    """``snapshots/<key>.safetensors``; StoreError for a key that is not a content key."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise StoreError(f"snapshot key {key!r} is not 32 lowercase hex digits")
    return store.root / SNAPSHOTS / snapshot_filename(key)


def record_files(store: StoreFiles) -> list[Path]:
    """The agents' records; StoreError when ``snapshots/`` is a link (``store_folder``)."""
    return store_files(store.root, SNAPSHOTS, SUFFIX)


def part_path(store: StoreFiles, kind: str, key: str) -> Path:
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise StoreError(f"{kind} key {key!r} is not 32 lowercase hex digits")
    return store.root / FOLDER[kind] / snapshot_filename(key)


def part_relpath(kind: str, key: str) -> str:
    return block_relpath(key) if kind == BLOCK_KIND else checkpoint_relpath(key)


def has_part(store: StoreFiles, kind: str, key: str) -> bool:
    """A regular file is there (its contents are checked when read)."""
    try:
        return stat.S_ISREG(part_path(store, kind, key).lstat().st_mode)
    except FileNotFoundError:
        return False


def part_of_path(store: StoreFiles, path: str | Path) -> tuple[str, str] | None:
    """(kind, key) of the block or checkpoint file ``path`` names in ``store``, else None
    (a record, or a file elsewhere)."""
    where = Path(path)
    for kind, folder in FOLDER.items():
        key = where.name.removesuffix(SUFFIX)
        if where.parent == store.root / folder and where.name.endswith(SUFFIX):
            return (kind, key) if KEY_RE.fullmatch(key) else None
    return None


def part_files(store: StoreFiles) -> list[Path]:
    """Every block and checkpoint file (temp files excluded), sorted; StoreError when either
    folder is a symbolic link (``fileio.store_folder``)."""
    found = []
    for kind in (BLOCK_KIND, CHECKPOINT_KIND):
        found += store_files(store.root, FOLDER[kind], SUFFIX)
    return sorted(found)


def part_relpath_of_file(path: Path) -> str:
    """``blocks/<name>`` or ``checkpoints/<name>`` for a file in one of those folders."""
    return f"{path.parent.name}/{path.name}"


def chain_relpaths(info: SnapshotInfo) -> list[str]:
    """The block and checkpoint files a record reaches (none for a v2 file)."""
    if info.chain is None:
        return []
    return [block_relpath(k) for k, _, _ in info.chain.blocks] + [
        checkpoint_relpath(k) for k, _ in info.chain.checkpoints
    ]


def reached_parts(infos: Iterable[SnapshotInfo]) -> set[str]:
    """Relative paths of every block and checkpoint these records reach."""
    return {rel for info in infos for rel in chain_relpaths(info)}


def chain_of(info: SnapshotInfo) -> Chain:
    """A v3 record's chain; the chain's readers are only called on records that have one."""
    if info.chain is None:
        raise SnapshotError(
            str(info.path), "holds its own state, not a chain of blocks", "read it as a whole file"
        )
    return info.chain


def end_checkpoint(info: SnapshotInfo) -> str | None:
    """The key of a record's checkpoint at its end (hybrids), or None."""
    chain = chain_of(info)
    last = chain.checkpoints[-1] if chain.checkpoints else None
    return last[0] if last is not None and last[1] == info.n_tokens else None
