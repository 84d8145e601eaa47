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
    assert set(doc) == {
        "store",
        "ok",
        "bad",
        "other",
        "problem",
        "conversations",
        "files",
        "temp_files",
    }
    assert (doc["ok"], doc["bad"], doc["other"]) == (2, 0, 0) and doc["temp_files"] == []
    assert doc["problem"] is None
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


def test_verify_that_checked_nothing_fails_saying_so(built, demo_models, tmp_path):
    """Every file for another KV setting (a CI step that forgot --kv-bits): nothing was checked,
    so the store is not known good; exit 1 with a sentence, in text and in --json."""
    store = tmp_path / "snaps"
    shutil.copytree(built, store)
    model = demo_models.path("dense")
    r = run_kvsnap("verify", store, "--model", model, "--kv-bits", "8")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "0 ok, 0 bad, 2 for another model" in r.stdout
    assert "checked nothing" in r.stdout and "--kv-bits" in r.stdout, r.stdout
    r = run_kvsnap("verify", store, "--model", model, "--kv-bits", "8", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert (doc["ok"], doc["bad"], doc["other"]) == (0, 0, 2)
    assert "checked nothing" in doc["problem"]
    assert run_kvsnap("verify", store, "--model", model).returncode == 0
