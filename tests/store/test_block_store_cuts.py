"""Where a chain is cut: the block grid, and where siblings leave each other.

Every branch point with any other warm prefix was a block end, so an
unrelated agent that shares only the chat template's first tokens cut every chain there: an
edited agent found none of its old blocks (re-prefilled everything) and stored its first block
twice. Since, a chain is the grid plus, only inside a block not stored whole, the points where
it leaves a sibling: a stored block is never cut again.

On the grid alone, siblings that leave each other inside a block each stored
that block's shared head (10 agents, a shared preamble: 1.7x their unique KV), and a hybrid
restored an edited agent from the grid point before its branch point (387 tokens re-prefilled
for a one-sentence edit).
Real tiny demo models, the real build pipeline, real files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers.cli import run_kvsnap
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.build.pipeline import build_snapshots
from kvsnap.prompts import load_warm_prompts
from kvsnap.snapshot.blocks import BlockSettings, _lcp, plan_cuts
from kvsnap.snapshot.file import read_header
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


def _build(lm, agents_file: Path, root: Path, blocks: BlockSettings = BLOCKS):
    store = Store.open(root, create=True)
    return build_snapshots(
        lm, load_warm_prompts(agents_file), store, str(agents_file), blocks=blocks
    )


def _blocks_stored_twice(store: Store, keys: list[str]) -> list[tuple[str, str]]:
    """(block, other) pairs where ``other`` holds every token of ``block``, after the same prefix:
    the same state stored twice. Two chains that leave each other inside a block each hold
    the shared head of that block; that is the grid's price, not a second copy of a block."""
    # prefix -> (block, start) holding its last token
    covering: dict[tuple, list[tuple[str, int]]] = {}
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


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3000),
    st.sets(st.integers(1, 3000), max_size=6),
    st.sets(st.integers(1, 3000), max_size=3),
    st.integers(1, 300),
    st.integers(1, 1500),
)
def test_a_split_is_one_more_cut_and_a_checkpoint_exactly_there(n, branches, splits, b, c):
    blocks = BlockSettings(b, c)
    cuts = plan_cuts(n, branches | splits, blocks, splits)
    inside = {d for d in splits if d < n}
    grid = {x.end for x in plan_cuts(n, set(), blocks)}
    assert {x.end for x in cuts} == grid | inside
    assert all(x.end == y.start for x, y in zip(cuts, cuts[1:])) and cuts[0].start == 0
    every_c = {m for m in range(c, n, c) if not any(0 < m - d < b for d in inside)}
    on_grid = {d // b * b for d in branches - inside if b <= d < n}
    assert {x.end for x in cuts if x.checkpoint} == inside | on_grid | {n} | every_c


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
def test_a_chain_beside_a_sibling_is_its_grid_cut_once_more_where_they_part(
    demo_models, tmp_path, model
):
    lm = demo_models.load(model)
    shared = _text(20, 150)
    contents = {"a": f"{shared} {_text(21, 40)}", "b": f"{shared} {_text(22, 40)}"}
    together = _build(lm, _write_agents(tmp_path / "both.json", contents), tmp_path / "both")
    alone = _build(lm, _write_agents(tmp_path / "a.json", {"a": contents["a"]}), tmp_path / "alone")
    chains, tokens = {}, {}
    for name, report in (("both", together), ("alone", alone)):
        store = Store.open(tmp_path / name)
        info = store.inspect(store.path_for(report.entries[0].key))
        chains[name], tokens[name] = info.chain, info.tokens
    store = Store.open(tmp_path / "both")
    parted = _lcp(tokens["both"], store.inspect(store.path_for(together.entries[1].key)).tokens)
    assert parted % BLOCKS.block_tokens, "the test needs a branch point inside a block"
    ends = {name: {end for _, _, end in chain.blocks} for name, chain in chains.items()}
    assert ends["both"] == ends["alone"] | {parted}
    # Every block but the one around the branch point is the same block, built alone or not.
    around = [b for b in chains["alone"].blocks if b[1] < parted < b[2]]
    assert set(chains["alone"].blocks) - set(chains["both"].blocks) == set(around)
    if model == "hybrid":  # the sibling restores at the branch point itself
        assert parted in {end for _, end in chains["both"].checkpoints}
        assert together.entries[1].tokens_reused == parted


def test_a_block_stored_whole_is_never_cut_again_when_a_sibling_arrives(demo_models, tmp_path):
    """An agent built alone stores the block around the point a later sibling leaves it whole:
    once the sibling is built, editing the agent's last sentence still restores past that
    block (cutting it at the sibling's branch point would name a head the agent never stored)."""
    lm = demo_models.load("dense")
    shared = _text(50, 150)
    contents = {"a": f"{shared} {_text(51, 90)}. Answer in one sentence."}
    agents_file = _write_agents(tmp_path / "agents.json", contents)
    assert _build(lm, agents_file, tmp_path / "s").ok
    store = Store.open(tmp_path / "s")
    old_a = store.inspect(store.path_for(_build(lm, agents_file, tmp_path / "s").entries[0].key))
    contents["b"] = f"{shared} {_text(52, 30)}"
    report = _build(lm, _write_agents(agents_file, contents), tmp_path / "s")
    assert [e.status for e in report.entries] == ["reused", "built"], report.entries
    parted = _lcp(old_a.tokens, store.inspect(store.path_for(report.entries[1].key)).tokens)
    assert parted % BLOCKS.block_tokens and old_a.n_tokens - parted > 2 * BLOCKS.block_tokens

    contents["a"] = contents["a"].replace("Answer in one sentence.", "Answer in two, then stop.")
    report = _build(lm, _write_agents(agents_file, contents), tmp_path / "s")
    edited = report.entries[0]
    new_a = store.inspect(store.path_for(edited.key)).tokens
    changed = len(new_a) - _lcp(old_a.tokens, new_a)
    assert edited.status == "built" and 0 < changed < 30
    assert 0 < edited.tokens_prefilled <= BLOCKS.block_tokens + changed, edited
    assert report.entries[1].status == "reused"


def _kv_bytes_per_token(root: Path) -> float:
    """The tensor bytes per token of a store's blocks (safetensors headers left out)."""
    data = tokens = 0
    for path in (root / "blocks").glob("*.safetensors"):
        header = read_header(path)
        data += header.file_size - header.data_start
        tokens += int(header.metadata["kvsnap.end"]) - int(header.metadata["kvsnap.start"])
    return data / tokens


def _stored_bytes(root: Path) -> int:
    """Blocks, checkpoints and records: everything the store holds for the agents."""
    return sum(
        p.stat().st_size
        for folder in ("blocks", "checkpoints", "snapshots")
        for p in (root / folder).glob("*.safetensors")
    )


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_agents_sharing_a_preamble_store_their_unique_kv_and_an_edit_prefills_one_block(
    demo_models, tmp_path, model
):
    """10 agents, one preamble that ends inside a block, distinct one-sentence-ended tails, the
    default block and checkpoint spacing: the store holds at most 1.1x the KV of their distinct
    tokens (a hybrid's checkpoints and every record included), and editing one agent's last
    sentence re-prefills at most one block and the edit."""
    lm = demo_models.load(model)
    blocks = BlockSettings()
    preamble = _text(30, 698)
    tails = [f"You are agent {i}. {_text(300 + i, 60)}. Answer in one sentence." for i in range(10)]
    contents = {f"agent{i}": f"{preamble} {tail}" for i, tail in enumerate(tails)}
    agents_file = _write_agents(tmp_path / "agents.json", contents)
    first = _build(lm, agents_file, tmp_path / "s", blocks)
    assert first.ok, first.entries
    store = Store.open(tmp_path / "s")
    prompts = [store.inspect(store.path_for(e.key)).tokens for e in first.entries]
    preamble_end = min(_lcp(prompts[0], other) for other in prompts[1:])
    assert preamble_end % blocks.block_tokens >= blocks.block_tokens // 2  # the head that bites
    distinct = len(prompts[0]) + sum(
        len(t) - max(_lcp(t, earlier) for earlier in prompts[:i])
        for i, t in enumerate(prompts[1:], 1)
    )
    ratio = _stored_bytes(tmp_path / "s") / (distinct * _kv_bytes_per_token(tmp_path / "s"))

    contents["agent3"] = contents["agent3"].replace(
        "Answer in one sentence.", "Answer in two short sentences, then stop."
    )
    report = _build(lm, _write_agents(agents_file, contents), tmp_path / "s", blocks)
    assert report.ok, report.entries
    by_name = {e.name: e for e in report.entries}
    edited = by_name.pop("agent3")
    new = store.inspect(store.path_for(edited.key)).tokens
    changed = len(new) - _lcp(prompts[3], new)
    assert 0 < changed < 30 and edited.status == "built"
    measured = {"store / unique KV": round(ratio, 3), "edit prefilled": edited.tokens_prefilled}
    assert ratio <= 1.1, measured
    assert 0 < edited.tokens_prefilled <= blocks.block_tokens + changed, measured
    assert all(e.status == "reused" and e.tokens_prefilled == 0 for e in by_name.values())


def test_a_conversation_on_an_agent_cut_where_it_parts_names_that_agents_blocks(
    demo_models, tmp_path
):
    """A conversation is cut where its agent's record is, so the head the agent shares with a
    sibling and its own tail are the conversation's blocks too, not a copy of their tokens."""
    from helpers.persist_servers import Chat, serve, settle

    from kvsnap.store.conversations import conversation_files

    model = tmp_path / "m"
    model.symlink_to(demo_models.path("dense"), target_is_directory=True)
    preamble = _text(40, 200)
    contents = {"a": f"{preamble} {_text(41, 20)}", "b": f"{preamble} {_text(42, 20)}"}
    agents_file = _write_agents(tmp_path / "agents.json", contents)
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    r = run_kvsnap("build", agents_file, "--model", model, "--out", tmp_path / "s", env=env)
    assert r.returncode == 0, r.stderr
    store = Store.open(tmp_path / "s")
    agent = next(i for i in store.scan()[0] if i.name == "a")
    grid = BlockSettings().block_tokens
    assert any(end % grid and end < agent.n_tokens for _, _, end in agent.chain.blocks)
    server = serve(model, tmp_path / "s", tmp_path, "conv", "--persist-requests")
    try:
        Chat("c1", contents["a"]).send(server.url)
        settle(server, tmp_path / "s", 1)
    finally:
        server.stop()
    (record,) = [store.inspect(p) for p in conversation_files(tmp_path / "s")]
    assert record.tokens[: agent.n_tokens] == agent.tokens
    assert set(agent.chain.blocks) <= set(record.chain.blocks), (
        agent.chain.blocks,
        record.chain.blocks,
    )
