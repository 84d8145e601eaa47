"""The store a route warms from: a missing or empty folder becomes a writable store only when
warm prompts may be written back (an empty one is what a second rank sees while the first is
creating it); a folder holding something else is never taken for one."""

from __future__ import annotations

import pytest

from kvsnap.errors import StoreError
from kvsnap.integrations.common.store import open_store


@pytest.mark.parametrize("hidden", [[], [".kvsnap-rank-probe-1"]])
def test_an_empty_folder_becomes_a_writable_store_when_something_may_be_written(tmp_path, hidden):
    folder = tmp_path / "snaps"
    folder.mkdir()
    for name in hidden:
        (folder / name).write_text("")
    store, writable = open_store(str(folder), want_write=True)
    assert writable and store.is_initialized()


def test_an_empty_folder_is_refused_when_nothing_would_be_written(tmp_path):
    with pytest.raises(StoreError, match="is not a kvsnap store"):
        open_store(str(tmp_path), want_write=False)


def test_a_folder_holding_other_files_is_not_made_a_store(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="is not a kvsnap store"):
        open_store(str(tmp_path), want_write=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
