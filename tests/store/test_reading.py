"""Reading a chain's parts: blocks read at once (a barrier only two reads in flight together
pass), the arrays the same as read one by one, the first bad part in chain order named when
several are bad, and parts already in the server's pool read by no extra thread.

Real tiny models, the real build pipeline, real files.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

import kvsnap.store.reading as store_reading
from kvsnap.build.pipeline import build_snapshots
from kvsnap.errors import SnapshotError
from kvsnap.prompts import load_warm_prompts
from kvsnap.runtime.cache.composed import BlockPool, load_composed
from kvsnap.snapshot.blocks import BlockSettings
from kvsnap.snapshot.format import BLOCK_KIND
from kvsnap.store import part_readers
from kvsnap.store.local import Store
from kvsnap.store.paths import chain_of, part_path
from kvsnap.store.reading import assemble, read_part

WORDS = "alpha beta gamma delta house rules tools call search answer review code tests".split()


def _store(lm, root: Path) -> tuple[Store, object]:
    """A store of one agent whose chain has several 32-token blocks (and checkpoints for a
    hybrid)."""
    rng = random.Random(7)
    text = " ".join(rng.choice(WORDS) for _ in range(150))
    agents = root.parent / f"{root.name}.json"
    agents.write_text(
        json.dumps([{"name": "a", "messages": [{"role": "system", "content": text}]}])
    )
    store = Store.open(root, create=True)
    report = build_snapshots(
        lm, load_warm_prompts(agents), store, str(agents), blocks=BlockSettings(32, 64)
    )
    assert report.ok, report.entries
    info = store.inspect(store.path_for(report.entries[0].key))
    assert len(chain_of(info).blocks) >= 4
    return store, info


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def built(request, demo_models, tmp_path_factory):
    return _store(demo_models.load(request.param), tmp_path_factory.mktemp("parts") / "s")


def _restore(how: str, store: Store, info) -> dict:
    if how == "assemble":
        return assemble(store, info)[0]
    state, _ = load_composed(store, info, BlockPool())
    return {
        f"{name}@{start}": block.arrays[name]
        for start, _, block in state.blocks
        for name in block.arrays
    }


@pytest.mark.parametrize("how", ["assemble", "load_composed"])
def test_a_chains_blocks_are_read_at_once(built, monkeypatch, how):
    store, info = built
    serial = _restore(how, store, info)
    # the first two reads wait for each other: read one after the other, they time out
    meet = threading.Barrier(2, timeout=20)
    calls = []

    def read(*args):
        calls.append(threading.current_thread().name)
        if len(calls) <= 2:
            meet.wait()
        return read_part(*args)

    monkeypatch.setattr(store_reading, "read_part", read)
    together = _restore(how, store, info)
    assert len(calls) >= len(chain_of(info).blocks)
    assert all(name.startswith("kvsnap-read") for name in calls)
    assert serial.keys() == together.keys()
    for name, a in serial.items():
        assert a.dtype == together[name].dtype
        assert mx.array_equal(a, together[name]).item(), name


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["assemble", "load_composed"])
def test_the_first_bad_block_in_chain_order_is_named_when_a_later_one_fails_sooner(
    demo_models, tmp_path, monkeypatch, how
):
    store, info = _store(demo_models.load("dense"), tmp_path / "s")
    keys = [key for key, _, _ in chain_of(info).blocks]
    first, later = part_path(store, BLOCK_KIND, keys[1]), part_path(store, BLOCK_KIND, keys[3])
    for path in (first, later):
        _flip_last_byte(path)

    def read(store_, kind, key, *rest):
        if key == keys[1]:
            time.sleep(0.3)  # the later bad block's error comes first
        return read_part(store_, kind, key, *rest)

    monkeypatch.setattr(store_reading, "read_part", read)
    with pytest.raises(SnapshotError) as err:
        _restore(how, store, info)
    assert str(first) in str(err.value) and str(later) not in str(err.value)
    assert "checksum mismatch" in str(err.value)


def test_parts_already_in_the_pool_start_no_reading_threads(built, monkeypatch):
    store, info = built
    pool = BlockPool()
    held = load_composed(store, info, pool)  # every part now held (the pool's values are weak)
    started = []
    real_start = part_readers._Reader.start

    def start(self):
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(part_readers._Reader, "start", start)
    # only a real read grows the pool here, not a slow moment of a busy machine
    monkeypatch.setattr(part_readers, "GROW_AFTER_S", 60.0)
    state, added = load_composed(store, info, pool)
    assert added == 0
    assert len(started) <= 1, started  # one reader took every cached part in turn
    assert held[0].blocks[0][2] is state.blocks[0][2]


def test_parts_held_in_memory_load_as_read_from_their_files_and_are_checked_the_same(
    built, monkeypatch
):
    """A record whose parts a shared tier's fetch holds in memory (``in_memory``) loads from
    those bytes, not the files, into the same arrays; a part whose bytes are another span's
    than the chain names is refused like a file would be."""
    store, info = built
    from_files, _ = load_composed(store, info, BlockPool())
    spans = chain_of(info).blocks
    held = {
        (BLOCK_KIND, key): part_path(store, BLOCK_KIND, key).read_bytes() for key, _, _ in spans
    }
    checkpoints = (
        {("checkpoint", p.stem): p.read_bytes() for p in (store.root / "checkpoints").rglob("*")}
        if (store.root / "checkpoints").is_dir()
        else {}
    )
    reads = []

    def read(store_, kind, key, *rest):
        reads.append((kind, key))
        return read_part(store_, kind, key, *rest)

    monkeypatch.setattr(store_reading, "read_part", read)
    from_memory, added = load_composed(store, info, BlockPool(), in_memory={**held, **checkpoints})
    assert added > 0 and not [r for r in reads if r[0] == BLOCK_KIND], reads
    for (start, _, a), (_, _, b) in zip(from_files.blocks, from_memory.blocks):
        assert a.arrays.keys() == b.arrays.keys()
        for name in a.arrays:
            assert mx.array_equal(a.arrays[name], b.arrays[name]).item(), (start, name)
    # the first block's bytes offered as the second's: named, refused
    swapped = {**held, (BLOCK_KIND, spans[1][0]): held[(BLOCK_KIND, spans[0][0])]}
    with pytest.raises(SnapshotError) as err:
        load_composed(store, info, BlockPool(), in_memory=swapped)
    assert str(part_path(store, BLOCK_KIND, spans[1][0])) in str(err.value)
