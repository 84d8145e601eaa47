"""The build pipeline's progress: tokens done within each agent, chunk by chunk, for the CLI's
bar and its ETA."""

from __future__ import annotations

import json

from helpers.stores import AGENTS

from kvsnap.build.pipeline import build_snapshots
from kvsnap.key import KVSettings
from kvsnap.prompts import load_warm_prompts
from kvsnap.store.local import Store


def test_token_progress_goes_chunk_by_chunk_to_each_prompts_token_count(lm, tmp_path):
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    store = Store.open(tmp_path / "snaps", create=True)
    seen: dict[str, list[tuple[int, int]]] = {}

    def on_tokens(name: str, done: int, total: int) -> None:
        seen.setdefault(name, []).append((done, total))

    report = build_snapshots(lm, load_warm_prompts(agents), store, str(agents), on_tokens=on_tokens)
    assert report.ok and set(seen) == {a["name"] for a in AGENTS}
    step = KVSettings().prefill_step_size
    for entry in report.entries:
        calls = seen[entry.name]
        dones = [done for done, _ in calls]
        assert {total for _, total in calls} == {entry.n_tokens}
        # the restored tokens first, then one call per chunk, up to the whole prompt
        assert dones[0] == entry.tokens_reused and dones[-1] == entry.n_tokens
        assert dones == sorted(dones) and len(calls) >= 2
        assert all(0 < b - a <= step for a, b in zip(dones[1:], dones[2:]))

    assert max(len(calls) for calls in seen.values()) > 2  # a prompt of several blocks

    # a rebuild reuses every record: nothing is prefilled, nothing is reported
    seen.clear()
    again = build_snapshots(lm, load_warm_prompts(agents), store, str(agents), on_tokens=on_tokens)
    assert again.count("reused") == len(AGENTS) and seen == {}
