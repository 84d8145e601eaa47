"""The README's first command keeps working: `kvsnap quickstart` end to end."""

from __future__ import annotations

import json

from conftest import run_kvsnap


def test_quickstart_builds_serves_and_shows_a_warm_hit(tmp_path):
    demo = tmp_path / "demo"
    r = run_kvsnap("quickstart", "--dir", demo, env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((demo / "quickstart.json").read_text())  # the run's numbers as data, not parsed from its output
    warmup = record["warmup"]  # the server's own report, from /v1/status
    assert (warmup["completed"], warmup["skipped"], warmup["from_snapshots"], warmup["prefilled"]) == (2, 0, 2, 0), warmup
    assert record["warm"]["cached_tokens"] == 352 and record["cold"]["cached_tokens"] < 50, record
    assert record["warm"]["ttft_ms"] > 0 and record["cold"]["ttft_ms"] > 0, record
    assert [b["status"] for b in record["build"]] == ["built", "built"] and record["ok"] is True, record
    assert "the server was stopped" in r.stdout
    # A second run reuses everything it made.
    again = run_kvsnap("quickstart", "--dir", demo, env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    record = json.loads((demo / "quickstart.json").read_text())
    assert [b["status"] for b in record["build"]] == ["reused", "reused"], record
