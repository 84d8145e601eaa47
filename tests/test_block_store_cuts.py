"""Issue 24, item 10: a chain's block boundaries never depend on the other agents.

Before, every branch point with any other warm prefix was a block end: an unrelated agent
that shares only the chat template's first tokens cut every chain there, so an edited agent
found none of its old blocks (re-prefilled everything) and stored its first block twice.
Real tiny demo models, the real build pipeline, real files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.build import build_snapshots
from kvsnap.prompts import load_warm_prompts
from kvsnap.snapshot.blocks import BlockSettings, _lcp, plan_cuts
from kvsnap.store.local import Store

WORDS = (
    "alpha beta gamma delta house rules tools call search answer review code check tests".split()
)
BLOCKS = BlockSettings(64, 256)


def _text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _write_agents(path: Path, contents: dict[str, str]) -> Path:
    agents = [
        {"name": n, "messages": [{"role": "system", "content": c}]} for n, c in contents.items()
    ]
    path.write_text(json.dumps(agents))
    return path


def _build(lm, agents_file: Path, root: Path):
    store = Store.open(root, create=True)
    return build_snapshots(
        lm, load_warm_prompts(agents_file), store, str(agents_file), blocks=BLOCKS
    )


def _blocks_stored_twice(store: Store, keys: list[str]) -> list[tuple[str, str]]:
    """(block, other) pairs where ``other`` holds every token of ``block``, after the same prefix:
    the same state stored twice. Two chains that leave each other inside a block each hold
    the shared head of that block; that is the grid's price, not a second copy of a block."""
    covering: dict[
        tuple, list[tuple[str, int]]
    ] = {}  # prefix -> (block, start) holding its last token
    spans = []
    for key in keys:
        info = store.inspect(store.path_for(key))
        for block, start, end in info.chain.blocks:
            spans.append((block, start, end, tuple(info.tokens[:end])))
            for i in range(start, end):
                covering.setdefault(tuple(info.tokens[: i + 1]), []).append((block, start))
    return sorted(
        {
            (block, other)
            for block, start, end, prefix in spans
            for other, s in covering[prefix]
            if other != block and s <= start
        }
    )


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3000),
    st.sets(st.integers(1, 3000), max_size=6),
    st.integers(1, 300),
    st.integers(1, 1500),
)
def test_cuts_are_the_fixed_grid_whatever_the_branch_points(n, branches, b, c):
    blocks = BlockSettings(b, c)
    cuts = plan_cuts(n, branches, blocks)
    alone = plan_cuts(n, set(), blocks)
    assert [(x.start, x.end) for x in cuts] == [(x.start, x.end) for x in alone]
    assert {x.end for x in cuts} == set(range(b, n, b)) | set(range(c, n, c)) | {n}
    checkpoints = {x.end for x in cuts if x.checkpoint}
    assert checkpoints == {d // b * b for d in branches if b <= d < n} | {n} | set(range(c, n, c))


def test_adding_an_unrelated_agent_never_moves_another_chains_blocks(demo_models, tmp_path):
    lm = demo_models.load("dense")
    shared = _text(10, 150)
    contents = {"a": f"{shared} {_text(11, 40)}", "b": f"{shared} {_text(12, 120)}"}
    agents_file = _write_agents(tmp_path / "agents.json", contents)
    first = _build(lm, agents_file, tmp_path / "s")
    assert first.ok, first.entries
    store = Store.open(tmp_path / "s")
    old_b = store.inspect(store.path_for(first.entries[1].key)).tokens

    contents["b"] = contents["b"] + " and one more sentence at the end."  # an edit in b's tail
    contents["c"] = "Totally unrelated: " + _text(13, 60)  # shares only the template's first tokens
    report = _build(lm, _write_agents(agents_file, contents), tmp_path / "s")
    assert report.ok, report.entries
    by_name = {e.name: e for e in report.entries}
    new_b = store.inspect(store.path_for(by_name["b"].key)).tokens
    new_c = store.inspect(store.path_for(by_name["c"].key)).tokens
    assert _lcp(new_c, new_b) > 0  # the template header: c is a branch point of every chain

    assert by_name["a"].status == "reused" and by_name["a"].tokens_prefilled == 0
    changed = len(new_b) - _lcp(old_b, new_b)
    assert by_name["b"].status == "built"
    assert 0 < by_name["b"].tokens_prefilled <= BLOCKS.block_tokens + changed, by_name["b"]
    assert by_name["b"].tokens_reused >= _lcp(old_b, new_b) // 64 * 64
    assert _blocks_stored_twice(store, [e.key for e in report.entries]) == []


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_a_chain_is_the_same_built_alone_or_beside_other_agents(demo_models, tmp_path, model):
    lm = demo_models.load(model)
    shared = _text(20, 150)
    contents = {"a": f"{shared} {_text(21, 40)}", "b": f"{shared} {_text(22, 40)}"}
    together = _build(lm, _write_agents(tmp_path / "both.json", contents), tmp_path / "both")
    alone = _build(lm, _write_agents(tmp_path / "a.json", {"a": contents["a"]}), tmp_path / "alone")
    chain_of = {}
    for name, report in (("both", together), ("alone", alone)):
        store = Store.open(tmp_path / name)
        chain_of[name] = store.inspect(store.path_for(report.entries[0].key)).chain.blocks
    assert chain_of["both"] == chain_of["alone"]
