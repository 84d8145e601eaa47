"""One policy for what a --kv-snapshots folder means (kvsnap/store/opening.py, issue 39): kvsnap
serve's warm-up (runtime/warmup/store.py), the mlx-lm and vllm-mlx routes
(integrations/common/store.py) and kvsnap serve's start-up check agree on a missing, empty,
hidden-only, foreign, file and store path, with and without something to write back."""

from __future__ import annotations

import subprocess

import pytest
from helpers.cli import run_kvsnap

from kvsnap.errors import StoreError
from kvsnap.integrations.common.store import open_store as route_open
from kvsnap.runtime.warmup.report import SnapshotCounts
from kvsnap.runtime.warmup.store import open_store as warmup_open
from kvsnap.store.local import Store
from kvsnap.store.opening import check_store_folder, open_store_folder

KINDS = ("missing", "empty", "hidden-only", "foreign", "file", "store")


def _make(tmp_path, kind: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "snaps"
    if kind == "empty":
        path.mkdir()
    elif kind == "hidden-only":
        path.mkdir()
        (path / ".kvsnap-rank-probe-1").write_text("")
    elif kind == "foreign":
        path.mkdir()
        (path / "notes.txt").write_text("mine")
    elif kind == "file":
        path.write_text("not a folder")
    elif kind == "store":
        Store.open(path, create=True)
    return path


def _listing(path):
    if not path.exists():
        return None
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else path.read_text()


def _shared(path, want_write: bool):
    """(what the policy gives: refused, nothing or a store, writable)."""
    try:
        opened = open_store_folder(path, want_write)
    except StoreError:
        return "refused", False
    has = opened.store is not None and opened.store.is_initialized()
    return ("store" if has else "nothing"), opened.writable


@pytest.mark.parametrize("want_write", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_the_warm_up_and_the_routes_open_a_folder_as_the_one_policy_says(
    tmp_path, kind, want_write
):
    expected = _shared(_make(tmp_path / "policy", kind), want_write)

    path = _make(tmp_path / "warmup", kind)
    before = _listing(path)
    counts = SnapshotCounts()
    store = warmup_open(str(path), want_write, counts)
    if store is None:
        got = ("refused" if counts.write_back_note.startswith("no store:") else "nothing"), False
    else:
        got = ("store" if store.is_initialized() else "nothing"), not store.readonly
    assert got == expected, counts.write_back_note
    if expected[0] == "refused":
        assert _listing(path) == before  # a folder that is no store is left as it was
        assert str(path) in counts.write_back_note

    path = _make(tmp_path / "route", kind)
    before = _listing(path)
    try:
        store, writable = route_open(str(path), want_write)
        got = ("store" if store.is_initialized() else "nothing"), writable
    except StoreError as exc:
        got = "refused", False
        assert str(path.name) in str(exc)
    # nothing to read and nothing to write is no store for a route (it says what to give)
    assert got == (("refused", False) if expected[0] == "nothing" else expected)
    if got[0] == "refused":
        assert _listing(path) == before


def test_the_policy_itself(tmp_path):
    table = {
        (kind, w): _shared(_make(tmp_path / f"{kind}-{w}", kind), w)
        for kind in KINDS
        for w in (False, True)
    }
    assert table == {
        ("missing", False): ("nothing", False),
        ("missing", True): ("store", True),
        ("empty", False): ("nothing", False),
        ("empty", True): ("store", True),
        ("hidden-only", False): ("nothing", False),
        ("hidden-only", True): ("store", True),
        ("foreign", False): ("refused", False),
        ("foreign", True): ("refused", False),
        ("file", False): ("refused", False),
        ("file", True): ("refused", False),
        ("store", False): ("store", False),
        ("store", True): ("store", True),
    }
    with pytest.raises(StoreError, match="holds other files"):
        check_store_folder(_make(tmp_path / "x", "foreign"))
    with pytest.raises(StoreError, match="is a file"):
        check_store_folder(_make(tmp_path / "y", "file"))


def test_kvsnap_serve_refuses_a_folder_holding_other_files_before_loading(demo_models, tmp_path):
    path = _make(tmp_path, "foreign")
    model = demo_models.path("dense")
    try:
        r = run_kvsnap("serve", model, "--port", "0", "--kv-snapshots", path, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("kvsnap serve started on a folder holding other files")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "holds other files" in r.stderr and str(path) in r.stderr, r.stderr[-2000:]
    assert _listing(path) == ["notes.txt"]
