"""`kvsnap verify --json` and `kvsnap gc --json`: one JSON object on stdout with the documented
fields, and the exit codes of the text output."""

from __future__ import annotations

import json
import shutil

from helpers.cli import run_kvsnap
from helpers.stores import flip_byte

from kvsnap.store.local import TMP_PREFIX


def test_verify_json_lists_every_file_with_its_status_and_keeps_the_exit_code(built, tmp_path):
    store = tmp_path / "snaps"
    shutil.copytree(built, store)
    r = run_kvsnap("verify", store, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"store", "ok", "bad", "other", "conversations", "files", "temp_files"}
    assert (doc["ok"], doc["bad"], doc["other"]) == (2, 0, 0) and doc["temp_files"] == []
    assert doc["conversations"] == {"ok": 0, "bad": 0, "other": 0}
    assert {f["status"] for f in doc["files"]} == {"ok"} and len(doc["files"]) == 2
    for f in doc["files"]:
        assert set(f) == {"status", "file", "name", "n_tokens"} and (store / f["file"]).is_file()

    record = sorted((store / "snapshots").iterdir())[0]
    flip_byte(record, 1)
    (store / "snapshots" / f"{TMP_PREFIX}left-over").write_bytes(b"x")
    r = run_kvsnap("verify", store, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert (doc["ok"], doc["bad"]) == (1, 1)
    (bad,) = [f for f in doc["files"] if f["status"] == "bad"]
    assert bad["file"] == f"snapshots/{record.name}" and bad["reason"] and bad["fix"]
    assert doc["temp_files"] == [f"snapshots/{TMP_PREFIX}left-over"]


def test_gc_json_lists_what_it_would_remove_then_removes_it(built, tmp_path):
    store = tmp_path / "snaps"
    shutil.copytree(built, store)
    (store / "snapshots" / f"{TMP_PREFIX}left-over").write_bytes(b"12345")
    r = run_kvsnap("gc", store, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc == {
        "store": str(store),
        "deleted": False,
        "manifest": True,
        "files": [f"snapshots/{TMP_PREFIX}left-over"],
        "conversations": [],
        "count": 1,
        "bytes": 5,
    }
    r = run_kvsnap("gc", store, "--yes", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["deleted"] is True
    assert not (store / "snapshots" / f"{TMP_PREFIX}left-over").exists()
    assert json.loads(run_kvsnap("gc", store, "--json").stdout)["count"] == 0
