"""Stage folders of installs (``.kvsnap-stage-<name>-*`` beside the store): made, locked, resumed,
cleaned.

A live install holds an exclusive ``flock`` on its stage folder for as long as it runs; the
kernel drops it when the process dies. So a stage nobody holds was left by a killed pull or
unpack: a pull into the same store resumes from it (each staged file checked against its
blob's sha256 before it counts), and any install removes such leftovers once they are older
than ``STALE_STAGE_S``. A held stage is never touched.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

STAGE_PREFIX = ".kvsnap-stage-"
STALE_STAGE_S = 6 * 3600  # a stage untouched this long, and held by no process, is removed


def stage_prefix(dest: Path) -> str:
    return f"{STAGE_PREFIX}{dest.name}-"


def lock_folder(folder: Path) -> int | None:
    """A descriptor holding an exclusive lock on ``folder``; None when a live process holds it."""
    try:
        fd = os.open(
            folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
        )
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def new_stage(dest: Path, mode: int) -> tuple[Path, int]:
    """A fresh stage folder beside ``dest`` (``mode``), locked."""
    tmp = Path(tempfile.mkdtemp(prefix=stage_prefix(dest), dir=dest.parent))
    os.chmod(tmp, mode)
    fd = lock_folder(tmp)
    if fd is None:  # only this process knows the new name
        raise OSError(f"cannot lock the new stage folder {tmp}")
    return tmp, fd


def _last_write(folder: Path) -> float:
    """When anything was last added to the stage: the folder's or one of its subfolders' mtime."""
    times = [folder.lstat().st_mtime]
    for child in folder.iterdir():
        st = child.lstat()
        if stat.S_ISDIR(st.st_mode):
            times.append(st.st_mtime)
    return max(times)


def _stages(parent: Path, prefix: str) -> list[Path]:
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    return [p for p in entries if p.name.startswith(prefix) and stat.S_ISDIR(p.lstat().st_mode)]


def clean_stale_stages(parent: Path, max_age_s: float = STALE_STAGE_S) -> list[Path]:
    """Remove every stage folder in ``parent`` older than ``max_age_s`` that no live process
    holds."""
    removed = []
    now = time.time()
    for folder in _stages(parent, STAGE_PREFIX):
        fd = lock_folder(folder)
        if fd is None:
            continue
        try:
            if now - _last_write(folder) > max_age_s:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        except OSError:
            continue  # gone already, or unreadable: not ours to judge
        finally:
            os.close(fd)
    return removed


def adopt_stage(dest: Path) -> tuple[Path, int] | None:
    """The newest stage for ``dest`` that no live process holds (a killed pull's), locked; or
    None."""
    candidates = []
    # mkdtemp's suffix: not "snaps-b"'s stages
    own = re.compile(re.escape(stage_prefix(dest)) + r"[a-z0-9_]{8}")
    for folder in (f for f in _stages(dest.parent, stage_prefix(dest)) if own.fullmatch(f.name)):
        try:
            candidates.append((_last_write(folder), folder))
        except OSError:
            continue
    for _, folder in sorted(candidates, reverse=True):
        fd = lock_folder(folder)
        if fd is not None:
            return folder, fd
    return None
