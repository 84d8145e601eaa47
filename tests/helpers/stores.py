"""A store built in process, its files compared before and after, a forged copy of one."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from helpers.models import LONG_SYSTEM
from kvsnap.store.local import MANIFEST, Store
from kvsnap.store.stage import STAGE_PREFIX

AGENTS = [
    {"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]},
    {
        "name": "planner",
        "messages": [
            {
                "role": "system",
                "content": "You are a planner agent. Plan each task step by step, list the tools. "
                * 4,
            }
        ],
    },
]


def build_store(lm, root: Path, agents: list, agents_file: Path | None = None, blocks=None) -> Path:
    """What `kvsnap build AGENTS --model M --out ROOT` does, in-process (the model stays loaded);
    ``blocks``: the build's BlockSettings (None: its default)."""
    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.prompts import load_warm_prompts

    agents_file = agents_file or root.parent / f"{root.name}-agents.json"
    agents_file.write_text(json.dumps(agents))
    extra = {} if blocks is None else {"blocks": blocks}
    report = build_snapshots(
        lm, load_warm_prompts(agents_file), Store.open(root, create=True), str(agents_file), **extra
    )
    assert report.ok, report
    return root


def tree(root: Path) -> dict[str, object]:
    """Every path under root with its bytes, mode and inode: 'nothing changed' is equality."""
    out: dict[str, object] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = (p.read_bytes(), stat.S_IMODE(st.st_mode), st.st_ino)
    return out


def store_files(root: Path) -> dict[str, bytes]:
    files = {MANIFEST: (root / MANIFEST).read_bytes()}
    from kvsnap.store.paths import part_files

    store = Store.open(root, readonly=True)
    for p in [*store.snapshot_files(), *part_files(store)]:
        files[f"{p.parent.name}/{p.name}"] = p.read_bytes()
    return files


def no_stage_dirs(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.startswith(STAGE_PREFIX)]


def flip_byte(path: Path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def forged_copy(path: Path) -> bytes:
    """``path``'s bytes with one data byte changed and the checksum recomputed: it passes its own
    checks."""
    from kvsnap.snapshot.file import CHECKSUM_KEY, file_checksum, read_header

    original = path.read_bytes()
    scratch = path.parent.parent.parent / f"forged-{path.name}"
    data = bytearray(original)
    data[-1] ^= 0x01
    scratch.write_bytes(bytes(data))
    header = read_header(scratch)
    data = bytes(data).replace(
        header.metadata[CHECKSUM_KEY].encode(), file_checksum(scratch, header).encode(), 1
    )
    scratch.unlink()
    return data
