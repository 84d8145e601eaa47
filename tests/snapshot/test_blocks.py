"""The block store: where prefixes are cut, shared blocks stored once, edits that
re-prefill only from the edit, bad blocks rejected and re-prefilled from the last good one.

Real tiny demo models, the real build pipeline, real files.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.build.pipeline import build_snapshots
from kvsnap.errors import SnapshotError
from kvsnap.prompts import load_warm_prompts
from kvsnap.snapshot.blocks import BlockSettings, _lcp, branch_points, plan_cuts
from kvsnap.store.local import Store
from kvsnap.store.paths import chain_relpaths, part_files

WORDS = (
    "alpha beta gamma delta house rules tools call search answer review code check the tests "
    "first then every function"
).split()


def _text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _agents(path: Path, preamble: str, tails: list[str]) -> Path:
    path.write_text(
        json.dumps(
            [
                {
                    "name": f"agent{i}",
                    "messages": [{"role": "system", "content": f"{preamble} {tail}"}],
                }
                for i, tail in enumerate(tails)
            ]
        )
    )
    return path


def _build(lm, agents_file: Path, root: Path, **kw):
    return build_snapshots(
        lm, load_warm_prompts(agents_file), Store.open(root, create=True), str(agents_file), **kw
    )


def _bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


# --- where prefixes are cut ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8))
def test_branch_points_are_the_tries_branch_points(prefixes):
    got = branch_points(prefixes)
    for i, p in enumerate(prefixes):
        expected = {_lcp(p, q) for j, q in enumerate(prefixes) if j != i} - {0, len(p)}
        assert got[i] == {d for d in expected if d < len(p)}


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3000),
    st.sets(st.integers(1, 3000), max_size=6),
    st.integers(1, 300),
    st.integers(1, 1500),
)
def test_cuts_tile_the_prefix_within_the_block_size_and_checkpoint_where_promised(
    n, branches, b, c
):
    cuts = plan_cuts(n, branches, BlockSettings(b, c))
    assert cuts[0].start == 0 and cuts[-1].end == n
    assert all(x.end == y.start for x, y in zip(cuts, cuts[1:]))
    assert all(0 < x.end - x.start <= b for x in cuts)
    ends = {x.end for x in cuts}
    assert ends == set(range(b, n, b)) | set(range(c, n, c)) | {n}  # the grid: no branch moves it
    checkpoints = {x.end for x in cuts if x.checkpoint}
    assert checkpoints == {d // b * b for d in branches if b <= d < n} | {n} | set(range(c, n, c))


def test_block_settings_refuse_nonsense_with_the_field_and_range():
    for bad in (0, -1, 1 << 21, 2.5, True):
        with pytest.raises(
            ValueError, match=r"block_tokens is .*; give a whole number of tokens from 1 to"
        ):
            BlockSettings(block_tokens=bad)


# --- shared prefixes stored once; edits re-prefill from the edit ---------------------------


@pytest.fixture(scope="module")
def dense(demo_models):
    return demo_models.load("dense")


@pytest.fixture(scope="module")
def hybrid(demo_models):
    return demo_models.load("hybrid")


def test_agents_sharing_a_preamble_store_it_once(dense, tmp_path):
    preamble = _text(1, 500)
    tails = [_text(100 + i, 40) for i in range(6)]
    report = _build(dense, _agents(tmp_path / "agents.json", preamble, tails), tmp_path / "shared")
    assert report.ok
    n = [e.n_tokens for e in report.entries]
    common = min(n) - 60  # well inside the preamble
    # a rough unique-token count
    per_token = _bytes(tmp_path / "shared" / "blocks") / (max(n) + sum(x - common for x in n))
    # One store per agent, the way a v2 store held them: what sharing saves.
    whole = sum(
        _bytes(tmp_path / f"solo{i}" / "blocks")
        for i in range(len(tails))
        if _build(
            dense, _agents(tmp_path / f"a{i}.json", preamble, [tails[i]]), tmp_path / f"solo{i}"
        ).ok
    )
    shared = _bytes(tmp_path / "shared" / "blocks")
    assert shared < whole / 3, (shared, whole, per_token)
    store = Store.open(tmp_path / "shared")
    tokens = [store.inspect(store.path_for(e.key)).tokens for e in report.entries]
    assert report.entries[0].tokens_reused == 0
    for i, e in enumerate(report.entries[1:], 1):
        shared_with_earlier = max(_lcp(tokens[i], tokens[j]) for j in range(i))
        # Siblings that part inside a block are cut where they part: all of the shared prefix.
        assert e.tokens_reused == shared_with_earlier > common // 2
    assert all(e.tokens_prefilled == e.n_tokens - e.tokens_reused for e in report.entries)


@pytest.mark.parametrize("model,bound", [("dense", "block_tokens"), ("hybrid", "checkpoint_every")])
def test_editing_the_last_sentence_prefills_at_most_one_block_or_checkpoint_span(
    demo_models, tmp_path, model, bound
):
    lm = demo_models.load(model)
    blocks = BlockSettings(64, 256)
    preamble = _text(2, 400)
    tails = [_text(200 + i, 30) for i in range(3)]
    agents_file = _agents(tmp_path / "agents.json", preamble, tails)
    first = _build(lm, agents_file, tmp_path / "s", blocks=blocks)
    store = Store.open(tmp_path / "s")
    old_tokens = store.inspect(store.path_for(first.entries[1].key)).tokens
    tails[1] = tails[1][: -len(tails[1].split()[-1])] + "and one more sentence at the end."
    _agents(agents_file, preamble, tails)
    report = _build(lm, agents_file, tmp_path / "s", blocks=blocks)
    by_name = {e.name: e for e in report.entries}
    assert [by_name[f"agent{i}"].status for i in range(3)] == ["reused", "built", "reused"]
    assert by_name["agent0"].tokens_prefilled == by_name["agent2"].tokens_prefilled == 0
    edited = by_name["agent1"]
    changed = edited.n_tokens - _lcp(old_tokens, store.inspect(store.path_for(edited.key)).tokens)
    assert 0 < changed < 30
    assert 0 < edited.tokens_prefilled <= getattr(blocks, bound) + changed, edited
    assert edited.tokens_reused + edited.tokens_prefilled == edited.n_tokens


def test_a_new_agent_with_the_shared_preamble_reuses_it(dense, tmp_path):
    blocks = BlockSettings(64, 256)
    preamble = _text(3, 300)
    agents_file = _agents(tmp_path / "agents.json", preamble, [_text(300, 20), _text(301, 20)])
    first = _build(dense, agents_file, tmp_path / "s", blocks=blocks)
    _agents(agents_file, preamble, [_text(300, 20), _text(301, 20), _text(302, 20)])
    report = _build(dense, agents_file, tmp_path / "s", blocks=blocks)
    new = report.entries[2]
    shared = min(e.n_tokens for e in first.entries) - 40
    assert new.status == "built" and new.tokens_reused >= shared // 64 * 64 - 64


# --- bad blocks ----------------------------------------------------------------------------


def _flip(path: Path, at: int = -9) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x01
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing", "swapped"])
def test_a_bad_block_is_refused_by_name_and_rebuilt_from_the_last_good_block(
    dense, tmp_path, damage
):
    blocks = BlockSettings(64, 256)
    agents_file = _agents(tmp_path / "agents.json", _text(4, 200), [_text(400, 20)])
    first = _build(dense, agents_file, tmp_path / "s", blocks=blocks)
    store = Store.open(tmp_path / "s")
    info = store.inspect(store.path_for(first.entries[0].key))
    rels = chain_relpaths(info)
    victim = store.root / rels[2]  # the third block: two good ones before it
    other = store.root / rels[0]
    if damage == "flipped":
        _flip(victim)
    elif damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif damage == "missing":
        victim.unlink()
    else:
        shutil.copyfile(other, victim)
    with pytest.raises(SnapshotError) as exc:
        store.verify_file(info.path)
    assert exc.value.path == str(victim), exc.value
    with pytest.raises(SnapshotError) as exc:
        store.load_arrays(info)
    assert exc.value.path == str(victim)

    report = _build(dense, agents_file, tmp_path / "s", blocks=blocks)
    entry = report.entries[0]
    assert entry.status == "built" and any("replacing a bad snapshot" in w for w in entry.warnings)
    _, start, _ = info.chain.blocks[2]
    assert entry.tokens_reused == start  # everything before the bad block came back from the store
    store.verify_file(info.path)


def test_a_record_cannot_name_another_models_or_prefixs_block(dense, tmp_path):
    """The chain is proven against the record's own tokens and model at inspect time."""
    from kvsnap.snapshot.file import read_header

    agents_file = _agents(tmp_path / "agents.json", _text(5, 100), [_text(500, 10), _text(501, 10)])
    report = _build(dense, agents_file, tmp_path / "s", blocks=BlockSettings(32, 256))
    store = Store.open(tmp_path / "s")
    a, b = (store.path_for(e.key) for e in report.entries)
    header_a = read_header(a)
    chain = json.loads(header_a.metadata["kvsnap.chain"])
    # agent b's own last block
    other = json.loads(read_header(b).metadata["kvsnap.chain"])["blocks"][-1][0]
    chain["blocks"][-1][0] = other  # same span, another prompt's key: only the key proof can tell
    meta = dict(header_a.metadata)
    meta["kvsnap.chain"] = json.dumps(chain, sort_keys=True, separators=(",", ":"))
    meta.pop("kvsnap.xxh3_128")
    import struct

    from kvsnap.snapshot.file import OutTensor

    tokens = store.inspect(a).tokens
    with store.lock():
        store.put(
            a.stem,
            [
                OutTensor(
                    "tokens",
                    "I32",
                    (len(tokens),),
                    memoryview(struct.pack(f"<{len(tokens)}i", *tokens)),
                )
            ],
            meta,
        )
    with pytest.raises(
        SnapshotError,
        match=r"kvsnap.chain.blocks\[\d+\] key [0-9a-f]{32} is not the key of these tokens",
    ):
        store.inspect(a)


def test_gc_keeps_every_block_a_record_reaches(dense, tmp_path):
    agents_file = _agents(tmp_path / "agents.json", _text(6, 200), [_text(600, 20), _text(601, 20)])
    report = _build(dense, agents_file, tmp_path / "s", blocks=BlockSettings(64, 256))
    store = Store.open(tmp_path / "s")
    before = part_files(store)
    assert store.gc(apply=True) == ([], 0)
    assert part_files(store) == before
    for e in report.entries:
        store.verify_file(store.path_for(e.key))


# --- compatibility: v2 stores are read, and migrated by one command ------------------------


def test_migrate_turns_a_v2_store_into_records_and_blocks_with_the_same_state(tmp_path):
    """The checked-in golden store was written by kvsnap before blocks (format 2)."""
    import numpy as np

    from kvsnap.store.migrate import migrate_store

    golden = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "store-dense"
    shutil.copytree(golden, tmp_path / "s")
    store = Store.open(tmp_path / "s")
    before = {}
    for info in store.scan()[0]:
        assert info.chain is None  # v2: read as it is, never ignored
        before[info.key] = {k: np.array(v) for k, v in store.load_arrays(info).items()}
    manifest = (tmp_path / "s" / "manifest.json").read_bytes()

    report = migrate_store(tmp_path / "s", BlockSettings(32, 256))
    assert len(report.migrated) == len(before) and not report.problems
    infos = store.scan()[0]
    # same keys, same file names: the manifest still lists them
    assert {i.key for i in infos} == set(before)
    assert (tmp_path / "s" / "manifest.json").read_bytes() == manifest
    for info in infos:
        assert info.chain is not None and len(info.chain.blocks) > 1
        store.verify_file(info.path)
        after = store.load_arrays(info)
        assert set(after) == set(before[info.key])
        for name, array in after.items():
            # A block two files share holds the first file's values: its own prefill of the same
            # tokens, equal up to float rounding (a build's blocks are bitwise: block-split
            # prefill).
            assert np.allclose(np.array(array), before[info.key][name], rtol=1e-5, atol=1e-5), name
    assert store.gc(apply=False) == ([], 0)  # every block is reached
    again = migrate_store(tmp_path / "s")
    assert again.migrated == [] and again.already == len(before)


def test_a_hybrid_record_lists_the_checkpoints_it_passes_through_even_when_reused(hybrid, tmp_path):
    """The second agent restores from the branch-point checkpoint the first one wrote; its own
    record must still name it (gc keeps what a record names; partial hits start from it)."""
    agents_file = _agents(tmp_path / "agents.json", _text(8, 300), [_text(800, 30), _text(801, 30)])
    report = _build(hybrid, agents_file, tmp_path / "s", blocks=BlockSettings(64, 128))
    store = Store.open(tmp_path / "s")
    chains = [store.inspect(store.path_for(e.key)).chain for e in report.entries]
    assert report.entries[1].tokens_reused > 0
    first, second = ({end for _, end in c.checkpoints} for c in chains)
    shared_ends = {end for _, _, end in chains[1].blocks} & {end for _, _, end in chains[0].blocks}
    assert (
        {e for e in first if e in shared_ends} == {e for e in second if e in shared_ends} != set()
    )


# --- held once in memory -------------------------------------------------------------------


def test_a_server_pins_a_shared_preamble_once_and_answers_from_it(demo_models, tmp_path):
    """Six agents, one preamble: the pinned bytes are the unique blocks' (not six copies), and
    an agent's request hits its whole prefix and answers as a cold server does."""
    import httpx

    from kvsnap.tools.serverproc import start_server

    lm = demo_models.load("dense")
    preamble = _text(9, 400)
    agents_file = _agents(
        tmp_path / "agents.json", preamble, [_text(900 + i, 30) for i in range(6)]
    )
    report = _build(lm, agents_file, tmp_path / "s")
    store = Store.open(tmp_path / "s")
    # headers included: an upper bound on the tensors
    unique = sum(p.stat().st_size for p in part_files(store))
    whole = sum(store.inspect(store.path_for(e.key)).nbytes for e in report.entries)
    # Six whole states against the shared grid blocks plus six tails (cuts sit on a fixed 256-token
    # grid, so each tail starts at the last grid cut inside the preamble): well over twice.
    assert whole > 2.2 * unique, (whole, unique)
    messages = json.loads(agents_file.read_text())[3]["messages"] + [
        {"role": "user", "content": "Check the tests first."}
    ]
    body = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0}
    answers = {}
    for mode, flags in (
        (
            "snapshots",
            [
                "--warm-prompts",
                str(agents_file),
                "--kv-snapshots",
                str(tmp_path / "s"),
                "--no-write-back",
            ],
        ),
        ("cold", []),
    ):
        server = start_server(
            demo_models.path("dense"),
            ["--continuous-batching", "--served-model-name", "m", *flags],
            tmp_path / f"{mode}.log",
            limit_s=300,
        )
        try:
            server.wait_ready(120)
            pinned = server.status()["cache"]["current_memory_mb"] * 2**20
            with httpx.Client(timeout=120) as client:
                answers[mode] = client.post(f"{server.url}/v1/chat/completions", json=body).json()
        finally:
            server.stop()
        if mode == "snapshots":
            assert 0.8 * unique < pinned <= 1.1 * unique, (pinned, unique, whole)
    assert (
        answers["snapshots"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        == report.entries[3].n_tokens
    )
    assert (
        answers["snapshots"]["choices"][0]["message"]["content"]
        == answers["cold"]["choices"][0]["message"]["content"]
    )
