"""A Hugging Face hub cache written the way huggingface_hub writes it (blobs, snapshots, refs)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(
    hub: Path,
    repo_id: str,
    model_dir: Path,
    commit: str,
    refs: tuple[str, ...] = ("main",),
    blob_name=None,
) -> Path:
    """Put ``model_dir``'s files into ``hub`` as huggingface_hub would after `hf download`; returns
    the snapshot folder.

    ``blob_name(file, data)`` may override a blob's name (to fake a damaged cache).
    """
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(model_dir.iterdir()):
        data = f.read_bytes()
        # LFS files (the weights) are named by the sha256 of their bytes, small git files by their
        # git blob sha1.
        name = (
            hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else git_blob_sha1(data)
        )
        name = blob_name(f, data) if blob_name else name
        (blobs / name).write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", name))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
