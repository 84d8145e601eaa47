"""A shared tier's fetch of a record into one buffer per tensor (store/tier_layout), in
process: replica A writes a real tiny model's record and blocks behind to a real folder tier,
replica B fetches them (``SharedTier.fetch``, the path a request takes). What B does when the
record's buffers cannot be made, when the fetch fails after they were asked for, and when a
block's header was planted in the tier by someone without the fleet's secret."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
from helpers.forged import widened_block
from helpers.shared_tier import open_shared_tier
from helpers.stores import build_store

from kvsnap.key import tokens_digest
from kvsnap.runtime.persist.options import TierOptions
from kvsnap.runtime.persist.shared_tier import ALLOC_THREADS, SharedTier, TierPush
from kvsnap.snapshot.blocks import BlockSettings
from kvsnap.snapshot.format import BLOCK_KIND
from kvsnap.store.conversations import read_parts, record_path
from kvsnap.store.local import Store
from kvsnap.store.paths import chain_of, part_path
from kvsnap.store.tier_backends import SECRET_ENV, FolderTier
from kvsnap.store.tier_values import BLOCK, seal

WORDS = "alpha beta gamma delta house rules tools call search answer review code tests".split()


class Allocator:
    """B's ``kvsnap-tier-alloc`` pool, watched: each buffer-making call it was given and its
    Future; ``fail`` makes them raise as mx.zeros out of memory does; ``gate`` holds the pool
    busy (the calls wait behind it)."""

    def __init__(self, fail: bool = False) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.fail = fail
        self.futures: list[concurrent.futures.Future] = []
        self.ran: list[bool] = []
        self.gate = threading.Event()
        self.gate.set()

    def hold(self) -> None:
        self.gate.clear()
        self.pool.submit(self.gate.wait, 30)

    def submit(self, fn):
        def make():
            if self.fail:
                raise MemoryError("mx.zeros: out of memory")
            fn()
            self.ran.append(True)

        future = self.pool.submit(make)
        self.futures.append(future)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self.gate.set()
        self.pool.shutdown(wait=wait, cancel_futures=cancel_futures)


@pytest.fixture()
def pair(demo_models, tmp_path, monkeypatch):
    """(A's store's record info, the folder tier holding it, a maker of B with an Allocator)."""
    monkeypatch.setenv(SECRET_ENV, "fleet-secret-" + "x" * 20)
    lm = demo_models.load("dense")
    rng = random.Random(11)
    text = " ".join(rng.choice(WORDS) for _ in range(150))
    agents = [{"name": "a", "messages": [{"role": "system", "content": text}]}]
    store = Store.open(build_store(lm, tmp_path / "a", agents, blocks=BlockSettings(32, 64)))
    (entry,) = store.snapshot_files()
    info = store.inspect(entry)
    assert len(chain_of(info).blocks) >= 4
    local = record_path(store.root, info.path.stem)  # as a persisted conversation's record
    local.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(info.path, local)
    (tmp_path / "tier").mkdir()
    made: list[SharedTier] = []

    def tier(root: Path) -> SharedTier:
        root.mkdir(exist_ok=True)
        t = open_shared_tier(
            FolderTier.open(tmp_path / "tier"),
            TierOptions(str(tmp_path / "tier")),
            lm.identity(),
            root,
        )
        made.append(t)
        return t

    a = tier(store.root)
    a.push(TierPush("", local.stem, info.n_tokens, tokens_digest(info.tokens), read_parts(info), 1))
    deadline = time.monotonic() + 20
    while a.as_dict()["queue_depth"] or not (a.stats.writes or a.stats.errors):
        assert time.monotonic() < deadline, a.as_dict()
        time.sleep(0.02)
    assert a.stats.errors == 0 and info.model_digest == lm.identity().digest, a.as_dict()

    def replica_b(allocator: Allocator) -> SharedTier:
        b = tier(tmp_path / "b")
        b._allocator.shutdown()
        b._allocator = allocator  # type: ignore[assignment]
        return b

    yield store, info, tmp_path / "tier", replica_b
    for t in made:
        t.close(1.0)


def block_files(tier_root: Path, store, info) -> list[Path]:
    """The tier's files of the record's blocks, in chain order."""
    by_key = {p.name: p for p in tier_root.rglob("*") if p.is_file() and p.parent.name == BLOCK}
    return [by_key[key] for key, _, _ in chain_of(info).blocks]


def test_a_fetch_whose_buffers_cannot_be_made_is_served_from_its_blocks(pair, caplog):
    """Every block sits checked in a buffer of its own when the record's buffers fail (out of
    memory on the allocating thread): the fetch is a hit, served block by block, with one
    warning naming the record, no error counted and the breaker left closed."""
    store, info, _, replica_b = pair
    allocator = Allocator(fail=True)
    b = replica_b(allocator)
    tokens = [*info.tokens, 5, 6]
    with caplog.at_level(logging.WARNING, logger="kvsnap.tier"):
        assert b.fetch(tokens, "") == info.n_tokens
    assert allocator.futures, "the buffers were never asked for"
    st = b.as_dict()
    assert st["hits"] == 1 and st["contiguous"] == 0 and st["errors"] == 0, st
    assert st["breaker"] == "closed"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "MemoryError" in warned[0] and "block by block" in warned[0]
    fetched = b.take_fresh(tokens, "", 0)
    assert fetched is not None and fetched.buffers is None
    for key, _, _ in chain_of(info).blocks:  # each block whole, as the file holds it
        part = fetched.parts[(BLOCK_KIND, key)]
        file = part_path(store, BLOCK_KIND, key).read_bytes()
        assert bytes(part.head) + b"".join(bytes(r) for r in part.runs) == file


def test_blocks_wait_for_the_records_buffers_instead_of_zeroing_their_own(pair, monkeypatch):
    """The record's buffers take a while to be made (fresh pages: ~0.6 s per 2 GB on two
    threads here): the blocks wait for them rather than each being received into a buffer of
    its own, which paid for the same fresh memory again beside them and a copy (the fetch took
    3.3-7.8 s so at 8k tokens). Every block lands in place; no block buffer of its own."""
    import kvsnap.runtime.persist.shared_tier as shared_tier_module

    store, info, _, replica_b = pair
    own: list = []
    real = shared_tier_module._mlx_buffer
    monkeypatch.setattr(shared_tier_module, "_mlx_buffer", lambda h: own.append(h) or real(h))
    allocator = Allocator()
    allocator.hold()  # the buffers wait behind the pool's other work ...
    threading.Timer(0.3, allocator.gate.set).start()  # ... for 0.3 s
    b = replica_b(allocator)
    tokens = [*info.tokens, 5, 6]
    assert b.fetch(tokens, "") == info.n_tokens
    st = b.as_dict()
    assert st["hits"] == 1 and st["contiguous"] == 1 and st["errors"] == 0, st
    assert own == [] and len(allocator.futures) == ALLOC_THREADS
    fetched = b.take_fresh(tokens, "", 0)
    assert fetched is not None and fetched.buffers is not None
    for key, _, _ in chain_of(info).blocks:  # each block whole, as the file holds it
        part = fetched.parts[(BLOCK_KIND, key)]
        file = part_path(store, BLOCK_KIND, key).read_bytes()
        assert bytes(part.head) + b"".join(bytes(r) for r in part.runs) == file


def test_a_fetch_that_misses_a_block_never_makes_the_records_buffers(pair):
    """A block gone from the tier ends the fetch (a miss, the request prefills) while the
    first block waits for the record's buffers: the fetch cancels them before they are zeroed
    (GBs at 8k tokens, beside the engine's steps, for nothing), and the waiting block stops
    waiting at once instead of at the fetch's deadline."""
    store, info, tier_root, replica_b = pair
    block_files(tier_root, store, info)[1].unlink()  # read beside the first block
    allocator = Allocator()
    allocator.hold()  # the buffers wait behind the pool's other work
    b = replica_b(allocator)
    started = time.monotonic()
    assert b.fetch([*info.tokens, 5, 6], "") == 0
    took = time.monotonic() - started
    assert b.as_dict()["misses"] == 1, (took, {k: v for k, v in b.as_dict().items() if v})
    assert took < b.options.budget_s / 2, (took, b.options.budget_s)
    assert len(allocator.futures) == ALLOC_THREADS
    allocator.gate.set()
    allocator.pool.shutdown(wait=True)
    assert all(f.cancelled() for f in allocator.futures) and not allocator.ran


def test_a_block_header_planted_without_the_secret_makes_no_buffers(pair):
    """Every block's value replaced by one sealed without the fleet's secret whose header
    claims 64 times the rows (its data there too): each is refused before any buffer is made
    for it (its file is not the size the record sealed), a bad value counted, the request
    prefills; nothing asked the allocating thread for the buffers its header implied."""
    store, info, tier_root, replica_b = pair
    for (key, _, _), file in zip(chain_of(info).blocks, block_files(tier_root, store, info)):
        forged = widened_block(part_path(store, BLOCK_KIND, key), widen=64)
        sealed = json.loads(file.read_bytes()[12 : 12 + int.from_bytes(file.read_bytes()[8:12])])
        file.write_bytes(seal(b"attacker" * 4, sealed["name"], BLOCK, sealed["model"], forged))
    allocator = Allocator()
    b = replica_b(allocator)
    assert b.fetch([*info.tokens, 5, 6], "") == 0
    st = b.as_dict()
    assert st["bad_values"] == 1 and st["hits"] == 0 and st["errors"] == 0, st
    assert allocator.futures == [], "a planted header sized the record's buffers"
