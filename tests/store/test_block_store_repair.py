"""A rebuild repairs every bad part of a chain, and gc during a build is safe.

- A bad intermediate checkpoint of a hybrid record was never repaired: the rebuild saw the
  record fail, "replaced a bad snapshot", restored from the end checkpoint (which never reads
  the intermediate one), wrote nothing, and verify and pack kept failing.
- A hybrid build that restored from stored checkpoints died with ``KeyError`` in
  ``write_chain`` when a gc between its prefill and its commit removed one of them.

Real tiny hybrid model, the real build pipeline, real files, the store's named fault points.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvsnap.build.pipeline import build_snapshots
from kvsnap.errors import SnapshotError
from kvsnap.prompts import load_warm_prompts
from kvsnap.snapshot.blocks import BlockSettings
from kvsnap.store.archive import pack
from kvsnap.store.local import Store
from kvsnap.store.paths import chain_relpaths

WORDS = (
    "alpha beta gamma delta house rules tools call search answer review code check tests".split()
)
BLOCKS = BlockSettings(32, 64)


def _text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _agents(path: Path, contents: dict[str, str]) -> Path:
    path.write_text(
        json.dumps(
            [
                {"name": n, "messages": [{"role": "system", "content": c}]}
                for n, c in contents.items()
            ]
        )
    )
    return path


def _build(lm, agents_file: Path, store: Store):
    return build_snapshots(
        lm, load_warm_prompts(agents_file), store, str(agents_file), blocks=BLOCKS
    )


def _damage(path: Path, how: str, other: Path) -> None:
    if how == "flipped":
        data = bytearray(path.read_bytes())
        data[-9] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    else:  # forged: another checkpoint's whole file under this one's name
        path.write_bytes(other.read_bytes())


@pytest.fixture(scope="module")
def hybrid(demo_models):
    return demo_models.load("hybrid")


@pytest.mark.parametrize("how", ["flipped", "truncated", "forged"])
def test_a_bad_intermediate_checkpoint_of_a_hybrid_is_rewritten_by_a_rebuild(hybrid, tmp_path, how):
    agents_file = _agents(tmp_path / "agents.json", {"a": _text(1, 120)})
    store = Store.open(tmp_path / "s", create=True)
    first = _build(hybrid, agents_file, store)
    assert first.ok, first.entries
    info = store.inspect(store.path_for(first.entries[0].key))
    ends = [end for _, end in info.chain.checkpoints]
    assert len(ends) >= 3 and ends[-1] == info.n_tokens  # intermediate ones, then the end's
    victim = store.root / "checkpoints" / f"{info.chain.checkpoints[0][0]}.safetensors"
    _damage(victim, how, store.root / "checkpoints" / f"{info.chain.checkpoints[1][0]}.safetensors")
    with pytest.raises(SnapshotError) as exc:
        store.verify_file(info.path)
    assert exc.value.path == str(victim)

    report = _build(hybrid, agents_file, store)
    entry = report.entries[0]
    assert report.ok and entry.status == "built", entry
    # prefilled through the bad checkpoint's point, to recapture it
    assert entry.tokens_reused < ends[0]
    store.verify_file(store.path_for(entry.key))
    assert pack(store.root, tmp_path / "s.tar").files  # pack refuses a store that fails verify
    again = _build(hybrid, agents_file, store)
    assert again.entries[0].status == "reused" and again.entries[0].tokens_prefilled == 0


def test_a_bad_block_after_the_last_checkpoint_restored_is_rewritten(hybrid, tmp_path):
    """A block past the restore point is prefilled anyway; a bad one there must not be kept."""
    agents_file = _agents(tmp_path / "agents.json", {"a": _text(2, 120)})
    store = Store.open(tmp_path / "s", create=True)
    first = _build(hybrid, agents_file, store)
    info = store.inspect(store.path_for(first.entries[0].key))
    # the end's
    (store.root / "checkpoints" / f"{info.chain.checkpoints[-1][0]}.safetensors").unlink()
    rels = chain_relpaths(info)
    last_block = store.root / rels[len(info.chain.blocks) - 1]
    _damage(last_block, "flipped", last_block)
    report = _build(hybrid, agents_file, store)
    assert report.ok, report.entries
    store.verify_file(store.path_for(report.entries[0].key))


def test_gc_between_a_hybrid_builds_prefill_and_its_commit_never_breaks_it(hybrid, tmp_path):
    """The build restores from checkpoints no manifest record names any more (their agent left
    the agents file); a gc at ``after-prefill`` removes them before the build commits."""
    store_root = tmp_path / "s"
    shared = _text(3, 100)
    agents_file = _agents(tmp_path / "agents.json", {"a": f"{shared} {_text(4, 10)}"})
    assert _build(hybrid, agents_file, Store.open(store_root, create=True)).ok
    _agents(agents_file, {"z": _text(5, 20)})  # a leaves: its record and parts are gc-able
    assert _build(hybrid, agents_file, Store.open(store_root)).ok
    collected = []

    def gc_after_prefill(point: str) -> None:
        if point == "after-prefill" and not collected:
            collected.append(Store.open(store_root).gc(apply=True)[0])

    # shares a's preamble
    _agents(agents_file, {"z": _text(5, 20), "b": f"{shared} {_text(6, 10)}"})
    report = _build(hybrid, agents_file, Store.open(store_root, fault=gc_after_prefill))
    entry = {e.name: e for e in report.entries}["b"]
    assert collected and any(p.parent.name == "checkpoints" for p in collected[0])  # gc really ran
    assert report.ok and entry.status == "built", entry
    assert entry.tokens_reused > 0  # it had restored from the checkpoints gc then removed
    store = Store.open(store_root)
    for e in report.entries:
        store.verify_file(store.path_for(e.key))  # no record names a missing part
    assert store.gc(apply=False) == ([], 0)  # every part on disk is one a record names
