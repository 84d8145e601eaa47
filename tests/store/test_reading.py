"""Reading a chain's parts: blocks read at once (a barrier only two reads in flight together
pass), the arrays the same as read one by one, the first bad part in chain order named when
several are bad, and parts already in the server's pool read by no extra thread.

Real tiny models, the real build pipeline, real files.
"""

from __future__ import annotations

import io
import json
import random
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.forged import widened_block

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


# --- parts received from a shared tier into mlx memory ------------------------------------------

SECRET = b"s" * 32
MODEL_NAME = "kvsnap:t2:m:kv:ns:block:"


def _receive(store, info, key: str, value: bytes, placed: list, size: int | None = None):
    """``receive_part`` of a sealed value of block ``key`` (a reader over its bytes, saying
    it holds ``size``), each buffer it asks for recorded in ``placed``."""
    from kvsnap.store.fileio import unfilled_tensors
    from kvsnap.store.tier_backends import BytesValue
    from kvsnap.store.tier_values import BLOCK, receive_part

    def place(header):
        view, arrays = unfilled_tensors(header)
        placed.append(view)
        return view, arrays

    class Reader(BytesValue):
        @property
        def size(self) -> int:
            return len(value) if size is None else size

    reader = Reader(memoryview(value), "test")
    path = part_path(store, BLOCK_KIND, key)
    model = info.model_digest
    return receive_part(reader, SECRET, MODEL_NAME + key, BLOCK, model, "block", path, place)


def _sealed(info, key: str, data: bytes) -> bytes:
    from kvsnap.store.tier_values import BLOCK, seal

    return seal(SECRET, MODEL_NAME + key, BLOCK, info.model_digest, data)


def test_parts_received_from_a_tier_load_as_the_very_arrays_received(built):
    """A shared tier's parts arrive straight into mlx buffers (``receive_part``) and the cache
    loads those arrays as they are: no copy between the network and the cache, the same
    values as the files'; a received part of another span is refused as a file would be."""
    from kvsnap.store.tier_values import ReceivedPart

    store, info = built
    from_files, _ = load_composed(store, info, BlockPool())
    spans = chain_of(info).blocks
    received = {}
    for key, _, _ in spans:
        data = part_path(store, BLOCK_KIND, key).read_bytes()
        placed: list = []
        part = _receive(store, info, key, _sealed(info, key, data), placed)
        assert isinstance(part, ReceivedPart) and part.runs == (placed[0],)
        assert part.runs[0] is placed[0] and part.nbytes == len(data)
        assert bytes(part.head) + bytes(part.runs[0]) == data  # what the keeper writes
        received[(BLOCK_KIND, key)] = part
    checkpoints = (
        {("checkpoint", p.stem): p.read_bytes() for p in (store.root / "checkpoints").rglob("*")}
        if (store.root / "checkpoints").is_dir()
        else {}
    )
    loaded, _ = load_composed(store, info, BlockPool(), in_memory={**received, **checkpoints})
    for (key, _, _), (_, _, block), (_, _, want) in zip(spans, loaded.blocks, from_files.blocks):
        for name, array in block.arrays.items():
            assert array is received[(BLOCK_KIND, key)].held[name]  # not copied
            assert mx.array_equal(array, want.arrays[name]).item()
    swapped = {**received, (BLOCK_KIND, spans[1][0]): received[(BLOCK_KIND, spans[0][0])]}
    with pytest.raises(SnapshotError):
        load_composed(store, info, BlockPool(), in_memory={**swapped, **checkpoints})


def test_a_received_part_flipped_truncated_or_foreign_is_refused(built):
    """Checked as it arrives: a flipped data byte fails the MAC (the buffer it filled is
    dropped), a value cut short is the tier's failure (never a short part), and a value sealed
    under another name is refused before any buffer is made for it."""
    from kvsnap.snapshot.file import FormatError
    from kvsnap.store.tier_backends import TierUnavailable

    store, info = built
    key, other = chain_of(info).blocks[0][0], chain_of(info).blocks[1][0]
    value = bytearray(_sealed(info, key, part_path(store, BLOCK_KIND, key).read_bytes()))
    value[-100] ^= 0x01
    with pytest.raises(FormatError, match="MAC"):
        _receive(store, info, key, bytes(value), [])
    value[-100] ^= 0x01
    _receive(store, info, key, bytes(value), [])  # sound again
    with pytest.raises(TierUnavailable, match="ended"):  # the tier said more than it sent
        _receive(store, info, key, bytes(value[:-1]), [], size=len(value))
    placed: list = []
    foreign = _sealed(info, other, part_path(store, BLOCK_KIND, other).read_bytes())
    with pytest.raises(FormatError, match="name"):
        _receive(store, info, key, foreign, placed)
    assert placed == []


# --- a record's blocks received into one buffer per tensor (store/tier_layout) ------------------


def _receive_all(store, info, layout, stop_after: int | None = None, skip: int = 0) -> dict:
    """Every block of ``info`` received from its sealed value through ``layout`` (a block it
    refuses into a buffer of its own, as the shared tier does)."""
    from kvsnap.store.fileio import unfilled_tensors
    from kvsnap.store.tier_backends import BytesValue
    from kvsnap.store.tier_values import BLOCK, receive_part

    received = {}
    for key, _, _ in chain_of(info).blocks[skip:stop_after]:
        data = part_path(store, BLOCK_KIND, key).read_bytes()

        def place(header, key=key):
            return layout.place(key, header) or unfilled_tensors(header)

        reader = BytesValue(memoryview(_sealed(info, key, data)), "test")
        path = part_path(store, BLOCK_KIND, key)
        part = receive_part(
            reader, SECRET, MODEL_NAME + key, BLOCK, info.model_digest, "block", path, place
        )
        assert bytes(part.head) + b"".join(bytes(r) for r in part.runs) == data  # the keeper's
        received[(BLOCK_KIND, key)] = part
    return received


def _finish(layout, received: dict):
    """``layout.finish`` of the received blocks (``received`` updated as the tier's is)."""
    blocks = {key: part for (kind, key), part in received.items() if kind == BLOCK_KIND}
    buffers = layout.finish(blocks)
    received.update({(BLOCK_KIND, key): part for key, part in blocks.items()})
    return buffers


def test_a_records_blocks_received_into_one_buffer_per_tensor_are_views_of_it(built):
    """A fetch of every block of a record receives each block's tensors into their tokens'
    place in one buffer per tensor: the blocks load as views of it (the same values as the
    files'), and the state keeps the buffers, all its tokens in a row with room after."""
    from kvsnap.runtime.cache.composed import ComposedState
    from kvsnap.store.tier_layout import ChainLayout

    store, info = built
    from_files, _ = load_composed(store, info, BlockPool())
    spans = chain_of(info).blocks
    layout = ChainLayout(spans, info.n_tokens, room=64)
    received = _receive_all(store, info, layout)
    buffers = _finish(layout, received)
    assert buffers is not None and buffers.arrays.keys() == from_files.blocks[0][2].arrays.keys()
    assert buffers.n == info.n_tokens and buffers.capacity == info.n_tokens + 64
    checkpoints = (
        {("checkpoint", p.stem): p.read_bytes() for p in (store.root / "checkpoints").rglob("*")}
        if (store.root / "checkpoints").is_dir()
        else {}
    )
    loaded, _ = load_composed(
        store, info, BlockPool(), in_memory={**received, **checkpoints}, buffers=buffers
    )
    assert isinstance(loaded, ComposedState) and loaded.buffers is buffers
    for (start, end, block), (_, _, want) in zip(loaded.blocks, from_files.blocks):
        for name, array in block.arrays.items():
            assert mx.array_equal(array, want.arrays[name]).item(), (start, name)
            assert mx.array_equal(buffers.arrays[name][..., start:end, :], array).item()
    # views, not copies: a byte written into the buffer shows in the block's array
    first = next(iter(buffers.arrays))
    start, end, block = loaded.blocks[-1]
    old = block.arrays[first] + 0  # a copy of its values
    mx.eval(old)
    row = buffers.arrays[first].shape[-1] * buffers.arrays[first].itemsize
    buffers._bytes[first][(end - 1) * row : end * row] = b"\x7f" * row
    assert not mx.array_equal(block.arrays[first], old).item()


def test_blocks_received_before_the_buffers_are_made_are_copied_in(built):
    """The buffers are made on a thread of their own beside the receiving: the blocks that
    arrive first go into buffers of their own and are copied in at the end (their parts then
    view the record's buffers), the rest straight into place; the record is whole either way
    and holds the files' values."""
    import concurrent.futures

    from kvsnap.store.tier_layout import ChainLayout

    store, info = built
    from_files, _ = load_composed(store, info, BlockPool())
    spans = chain_of(info).blocks
    gate = threading.Event()
    made = []

    def allocate(fn):
        def later():
            gate.wait(20)
            fn()
            made.append(True)

        return pool.submit(later)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        layout = ChainLayout(spans, info.n_tokens, allocate=allocate)
        early = _receive_all(store, info, layout, stop_after=2)  # before the buffers exist
        gate.set()
        while not made:
            time.sleep(0.01)
        later = _receive_all(store, info, layout, skip=2)
        received = {**early, **later}
        buffers = _finish(layout, received)
    assert buffers is not None
    for i, ((start, end, want), (key, _, _)) in enumerate(zip(from_files.blocks, spans)):
        part = received[(BLOCK_KIND, key)]
        for name, array in want.arrays.items():
            assert mx.array_equal(buffers.arrays[name][..., start:end, :], array).item(), i
            assert mx.array_equal(part.held[name], array).item(), i
        assert (
            b"".join(bytes(r) for r in part.runs)
            == part_path(store, BLOCK_KIND, key).read_bytes()[len(part.head) :]
        )  # what the keeper writes
    # the early parts now view the record's buffers: a byte written there shows in them
    first = next(iter(buffers.arrays))
    start, end, _ = from_files.blocks[0]
    part = received[(BLOCK_KIND, spans[0][0])]
    old = part.held[first] + 0
    mx.eval(old)
    row = buffers.arrays[first].shape[-1] * buffers.arrays[first].itemsize
    buffers._bytes[first][start * row : (start + 1) * row] = b"\x7f" * row
    assert not mx.array_equal(part.held[first], old).item()


def test_a_fetched_records_buffers_take_the_tokens_that_continue_it_once(built):
    """The room after a fetched record's tokens takes the KV of the request that continues
    it: the kept prefix is views of the buffers (its values the concatenation's), a longer
    prompt + reply appends to what is there, and a request that branches off (other tokens),
    or does not fit the room, gets None (it copies, as before)."""
    from kvsnap.store.tier_layout import ChainLayout

    store, info = built
    layout = ChainLayout(chain_of(info).blocks, info.n_tokens, room=16)
    buffers = _finish(layout, _receive_all(store, info, layout))
    assert buffers is not None
    n = buffers.n

    def tails(k: int, seed: int) -> dict:
        return {
            name: mx.random.normal((*a.shape[:-2], k, a.shape[-1]), key=mx.random.key(seed))
            for name, a in buffers.arrays.items()
        }

    first = tails(5, 1)
    prompt = buffers.extend([7, 8, 9, 10, 11], first)
    assert prompt is not None
    for name, view in prompt.items():
        want = mx.concatenate([buffers.arrays[name][..., :n, :], first[name]], axis=-2)
        assert view.shape[-2] == n + 5 and mx.array_equal(view, want).item(), name
    longer = {name: mx.concatenate([first[name], t], axis=-2) for name, t in tails(3, 2).items()}
    reply = buffers.extend([7, 8, 9, 10, 11, 12, 13, 14], longer)
    assert reply is not None
    for name, view in reply.items():
        assert mx.array_equal(view[..., n : n + 5, :], first[name]).item()  # as it was
        assert mx.array_equal(view[..., n:, :], longer[name]).item()
    assert buffers.extend([7, 8, 9, 99], tails(4, 3)) is None  # a branch: the room is taken
    assert buffers.extend([7, 8, 9, 10, 11], first) is not None  # the same tokens: views again
    assert buffers.extend(list(range(17)), tails(17, 4)) is None  # past the room
    assert buffers.extend([7, 8], tails(3, 5)) is None  # KV of another length
    assert mx.array_equal(prompt[next(iter(prompt))][..., n:, :], first[next(iter(first))]).item()


def test_a_record_with_a_block_received_elsewhere_has_no_buffers(built):
    """A block received into a buffer of its own (it did not fit, or the store held it) leaves
    its tokens' place unfilled: the record is then its blocks only."""
    from kvsnap.store.tier_layout import ChainLayout

    store, info = built
    spans = chain_of(info).blocks
    layout = ChainLayout(spans[1:], info.n_tokens)  # the first block is not the layout's
    assert _finish(layout, _receive_all(store, info, layout)) is None
    assert ChainLayout(spans, info.n_tokens).finish({}) is None  # nothing placed yet


def test_a_fetched_record_read_as_a_shared_prefix_copies_nothing(demo_models, tmp_path):
    """The engine reads a fetched record as one prefix, as it reads a local hit's: the batch's
    shared prefix of its copy is views of the buffers it was received into (without them it
    concatenated the blocks: a whole copy of the KV, 1.9-4.4 s at 8k fp32 tokens), and the
    tokens are the files' (a greedy answer from it is a fresh prefill's:
    tests/runtime/persist/test_shared_tier_faults.py)."""
    from kvsnap.runtime.engine.batch_cache import shared_prefix_of
    from kvsnap.store.tier_layout import ChainLayout

    store, info = _store(demo_models.load("dense"), tmp_path / "s")
    from_files, _ = load_composed(store, info, BlockPool())
    layout = ChainLayout(chain_of(info).blocks, info.n_tokens)
    received = _receive_all(store, info, layout)
    buffers = _finish(layout, received)
    assert buffers is not None
    loaded, _ = load_composed(store, info, BlockPool(), in_memory=received, buffers=buffers)
    nbytes = sum(a.nbytes for a in buffers.head(info.n_tokens).values())
    tokens = tuple(info.tokens)
    mx.synchronize()
    before = mx.get_active_memory()
    prefixes = shared_prefix_of(loaded.materialize(room=8), tokens)
    assert prefixes is not None
    grew = mx.get_active_memory() - before
    assert grew < nbytes // 4, f"the shared prefix copied {grew} of {nbytes} bytes"
    want = from_files.materialize(room=8)
    for p, c in zip(prefixes, want):
        assert p.n == len(tokens)
        assert mx.array_equal(p.keys, c.keys[..., : p.n, :]).item()
        assert mx.array_equal(p.values, c.values[..., : p.n, :]).item()


# --- a fetched record's buffers: what may go wrong (store/tier_layout) -------------------------


def _sealed_sizes(store, info) -> dict:
    """Each block's file size, as the record's sealed header names them (``parts``)."""
    return {
        key: part_path(store, BLOCK_KIND, key).stat().st_size for key, _, _ in chain_of(info).blocks
    }


def _receive_one(store, info, layout, key: str, value: bytes):
    """Block ``key`` received from ``value`` through ``layout`` (into a buffer of its own when
    the layout refuses it), checked under the fleet's SECRET."""
    from kvsnap.store.fileio import unfilled_tensors
    from kvsnap.store.tier_backends import BytesValue
    from kvsnap.store.tier_values import BLOCK, receive_part

    def place(header):
        return layout.place(key, header) or unfilled_tensors(header)

    reader = BytesValue(memoryview(value), "test")
    path = part_path(store, BLOCK_KIND, key)
    return receive_part(
        reader, SECRET, MODEL_NAME + key, BLOCK, info.model_digest, "block", path, place
    )


def _immediate(asked: list):
    """An ``allocate`` that records each call and makes the buffers there and then."""
    import concurrent.futures

    def allocate(fn):
        asked.append(fn)
        done: concurrent.futures.Future = concurrent.futures.Future()
        fn()
        done.set_result(None)
        return done

    return allocate


def test_a_forged_block_header_makes_no_buffers_past_what_its_record_sealed(built):
    """A block's header is read before its MAC can be checked: a header planted in the tier
    by anyone without the fleet's secret must not size the record's buffers. A block whose
    file is not the size the record sealed is refused before any buffer is made (the fetch
    counts a bad value and prefills), and a block that would make more than the sealed sizes
    imply makes none (it is received into a buffer of its own, no larger than its value, and
    the MAC refuses it); the record's own blocks still make its buffers."""
    from kvsnap.snapshot.file import FormatError, parse_header
    from kvsnap.store.tier_layout import ROOM_TOKENS, ChainLayout
    from kvsnap.store.tier_values import BLOCK, seal

    store, info = built
    spans = chain_of(info).blocks
    sizes = _sealed_sizes(store, info)
    key = spans[0][0]
    forged = widened_block(part_path(store, BLOCK_KIND, key), widen=64)
    # what the forged header would have this replica zero: its tokens' bytes x capacity
    data_len = parse_header(io.BytesIO(forged), len(forged)).data_len
    would = data_len // (spans[0][2] - spans[0][1]) * (info.n_tokens + ROOM_TOKENS)
    assert would > 10 * sum(sizes.values()), (would, sizes)
    value = seal(b"attacker" * 4, MODEL_NAME + key, BLOCK, info.model_digest, forged)
    asked: list = []
    layout = ChainLayout(spans, info.n_tokens, allocate=_immediate(asked), sizes=sizes)
    with pytest.raises(FormatError, match="sealed"):
        _receive_one(store, info, layout, key, value)
    assert asked == [] and layout._arrays == {}
    assert layout.finish({}) is None

    # the sealed sizes bound the buffers whatever the block's file size: a record that sealed
    # less than a block's header implies gets no buffers (its own blocks always fit)
    small = {k: (size if k == key else 1) for k, size in sizes.items()}
    asked = []
    layout = ChainLayout(spans, info.n_tokens, allocate=_immediate(asked), sizes=small)
    data = part_path(store, BLOCK_KIND, key).read_bytes()
    part = _receive_one(store, info, layout, key, _sealed(info, key, data))
    assert asked == [] and len(part.runs) == 1 and len(part.runs[0]) == part.header.data_len

    asked = []
    layout = ChainLayout(spans, info.n_tokens, allocate=_immediate(asked), sizes=sizes)
    received = _receive_all(store, info, layout)
    assert len(asked) == 1 and _finish(layout, received) is not None


def test_a_placed_block_flipped_or_foreign_leaves_its_record_without_buffers(
    built,
):
    """A block received straight into the record's buffers is checked as one received into
    its own: a flipped byte, or a sound file sealed without the fleet's secret, fails the MAC,
    and the record whose block was refused never yields its buffers (their bytes of that block
    are the refused ones)."""
    from kvsnap.snapshot.file import FormatError
    from kvsnap.store.tier_layout import ChainLayout
    from kvsnap.store.tier_values import BLOCK, seal

    store, info = built
    spans = chain_of(info).blocks
    layout = ChainLayout(spans, info.n_tokens, sizes=_sealed_sizes(store, info))
    received = _receive_all(store, info, layout, stop_after=1)  # makes the buffers
    assert layout._ready
    flipped_key, foreign_key = spans[1][0], spans[2][0]
    value = bytearray(
        _sealed(info, flipped_key, part_path(store, BLOCK_KIND, flipped_key).read_bytes())
    )
    value[-100] ^= 0x01
    with pytest.raises(FormatError, match="MAC"):
        _receive_one(store, info, layout, flipped_key, bytes(value))
    data = part_path(store, BLOCK_KIND, foreign_key).read_bytes()
    foreign = seal(b"attacker" * 4, MODEL_NAME + foreign_key, BLOCK, info.model_digest, data)
    with pytest.raises(FormatError, match="MAC"):
        _receive_one(store, info, layout, foreign_key, foreign)
    received.update(_receive_all(store, info, layout, skip=3))
    assert set(layout._placed) == {key for key, _, _ in spans}  # every block went into place
    assert _finish(layout, received) is None


def test_a_record_whose_buffers_were_not_made_is_served_block_by_block(built, caplog):
    """The buffers are made on a thread of their own: when that fails (out of memory), is
    cancelled (shutdown) or is not done by the fetch's deadline, every block already sits
    checked in a buffer of its own: the record is served from them (a warning names it),
    never thrown away for the buffers."""
    import concurrent.futures

    from kvsnap.store.tier_layout import FINISH_SLACK_S, ChainLayout

    store, info = built
    from_files, _ = load_composed(store, info, BlockPool())
    spans = chain_of(info).blocks
    checkpoints = (
        {("checkpoint", p.stem): p.read_bytes() for p in (store.root / "checkpoints").rglob("*")}
        if (store.root / "checkpoints").is_dir()
        else {}
    )
    gate = threading.Event()

    def out_of_memory():
        raise MemoryError("mx.zeros of 1.9 GB")

    def held():
        gate.wait(30)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for how, allocate, deadline in (
            ("failed", lambda fn: pool.submit(out_of_memory), None),
            ("late", lambda fn: pool.submit(held), time.monotonic()),
        ):
            layout = ChainLayout(
                spans, info.n_tokens, allocate=allocate, deadline=deadline, record=f"rec-{how}"
            )
            received = _receive_all(store, info, layout)
            caplog.clear()
            started = time.monotonic()
            with caplog.at_level("WARNING", logger="kvsnap.tier"):
                assert _finish(layout, received) is None, how
            assert time.monotonic() - started < FINISH_SLACK_S + 5, how
            warned = [r.getMessage() for r in caplog.records]
            assert len(warned) == 1 and f"rec-{how}" in warned[0], warned
            assert ("MemoryError" if how == "failed" else "TimeoutError") in warned[0], warned
            loaded, _ = load_composed(
                store, info, BlockPool(), in_memory={**received, **checkpoints}
            )
            for (_, _, block), (_, _, want) in zip(loaded.blocks, from_files.blocks):
                for name, array in block.arrays.items():
                    assert mx.array_equal(array, want.arrays[name]).item(), (how, name)
        gate.set()


def test_an_abandoned_fetch_never_makes_its_records_buffers(built, caplog):
    """A fetch that missed a part or ran past its budget abandons its layout: buffers not
    started yet are never made (zeroing 1.9 GB for nothing beside the engine), and a
    ``finish`` after that serves nothing from them."""
    import concurrent.futures

    from kvsnap.store.tier_layout import ChainLayout

    store, info = built
    spans = chain_of(info).blocks
    gate = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(gate.wait, 30)  # the allocating thread is busy: the buffers wait
        layout = ChainLayout(spans, info.n_tokens, allocate=pool.submit)
        received = _receive_all(store, info, layout, stop_after=2)
        assert layout._made and not any(made.done() for made in layout._made)
        layout.abandon()
        gate.set()
    assert all(made.cancelled() for made in layout._made)
    assert not layout._ready and layout._arrays == {}
    received.update(_receive_all(store, info, layout, skip=2))
    with caplog.at_level("WARNING", logger="kvsnap.tier"):
        assert _finish(layout, received) is None
