"""Damage in a store never spreads and never hides what is sound:
a bad block is rewritten by the next write behind that reaches it and no record names it
before; a torn newest record falls back to the next-longest one; a damaged record is
rewritten, and never kept young; a record whose header is not what its name promises is
refused. Real `kvsnap serve --persist-requests` processes and the tiny dense demo model;
every fault is made in the store's real files.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import time
from pathlib import Path

import httpx
import pytest
import xxhash
from helpers.cli import run_kvsnap
from helpers.persist_servers import (
    SYSTEMS,
    TURNS,
    Conversation,
    ask,
    assert_sound,
    cached,
    content,
    persist_status,
    start,
)

from kvsnap.snapshot.blocks import DEFAULT_BLOCK_TOKENS
from kvsnap.store.conversations import conversation_files
from kvsnap.store.local import Store

DAY = 86400.0
# One system prompt no agent has: the conversations on it share its first block, and only
# conversations reach it.
SHARED = SYSTEMS[1] * 3


def chat(salt: str) -> Conversation:
    return Conversation(SHARED, TURNS + ("And the logging?", "Anything else?"), salt)


class Talk:
    """The turns one conversation has had, across servers."""

    def __init__(self, conv: Conversation, model: Path):
        self.conv, self.model = conv, model
        self.answers: list[str] = []
        self.prompts: list[int] = []

    def next(self, client: httpx.Client, server) -> dict:
        reply = ask(client, server, self.conv.body(self.model, len(self.answers) + 1, self.answers))
        self.answers.append(content(reply))
        self.prompts.append(reply["usage"]["prompt_tokens"])
        return reply

    def again(self, client: httpx.Client, server) -> dict:
        """Its last turn's request once more (a client's retry)."""
        turn = len(self.answers)
        return ask(client, server, self.conv.body(self.model, turn, self.answers[: turn - 1]))


def settle(server, root: Path, written: int, timeout: float = 60.0) -> dict:
    """Wait until the writer has written ``written`` records and is done (the lock is free)."""
    deadline = time.monotonic() + timeout
    while True:
        persist = persist_status(server)
        if persist["written"] >= written and persist["queued"] == 0:
            break
        assert time.monotonic() < deadline, (written, persist, server.log()[-3000:])
        time.sleep(0.05)
    with Store.open(root).lock():
        pass
    return persist_status(server)


def records(root: Path) -> list:
    """Every conversation record's header, shortest first."""
    store = Store.open(root, readonly=True)
    return sorted((store.inspect(p) for p in conversation_files(root)), key=lambda i: i.n_tokens)


def flip_last_byte(path: Path) -> bytes:
    """One flipped bit in the file's last byte (tensor data): its checksum no longer matches.
    Returns the damaged bytes."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    return bytes(data)


def flip_header_byte(path: Path) -> None:
    """One digit of the record's creation date changed: the header still parses and its
    tokens still match their digest, only the checksum over every byte tells."""
    data = bytearray(path.read_bytes())
    at = data.index(b'"created')
    digit = next(i for i in range(at, at + 80) if chr(data[i]).isdigit())
    data[digit] = ord("1") if data[digit] != ord("1") else ord("2")
    path.write_bytes(bytes(data))


def record_is_sound(path: Path) -> bool:
    from kvsnap.errors import SnapshotError

    try:
        Store.open(path.parent.parent, readonly=True).verify_file(path)
    except SnapshotError:
        return False
    return True


@pytest.fixture(scope="module")
def dense(demo_models) -> Path:
    return demo_models.path("dense")


@pytest.fixture(scope="module")
def three_turns(dense, tmp_path_factory):
    """A store holding one conversation's three turns ("x"), written by a stopped server: the
    earlier turns kept up to their last whole block, the third whole. Tests copy it."""
    tmp = tmp_path_factory.mktemp("three-turns")
    root = tmp / "store"
    talk = Talk(chat("x"), dense)
    server = start(dense, root, tmp / "server.log")
    try:
        with httpx.Client(timeout=60) as client:
            for _ in range(3):
                talk.next(client, server)
        settle(server, root, 3)
    finally:
        server.stop()
    lengths = [info.n_tokens for info in records(root)]
    assert len(lengths) >= 2, (lengths, talk.prompts)
    assert lengths[-1] == talk.prompts[-1] - 1 and lengths[-2] % DEFAULT_BLOCK_TOKENS == 0
    assert lengths[-2] >= DEFAULT_BLOCK_TOKENS, lengths  # a shorter sound one worth having
    return root, talk


def copy_of(three_turns, tmp_path: Path) -> tuple[Path, Talk]:
    root, talk = three_turns
    dest = tmp_path / "store"
    shutil.copytree(root, dest)
    copied = Talk(talk.conv, talk.model)
    copied.answers, copied.prompts = list(talk.answers), list(talk.prompts)
    return dest, copied


# --- item 2: a bad block heals, and no record names it meanwhile -----------------------------


def test_a_bad_block_is_rewritten_by_the_next_write_and_every_record_naming_it_heals(
    dense, tmp_path
):
    """One flipped bit in the first block of a system prompt only conversations share: it
    used to be linked into every later record of every namespace, so each of them missed
    after every restart. Now a load that fails on it marks it bad and the write behind that
    turn rewrites it; a server that has not loaded it checks it before a record names it
    (that record is not written; the next capture copies the block and rewrites it)."""
    root = tmp_path / "store"
    x, y, z = (Talk(chat(s), dense) for s in ("x", "y", "z"))
    server = start(dense, root, tmp_path / "a.log")
    try:
        with httpx.Client(timeout=60) as client:
            x.next(client, server)
            x.next(client, server)
        settle(server, root, 2)
    finally:
        server.stop()
    first = records(root)[-1].chain.blocks[0]
    assert first[1:] == (0, DEFAULT_BLOCK_TOKENS)
    block = root / "blocks" / f"{first[0]}.safetensors"
    damaged = flip_last_byte(block)

    # A load finds it bad: x's next turn prefills, and its write rewrites the block.
    server = start(dense, root, tmp_path / "b.log")
    try:
        with httpx.Client(timeout=60) as client:
            assert cached(x.next(client, server)) == 0
            persist = settle(server, root, 1)
            assert persist["load_errors"] == 1 and persist["repaired"] >= 1, persist
            y.next(client, server)  # another namespace names the rewritten block
            settle(server, root, 2)
    finally:
        server.stop()
    assert block.read_bytes() != damaged
    assert_sound(root)

    # Bad again, and no load tells: the writer checks it before a record names it.
    damaged = flip_last_byte(block)
    server = start(dense, root, tmp_path / "c.log")
    try:
        with httpx.Client(timeout=60) as client:
            z.next(client, server)
            deadline = time.monotonic() + 60
            while persist_status(server)["skipped"] < 1:  # that record is not written
                assert time.monotonic() < deadline, persist_status(server)
                time.sleep(0.05)
            assert persist_status(server)["written"] == 0
            z.next(client, server)  # the block is copied again, rewritten, then named
            persist = settle(server, root, 1)
            assert persist["repaired"] >= 1 and persist["load_errors"] == 0, persist
    finally:
        server.stop()
    assert "failed its checks" in server.log()
    assert block.read_bytes() != damaged
    assert_sound(root)

    # After a restart every conversation hits all of its last prompt but one, from disk.
    server = start(dense, root, tmp_path / "d.log")
    try:
        with httpx.Client(timeout=60) as client:
            for talk in (x, y, z):
                prev = talk.prompts[-1]
                assert cached(talk.next(client, server)) == prev - 1, talk.conv.salt
        persist = persist_status(server)
        assert persist["disk_hits"] == 3 and persist["load_errors"] == 0, persist
    finally:
        server.stop()


def test_a_rewritten_bad_block_is_good_again_and_not_rewritten_by_later_records(
    three_turns, tmp_path
):
    """Once the write behind a turn has rewritten a bad block, the block is sound: later
    records of any namespace name it as it is. Left marked bad, every later record reaching
    it copied it again and wrote it over (a block's worth of host copy and disk write per
    turn, a "rewrote ..., found bad" line each time, and `repaired` counting up for ever)."""
    root, x = copy_of(three_turns, tmp_path)
    first = records(root)[-1].chain.blocks[0]
    block = root / "blocks" / f"{first[0]}.safetensors"
    flip_last_byte(block)
    y = Talk(chat("y"), x.model)
    server = start(x.model, root, tmp_path / "serve.log")
    try:
        with httpx.Client(timeout=60) as client:
            assert cached(x.next(client, server)) == 0  # the load found the block bad
            healed = settle(server, root, 1)
            assert healed["load_errors"] == 1 and healed["repaired"] >= 1, healed
            rewritten = block.stat()
            assert record_is_sound(records(root)[-1].path)
            y.next(client, server)  # another namespace reaches the block
            x.next(client, server)
            later = settle(server, root, 3)
    finally:
        server.stop()
    now = block.stat()
    assert (now.st_ino, now.st_mtime_ns) == (rewritten.st_ino, rewritten.st_mtime_ns)
    assert later["repaired"] == healed["repaired"], (healed, later)
    assert server.log().count("found bad") == 1, server.log()[-3000:]
    assert_sound(root)


def test_a_bad_agent_block_is_rewritten_by_the_servers_write_back(dense, tmp_path):
    """A warm prompt whose block is bad is prefilled at start and written back: the write
    back used to name the bad block again (it was there), so the agent stayed broken until
    `kvsnap build`; now the write-back checks the stored parts it names and rewrites a bad
    one."""
    import json

    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps([{"name": "planner", "messages": [{"role": "system", "content": SHARED}]}])
    )
    root = tmp_path / "store"
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "kvsnap-cache")}
    r = run_kvsnap("build", agents, "--model", dense, "--out", root, env=env)
    assert r.returncode == 0, r.stderr
    (agent,) = Store.open(root).scan()[0]
    block = root / "blocks" / f"{agent.chain.blocks[0][0]}.safetensors"
    damaged = flip_last_byte(block)
    assert run_kvsnap("verify", root, env=env).returncode == 1

    server = start(dense, root, tmp_path / "serve.log", extra=["--warm-prompts", str(agents)])
    try:
        deadline = time.monotonic() + 60  # the write-back follows the warm-up's prefill
        while block.read_bytes() == damaged:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.05)
        with Store.open(root).lock():  # and its record, written under the same lock
            pass
    finally:
        server.stop()
    v = run_kvsnap("verify", root, env=env)
    assert v.returncode == 0, v.stdout + v.stderr


def test_verify_advises_what_fixes_a_bad_block_only_conversations_reach(three_turns, tmp_path):
    """`kvsnap build` cannot rebuild a block no agent reaches: verify says what does."""
    root, _ = copy_of(three_turns, tmp_path)
    first = records(root)[-1].chain.blocks[0]
    block = root / "blocks" / f"{first[0]}.safetensors"
    flip_last_byte(block)
    r = run_kvsnap("verify", root)
    assert r.returncode == 1
    bad = [ln for ln in r.stdout.splitlines() if ln.startswith("BAD")]
    assert bad and all(str(block) in ln for ln in bad), r.stdout
    for line in bad:
        assert "rebuild it with `kvsnap build`" not in line, line
        assert "`kvsnap build` cannot rebuild it" in line, line
        assert "--persist-requests" in line and "rewrites it" in line, line
        assert f"kvsnap gc {root} --yes" in line, line


def test_a_hybrid_record_whose_own_checkpoint_is_bad_goes_once_a_longer_one_serves_it(
    demo_models, tmp_path
):
    """A hybrid record's end checkpoint is its own (no other record reaches it), so no later
    write rewrites it: the record that failed to load on it stayed, named by verify as BAD
    for good. Now the record of the turn that prefilled instead serves everything it did,
    and the writer removes it; verify passes."""
    model, root = demo_models.path("hybrid"), tmp_path / "store"
    talk = Talk(chat("h"), model)
    server = start(model, root, tmp_path / "a.log")
    try:
        with httpx.Client(timeout=60) as client:
            talk.next(client, server)
            talk.next(client, server)
        settle(server, root, 2)
    finally:
        server.stop()
    newest = records(root)[-1]
    key, end = newest.chain.checkpoints[-1]
    assert end == newest.n_tokens
    checkpoint = root / "checkpoints" / f"{key}.safetensors"
    flip_last_byte(checkpoint)
    r = run_kvsnap("verify", root)
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("BAD")]
    assert str(checkpoint) in line and f"delete {newest.path}" in line, line
    assert "rebuild it with `kvsnap build`" not in line and "rewrites it" not in line, line

    server = start(model, root, tmp_path / "b.log")
    try:
        with httpx.Client(timeout=60) as client:
            talk.next(client, server)
        persist = settle(server, root, 1)
        assert persist["load_errors"] == 1 and persist["repaired"] >= 1, persist
    finally:
        server.stop()
    assert not newest.path.exists()
    assert records(root)[-1].n_tokens == talk.prompts[-1] - 1
    assert_sound(root)


# --- item 3: a torn newest record falls back to the next-longest ----------------------------


def test_a_torn_newest_record_falls_back_to_the_next_longest_and_is_replaced(three_turns, tmp_path):
    """The newest record of a conversation cut short (a crash, a bad disk) used to hide the
    shorter sound one: the lookup dropped it at debug level and the turn prefilled
    everything. Now it is warned about (once), counted in load_errors, the next-longest
    record serves, and the turn's record replaces the torn one."""
    root, talk = copy_of(three_turns, tmp_path)
    *_, shorter, newest = records(root)
    torn = newest.path
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])

    server = start(talk.model, root, tmp_path / "serve.log")
    try:
        with httpx.Client(timeout=60) as client:
            assert cached(talk.next(client, server)) == shorter.n_tokens
        persist = settle(server, root, 1)
        assert persist["load_errors"] == 1 and persist["disk_hits"] == 1, persist
    finally:
        server.stop()
    assert server.log().count(f"persisted conversation {torn} not used") == 1
    assert not torn.exists()  # the fourth turn's record serves everything it did
    assert_sound(root)


def test_an_unreadable_record_is_warned_about_once_and_passed_over_by_every_lookup(
    three_turns, tmp_path, caplog, isolated_cache
):
    from kvsnap.runtime.model.loading import default_digest_cache, load_model
    from kvsnap.runtime.persist.options import PersistOptions
    from kvsnap.runtime.persist.persister import Persister

    root, talk = copy_of(three_turns, tmp_path)
    *_, shorter, newest = records(root)
    newest.path.write_bytes(newest.path.read_bytes()[:-7])
    lm = load_model(talk.model)
    identity = lm.identity(default_digest_cache())
    persister = Persister.open(Store.open(root), lm, identity, PersistOptions())
    tokens = list(newest.tokens) + [1, 2]
    try:
        with caplog.at_level(logging.WARNING, logger="kvsnap.persist"):
            for _ in range(3):
                info = persister.persisted_for(tokens, "/x", 0)
                assert info is not None and info.path == shorter.path
    finally:
        persister.close()
    assert persister.load_errors == 1 and persister.disk_hits == 3
    warned = [r for r in caplog.records if str(newest.path) in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


# --- item 4: a damaged record is rewritten, never kept young ---------------------------------


def test_a_damaged_record_is_rewritten_when_its_turn_comes_again_and_never_kept_young(
    three_turns, tmp_path
):
    """A record whose checksum fails used to be touched at every hit (it passed the header
    check) and never rewritten (it was there): requested daily, it stayed young for
    `gc --conversations-unused-for` and broken forever. Now the lookup passes over it
    without a touch, and the write of that turn rewrites it."""
    root, talk = copy_of(three_turns, tmp_path)
    *_, shorter, newest = records(root)
    record = newest.path
    flip_header_byte(record)
    old = time.time() - 2 * DAY
    os.utime(record, (old, old))

    server = start(talk.model, root, tmp_path / "a.log")
    try:
        with httpx.Client(timeout=60) as client:
            assert cached(talk.again(client, server)) == shorter.n_tokens  # a retry of turn 3
        persist = settle(server, root, 1)
        assert persist["load_errors"] == 1 and persist["repaired"] >= 1, persist
    finally:
        server.stop()
    assert record_is_sound(record)
    assert Store.open(root).inspect(record).tokens == newest.tokens
    assert_sound(root)

    # Damaged again, and its turn does not come again: it is not touched (and the fourth
    # turn's record, which serves all it did, replaces it).
    flip_header_byte(record)
    os.utime(record, (old, old))
    server = start(talk.model, root, tmp_path / "b.log")
    try:
        with httpx.Client(timeout=60) as client:
            assert cached(talk.next(client, server)) == shorter.n_tokens
            time.sleep(0.5)  # a touch, had one been queued, is done by now
            assert not record.exists() or record.stat().st_mtime < old + 1
        settle(server, root, 1)
    finally:
        server.stop()
    assert_sound(root)


# --- item 12: a record whose header is not what its name promises is refused -----------------

# XXH3's default secret: its first 32 bytes are all a collision below needs.
XXH3_SECRET = bytes.fromhex("b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f")


def colliding_tokens(n: int) -> tuple[list[int], list[int]]:
    """Two token lists of ``n`` whose tokens digests (xxh3-128, a fast hash, not a
    cryptographic one) are equal: in a long input, a 64-bit lane whose upper half equals the
    secret's adds its value to an accumulator and nothing else, so two lanes of one block
    can trade value."""
    prefix = b"tokens:int32le:"
    data = bytearray(prefix + struct.pack(f"<{n}i", *range(100, 100 + n)))
    for stripe in (0, 1):  # lane 2 of the first two 64-byte stripes
        at, secret_at = 64 * stripe + 16, 8 * stripe + 16
        data[at + 4 : at + 8] = XXH3_SECRET[secret_at + 4 : secret_at + 8]
    other = bytearray(data)
    for at, delta in ((16, 5), (80, -5)):
        (lane,) = struct.unpack_from("<Q", other, at)
        struct.pack_into("<Q", other, at, (lane + delta) % 2**64)
    assert xxhash.xxh3_128_hexdigest(bytes(data)) == xxhash.xxh3_128_hexdigest(bytes(other))
    return (
        list(struct.unpack(f"<{n}i", bytes(data[len(prefix) :]))),
        list(struct.unpack(f"<{n}i", bytes(other[len(prefix) :]))),
    )


def plant_record(
    root: Path, identity, conv_digest: str, tokens: list[int], named_as: str | None = None
) -> Path:
    """A conversation record of ``tokens``, sound in itself, as the server writes one (the
    layer list of the store's own records, at ``len(tokens)``). ``named_as``: the conversation
    digest its key (and file name) is made with, when not its header's own (a collision)."""
    from kvsnap.key import pack_tokens, tokens_digest
    from kvsnap.snapshot.blocks import BlockSettings, chain_field, chain_of, plan_cuts
    from kvsnap.snapshot.cache_classes import layers_at
    from kvsnap.snapshot.file import OutTensor, write_snapshot
    from kvsnap.snapshot.format import TOKENS, header_metadata
    from kvsnap.store.conversations import record_key, record_path
    from kvsnap.store.fileio import atomic_write

    n, settings = len(tokens), BlockSettings()
    links = chain_of(identity.digest, tokens, plan_cuts(n, set(), settings), False)
    tdigest = tokens_digest(tokens)
    key = record_key(identity.digest, named_as or conv_digest, tdigest, n)
    meta = header_metadata(
        key=key,
        name="",
        model=identity.as_dict(),
        model_digest=identity.digest,
        prompt_digest=conv_digest,
        n_tokens=n,
        tokens_digest=tdigest,
        layers=layers_at(records(root)[-1].layers, n),
        recorded={},
        chain=chain_field(links, settings),
    )
    tensors = [OutTensor(TOKENS, "I32", (n,), memoryview(pack_tokens(tokens)))]
    path = record_path(root, key)
    atomic_write(path, lambda f: write_snapshot(f, tensors, meta), lambda point: None)
    return path


def test_a_record_whose_header_holds_other_tokens_than_its_name_is_refused(
    three_turns, tmp_path, isolated_cache
):
    """Someone who can write the store plants, under the name a request's prefix looks up,
    a record of other tokens: sound in itself, its key hashing right (the tokens digest is
    a fast hash, so two token lists of one digest can be made). The lookup compares the
    header's tokens with the request's and passes it over for the next-longest."""
    from kvsnap.key import tokens_digest
    from kvsnap.runtime.model.loading import default_digest_cache, load_model
    from kvsnap.runtime.persist.options import PersistOptions
    from kvsnap.runtime.persist.persister import Persister
    from kvsnap.snapshot.format import snapshot_filename
    from kvsnap.store.conversations import (
        conversation_digest,
        namespace_tag,
        record_key,
        store_secret,
    )

    root, talk = copy_of(three_turns, tmp_path)
    lm = load_model(talk.model)
    identity = lm.identity(default_digest_cache())
    conv = conversation_digest(namespace_tag(store_secret(root), "/forged"))
    asked, forged = colliding_tokens(300)
    assert asked != forged
    good = plant_record(root, identity, conv, asked[:DEFAULT_BLOCK_TOKENS])
    planted = plant_record(root, identity, conv, forged)
    asked_key = record_key(identity.digest, conv, tokens_digest(asked), len(asked))
    assert planted.name == snapshot_filename(asked_key)  # where the request's prefix looks
    persister = Persister.open(Store.open(root), lm, identity, PersistOptions())
    try:
        info = persister.persisted_for(asked + [7], "/forged", 0)
    finally:
        persister.close()
    assert info is not None and info.path == good, info
    assert persister.load_errors == 1


def test_a_record_whose_header_holds_another_namespace_is_refused_though_its_key_collides(
    three_turns, tmp_path, isolated_cache, monkeypatch
):
    """A record of another namespace's conversation under the name this namespace's prefix
    looks up: its header hashes to that name only through a collision of the record key (a
    fast hash; no short input's collision is known, so the test makes one by mapping the
    other namespace's digest onto this one's in the header check). Every other check passes:
    the lookup must compare the header's namespace with the request's and pass it over for
    the next-longest record, never serve one tenant's state to another."""
    import kvsnap.snapshot.header as header
    from kvsnap.runtime.model.loading import default_digest_cache, load_model
    from kvsnap.runtime.persist.options import PersistOptions
    from kvsnap.runtime.persist.persister import Persister
    from kvsnap.store.conversations import conversation_digest, namespace_tag, store_secret

    root, talk = copy_of(three_turns, tmp_path)
    lm = load_model(talk.model)
    identity = lm.identity(default_digest_cache())
    secret = store_secret(root)
    mine, theirs = (conversation_digest(namespace_tag(secret, n)) for n in ("/mine", "/theirs"))
    tokens = list(range(100, 400))
    good = plant_record(root, identity, mine, tokens[:DEFAULT_BLOCK_TOKENS])
    planted = plant_record(root, identity, theirs, tokens, named_as=mine)
    real_key_of = header.key_of

    def colliding(identity, prompt_digest, tokens_digest, n_tokens):
        digest = mine if prompt_digest == theirs else prompt_digest
        return real_key_of(identity, digest, tokens_digest, n_tokens)

    monkeypatch.setattr(header, "key_of", colliding)
    # the header checks pass: only the lookup's own comparison can tell
    assert Store.open(root, readonly=True).inspect(planted).prompt_digest == theirs
    persister = Persister.open(Store.open(root), lm, identity, PersistOptions())
    try:
        info = persister.persisted_for(tokens + [7], "/mine", 0)
    finally:
        persister.close()
    assert info is not None and info.path == good, info
    assert persister.load_errors == 1


def test_a_folder_in_a_blocks_place_is_named_with_the_fix_not_a_permissions_hint(
    three_turns, tmp_path
):
    """A folder named like a block (no writer makes one): every write behind reaching it
    failed with "(Is a directory) ... check the folder's permissions", which sends the operator
    to the wrong fix. The error names the folder and says to move it out of the store."""
    from kvsnap.errors import StoreError
    from kvsnap.snapshot.file import OutTensor
    from kvsnap.snapshot.format import BLOCK_KIND
    from kvsnap.store.writing import put_part

    root, _ = copy_of(three_turns, tmp_path)
    key = records(root)[-1].chain.blocks[0][0]
    block = root / "blocks" / f"{key}.safetensors"
    block.unlink()
    block.mkdir()
    tensor = OutTensor("x", "I32", (1,), memoryview(b"\0\0\0\0"))
    with pytest.raises(StoreError) as caught:
        put_part(Store.open(root), BLOCK_KIND, key, [tensor], {})
    said = str(caught.value)
    assert str(block) in said and "move it out of the store" in said, said
    assert "permissions" not in said, said
    assert block.is_dir() and not [p for p in block.parent.iterdir() if p.name.startswith(".tmp")]
