"""The README's first command keeps working: `kvsnap quickstart` end to end."""

from __future__ import annotations

import re

from conftest import run_kvsnap


def test_quickstart_builds_serves_and_shows_a_warm_hit(tmp_path):
    r = run_kvsnap("quickstart", "--dir", tmp_path / "demo", env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(2 from snapshots, 0 prefilled)" in r.stdout
    cold = re.search(r"cold request .*TTFT ([\d.]+) ms, cached_tokens (\d+) of (\d+)", r.stdout)
    warm = re.search(r"warm request .*TTFT ([\d.]+) ms, cached_tokens (\d+) of (\d+)", r.stdout)
    assert cold and warm, r.stdout
    assert int(warm.group(2)) == 352 and int(cold.group(2)) < 50
    assert "the server was stopped" in r.stdout
    # A second run reuses everything it made.
    again = run_kvsnap("quickstart", "--dir", tmp_path / "demo", env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)
    assert again.returncode == 0 and "reused" in again.stdout
