"""The README's first command keeps working: `kvsnap quickstart` end to end."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_kvsnap


@pytest.mark.slow
def test_quickstart_builds_serves_and_shows_a_warm_hit(tmp_path):
    demo = tmp_path / "demo"
    r = run_kvsnap(
        "quickstart", "--dir", demo, env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # the run's numbers as data, not parsed from its output
    record = json.loads((demo / "quickstart.json").read_text())
    warmup = record["warmup"]  # the server's own report, from /v1/status
    assert (
        warmup["completed"],
        warmup["skipped"],
        warmup["from_snapshots"],
        warmup["prefilled"],
    ) == (2, 0, 2, 0), warmup
    assert record["warm"]["cached_tokens"] == 352 and record["cold"]["cached_tokens"] < 50, record
    assert record["warm"]["ttft_ms"] > 0 and record["cold"]["ttft_ms"] > 0, record
    assert [b["status"] for b in record["build"]] == ["built", "built"] and record["ok"] is True, (
        record
    )
    assert "the server was stopped" in r.stdout
    # A second run reuses everything it made.
    again = run_kvsnap(
        "quickstart", "--dir", demo, env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}, timeout=600
    )
    assert again.returncode == 0, again.stdout + again.stderr
    record = json.loads((demo / "quickstart.json").read_text())
    assert [b["status"] for b in record["build"]] == ["reused", "reused"], record


def test_regression_quickstart_sizes_name_state_and_written_bytes_the_same_way_every_run(
    demo_models, tmp_path
):
    """Quickstart's "bytes" was the written bytes on a build and the total size
    on a reuse."""
    import re

    from helpers.models import LONG_SYSTEM
    from helpers.stores import build_store

    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.store.local import Store
    from kvsnap.tools.quickstart import size_words

    preamble = LONG_SYSTEM * 3  # several blocks long: b reuses the blocks a wrote
    agents = [
        {"name": n, "messages": [{"role": "system", "content": preamble + tail}]}
        for n, tail in (("a", "Review code."), ("b", "Plan work."))
    ]
    lm = demo_models.load("dense")
    root = build_store(lm, tmp_path / "store", agents, tmp_path / "agents.json")
    store = Store.open(root)
    first = build_snapshots(
        lm,
        load_warm_prompts(tmp_path / "agents.json"),
        Store.open(root),
        str(tmp_path / "agents.json"),
    )
    fresh = tmp_path / "fresh"
    built = build_snapshots(
        lm,
        load_warm_prompts(tmp_path / "agents.json"),
        Store.open(fresh, create=True),
        str(tmp_path / "agents.json"),
    )

    def words(s, e):
        said = re.fullmatch(r"(\d+) bytes of state, (\d+) bytes written", size_words(s, e))
        return tuple(map(int, said.groups()))

    built_b, reused_b = words(Store.open(fresh), built.entries[1]), words(store, first.entries[1])
    # one quantity, the same on a build and a reuse
    assert built_b[0] == reused_b[0] and reused_b[1] == 0
    # b shares a's preamble blocks: it wrote less than its state
    assert 0 < built_b[1] < built_b[0], built.entries
