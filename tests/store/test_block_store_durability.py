"""Every folder created in a store is fsynced in its parent.

A new folder's entry is only durable once its parent is fsynced; before, ``blocks/``,
``checkpoints/``, ``snapshots/`` and a new store root were made with ``mkdir`` alone, so a
power cut could lose a folder whose files had been renamed in and fsynced. Real build of a
real tiny hybrid model (it writes blocks and checkpoints); os.mkdir / os.open / os.fsync spied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvsnap.build.pipeline import build_snapshots
from kvsnap.prompts import load_warm_prompts
from kvsnap.snapshot.blocks import BlockSettings
from kvsnap.store.local import Store


def _spy(monkeypatch) -> list[tuple[str, str]]:
    """("mkdir", path) and ("fsync", path) events, in order (fsyncs of directories and files)."""
    events: list[tuple[str, str]] = []
    opened: dict[int, str] = {}
    real_mkdir, real_open, real_fsync = os.mkdir, os.open, os.fsync

    def mkdir(path, *args, **kw):
        real_mkdir(path, *args, **kw)
        events.append(("mkdir", os.path.abspath(path)))

    def open_(path, *args, **kw):
        fd = real_open(path, *args, **kw)
        opened[fd] = os.path.abspath(path)
        return fd

    def fsync(fd):
        real_fsync(fd)
        events.append(("fsync", opened.get(fd, f"fd {fd}")))

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    return events


def test_every_folder_a_store_creates_is_fsynced_in_its_parent_before_it_is_used(
    demo_models, tmp_path, monkeypatch
):
    lm = demo_models.load("hybrid")
    agents_file = tmp_path / "agents.json"
    text = "You are a careful reviewer. Read the tests first, then every function. " * 8
    agents_file.write_text(
        json.dumps([{"name": "a", "messages": [{"role": "system", "content": text}]}])
    )
    root = tmp_path / "new" / "store"
    events = _spy(monkeypatch)
    store = Store.open(root, create=True)
    report = build_snapshots(
        lm, load_warm_prompts(agents_file), store, str(agents_file), blocks=BlockSettings(32, 64)
    )
    assert report.ok, report.entries

    made = [path for kind, path in events if kind == "mkdir"]
    expected = {str(tmp_path / "new"), str(root)} | {
        str(root / f) for f in ("snapshots", "blocks", "checkpoints")
    }
    assert expected <= set(made), made
    for folder in made:
        after = events[events.index(("mkdir", folder)) + 1 :]
        fsyncs = [path for kind, path in after if kind == "fsync"]
        parent = str(Path(folder).parent)
        assert parent in fsyncs, f"{folder} was created but {parent} never fsynced"
        # Durable before it is relied on: the parent is fsynced before the new folder's own
        # first fsync (the commit of the first file renamed into it).
        if folder in fsyncs:
            assert fsyncs.index(parent) < fsyncs.index(folder), (
                f"{folder} was used before {parent} was fsynced"
            )


def test_folders_an_unpack_adds_to_an_existing_store_are_fsynced_in_its_root(
    demo_models, tmp_path, monkeypatch
):
    """An install into a store that has no blocks/ or checkpoints/ yet creates them: each is
    made durable in the store's root before files are renamed into it."""
    from kvsnap.store.archive import pack, unpack

    lm = demo_models.load("hybrid")
    agents_file = tmp_path / "agents.json"
    text = "You are a careful reviewer. Read the tests first, then every function. " * 8
    agents_file.write_text(
        json.dumps([{"name": "a", "messages": [{"role": "system", "content": text}]}])
    )
    source = Store.open(tmp_path / "source", create=True)
    report = build_snapshots(
        lm, load_warm_prompts(agents_file), source, str(agents_file), blocks=BlockSettings(32, 64)
    )
    assert report.ok, report.entries
    pack(source.root, tmp_path / "store.tar.gz")
    dest = Store.open(tmp_path / "dest", create=True).root
    for folder in ("blocks", "checkpoints"):
        if (dest / folder).exists():
            (dest / folder).rmdir()  # a store made before blocks existed: no such folders

    events = _spy(monkeypatch)
    unpack(tmp_path / "store.tar.gz", dest)
    made = [p for kind, p in events if kind == "mkdir" and ".kvsnap-stage" not in p]
    assert {str(dest / "blocks"), str(dest / "checkpoints")} <= set(made), made
    for folder in made:
        after = events[events.index(("mkdir", folder)) + 1 :]
        fsyncs = [path for kind, path in after if kind == "fsync"]
        parent = str(Path(folder).parent)
        assert parent in fsyncs, f"{folder} was created but never made durable"
        if folder in fsyncs:  # its first use: the commit of the files renamed into it
            assert fsyncs.index(parent) < fsyncs.index(folder), f"{folder} used before {parent}"
