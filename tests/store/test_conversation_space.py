"""The conversations' disk budget on real stores and real `kvsnap serve` processes: it holds
while an agent's record cannot be read (and says so), and one tenant's flood evicts its own
conversations, never those of a tenant holding less (kvsnap/store/conversation_space.py).
The tiny dense demo model on 127.0.0.1; every check reads the store's real files."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
from helpers.persist_servers import (
    ADMIN,
    BAD_HEADER,
    KEY_A,
    KEY_B,
    KEYS_ENV,
    PLANNER,
    SHARED_SYSTEM,
    Chat,
    assert_sound,
    copy_store,
    part_set,
    record_keys,
    serve,
    settle,
)

from kvsnap.store.conversation_space import (
    ConversationRecord,
    Reach,
    budget_victims,
    evict_to_budget,
    read_reach,
)
from kvsnap.store.conversations import conversation_files
from kvsnap.store.local import Store

BAD_AGENT = f"{'0' * 32}.safetensors"


def conversation_parts(root: Path) -> set[str]:
    """The blocks and checkpoints on disk that no readable agent record reaches."""
    return part_set(root) - read_reach(Store.open(root)).agent_parts


def stored_conversation_bytes(root: Path) -> int:
    """What conversations hold on disk: their records and every part no agent reaches."""
    parts = sum((root / rel).stat().st_size for rel in conversation_parts(root))
    return parts + sum(p.stat().st_size for p in conversation_files(root))


# --- 5. an unreadable agent record -----------------------------------------------------------


def test_regression_an_unreadable_agent_record_no_longer_switches_the_budget_off(
    conv_store, tmp_path, caplog
):
    """One agent record that could not be read kept every block: eviction removed records
    only, logged "N conversation(s) removed", and the blocks piled up (119 MB under a 21 MB
    budget). Now the budget goes by what can be read and names the unreadable record."""
    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    bad = root / "snapshots" / BAD_AGENT
    bad.write_bytes(BAD_HEADER)
    store = Store.open(root)
    reach = read_reach(store)
    assert not reach.complete and len(reach.records) == 3 and conversation_parts(root)
    with caplog.at_level(logging.WARNING, logger="kvsnap.persist"):
        removed, left = evict_to_budget(store, 1)
    assert removed == 3 and left == 0 and conversation_files(root) == []
    assert conversation_parts(root) == set()  # the budget holds: their blocks went too
    assert reach.agent_parts <= part_set(root)  # what readable agents reach stays
    warned = [r.getMessage() for r in caplog.records if str(bad) in r.getMessage()]
    assert warned and "kvsnap build" in warned[0] and "cannot be read" in warned[0], warned
    bad.unlink()
    assert_sound(root)


def test_outside_the_budget_an_unreadable_agent_record_keeps_every_block(
    conv_store, tmp_path, caplog
):
    """The purge, gc's unused-for drop and the sweep after a supersede need not hurry: an agent
    record they cannot read (damaged for now, or a newer kvsnap's on a shared store) might
    reach any block, so they remove conversation records only, keep every block and say why."""
    from kvsnap.store.conversation_space import drop_unused, purge, sweep_orphans

    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    bad = root / "snapshots" / BAD_AGENT
    bad.write_bytes(BAD_HEADER)
    store = Store.open(root)
    parts = part_set(root)
    assert conversation_parts(root)
    assert sweep_orphans(store, conversation_parts(root)) == 0
    with caplog.at_level(logging.WARNING, logger="kvsnap.persist"):
        newest = max(conversation_files(root), key=lambda p: p.stat().st_mtime)
        old = time.time() - 3600
        for path in conversation_files(root):
            if path != newest:
                os.utime(path, (old, old))
        dropped, _ = drop_unused(store, 60, apply=True)
        assert len(dropped) == 2 and purge(store)[0] == 1
    assert conversation_files(root) == [] and part_set(root) == parts
    warned = [r.getMessage() for r in caplog.records if str(bad) in r.getMessage()]
    assert warned and all("kept" in w for w in warned), warned
    bad.unlink()
    assert evict_to_budget(store, 1)[0] == 0
    assert_sound(root)


@pytest.mark.parametrize("entry", ["folder", "fifo"])
@pytest.mark.parametrize("where", ["conversations", "snapshots"])
def test_regression_a_folder_or_fifo_named_like_a_record_never_keeps_the_blocks(
    conv_store, tmp_path, entry, where
):
    """A folder or a FIFO named like a record (no writer makes one, and none is removed: it is
    not ours) counted as an unreadable record that might reach any block, for good: DELETE
    /v1/cache/prefix removed the records and left every block (clients' prompt state on disk),
    and the budget never removed a block again. It is no record: it reaches nothing, it
    stays (verify names it), and the blocks go as if it were not there."""
    from kvsnap.store.conversation_space import purge

    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    odd = root / where / f"{'a' * 32}.safetensors"
    if entry == "folder":
        odd.mkdir()
    else:
        os.mkfifo(odd)
    assert conversation_parts(root)
    store = Store.open(root)
    assert read_reach(store).complete
    orphan = root / "blocks" / f"{'c' * 32}.safetensors"  # no record reaches it: gc takes it
    shutil.copy2(next((root / "blocks").glob("*.safetensors")), orphan)
    assert orphan in store.gc(apply=True)[0] and not orphan.exists()
    removed, freed = purge(store)
    assert removed == 3 and freed > 0
    assert conversation_parts(root) == set()  # their blocks went too
    assert os.path.lexists(odd)  # not the store's to remove
    assert conversation_files(root) == ([odd] if where == "conversations" else [])
    odd.rmdir() if entry == "folder" else odd.unlink()
    assert_sound(root)


def test_the_servers_budget_holds_while_an_agent_record_cannot_be_read(base, tmp_path):
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    bad = root / "snapshots" / BAD_AGENT
    bad.write_bytes(BAD_HEADER)
    server = serve(model, root, tmp, "measure", "--persist-requests")
    try:
        Chat("m1", SHARED_SYSTEM).send(server.url)
        settle(server, root, 1)
    finally:
        server.stop()
    one = stored_conversation_bytes(root)
    budget = int(2.5 * one)  # room for two conversations like it, not for six
    gb = f"{budget / 2**30:.9f}"
    server = serve(model, root, tmp, "budget", "--persist-requests", "--persist-max-gb", gb)
    try:
        for i in range(6):
            Chat(f"b{i}", f"Conversation {i} of many. " + SHARED_SYSTEM).send(server.url)
        settle(server, root, 6)
        deadline = time.monotonic() + 30  # the pass after the last write
        while stored_conversation_bytes(root) > budget:
            assert time.monotonic() < deadline, (stored_conversation_bytes(root), budget)
            time.sleep(0.05)
        log = server.log()
    finally:
        server.stop()
    assert str(bad) in log and "kvsnap build" in log, log[-3000:]
    bad.unlink()
    assert_sound(root)


# --- 6. one tenant's flood -------------------------------------------------------------------


def test_regression_one_tenants_flood_evicts_its_own_conversations_not_anothers(base, tmp_path):
    """Budget eviction was one global LRU: a burst of long prompts from tenant A removed all
    of tenant B's (older) records. Now the namespace holding the most gives first."""
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    server = serve(model, root, tmp, "tenant-b", "--persist-requests", env=KEYS_ENV)
    try:
        for chat in (Chat("b1", PLANNER, key=KEY_B), Chat("b2", SHARED_SYSTEM, key=KEY_B)):
            chat.send(server.url)
        settle(server, root, 2, ADMIN)
    finally:
        server.stop()
    b_keys, b_bytes = record_keys(root), stored_conversation_bytes(root)
    assert len(b_keys) == 2
    budget = 3 * b_bytes  # B holds a third: under an even share (of 90% of it) for two
    gb = f"{budget / 2**30:.9f}"
    server = serve(
        model, root, tmp, "flood", "--persist-requests", "--persist-max-gb", gb, env=KEYS_ENV
    )
    try:
        for i in range(8):  # A's flood: long prompts, 4x what B holds and more
            system = f"Tenant A, batch job {i}. " + SHARED_SYSTEM + PLANNER
            Chat(f"a{i}", system, key=KEY_A).send(server.url)
        settle(server, root, 8, ADMIN)
        deadline = time.monotonic() + 30
        while stored_conversation_bytes(root) > budget:
            assert time.monotonic() < deadline, (stored_conversation_bytes(root), budget)
            time.sleep(0.05)
        evicted = server.status(ADMIN)["persist"]["evicted"]
    finally:
        server.stop()
    assert evicted >= 1  # the budget did act
    assert b_keys <= record_keys(root)  # and every one of B's conversations stayed
    assert record_keys(root) - b_keys  # A keeps what fits besides
    assert_sound(root)


def test_the_namespace_holding_the_most_gives_first_and_shares_split_shared_blocks(tmp_path):
    """The rule on its own, over real part files: B's one record is the oldest, but A holds
    the most (its records, its own blocks, half of the block both reach), so A's go, least
    recently used first; when A's last goes, the whole shared block counts as B's."""
    store = Store.open(tmp_path / "store", create=True)
    (store.root / "blocks").mkdir()
    for name, size in (("shared", 1000), ("a1", 1000), ("a2", 1000), ("a3", 1000), ("b1", 500)):
        (store.root / "blocks" / f"{name}.safetensors").write_bytes(b"x" * size)

    def record(namespace: str, own: str, age: float) -> ConversationRecord:
        parts = ["blocks/shared.safetensors", f"blocks/{own}.safetensors"]
        return ConversationRecord(Path(own), time.time() - age, 100, parts, namespace)

    b = record("B", "b1", 40)
    a = [record("A", f"a{i}", 30 - i) for i in (1, 2, 3)]
    reach = Reach(records=[b, *a])
    for r in reach.records:
        reach.counts.update(r.parts)
    assert reach.nbytes(store) == 4900  # A holds 3800 (half the shared block), B 1100
    assert budget_victims(store, reach, 4900) == []
    assert budget_victims(store, reach, 3000) == a[:2]  # global LRU would take B's first
    assert budget_victims(store, reach, 1700) == a  # A at 1600 still holds more than B
    assert budget_victims(store, reach, 1000) == [*a, b]  # then B holds all 1600 of it


# --- 7. one key, many cache_salts (issue 39 item 6) ------------------------------------------


def test_regression_a_keys_salts_share_its_share_not_one_each(tmp_path):
    """Fairness went by namespace (key + cache_salt): ten salts of key A, each holding less
    than key B, held ten shares, and B's records went first. The key is the unit now: A
    holds the most (all its salts together), so A's go, least recently used first."""
    store = Store.open(tmp_path / "store", create=True)
    (store.root / "blocks").mkdir()
    sizes = {"b1": 1000, "b2": 1000, **{f"a{i}": 400 for i in range(10)}}
    for name, size in sizes.items():
        (store.root / "blocks" / f"{name}.safetensors").write_bytes(b"x" * size)

    def record(namespace: str, tenant: str, own: str, age: float) -> ConversationRecord:
        parts = [f"blocks/{own}.safetensors"]
        return ConversationRecord(Path(own), time.time() - age, 100, parts, namespace, tenant)

    b = [record("B/", "B", f"b{i}", 100 - i) for i in (1, 2)]  # B's are the oldest
    a = [record(f"A/salt-{i}", "A", f"a{i}", 50 - i) for i in range(10)]  # 500 a salt
    reach = Reach(records=[*b, *a])
    for r in reach.records:
        reach.counts.update(r.parts)
    assert reach.nbytes(store) == 7200  # A holds 5000 over its ten salts, B 2200
    victims = budget_victims(store, reach, 5000)
    assert not set(map(id, b)) & set(map(id, victims))  # B, under its share, keeps all
    assert victims == a[:5]  # A's least recently used, whatever their salt
    # records written before the tenant field: each namespace holds its own share, as before
    old = [ConversationRecord(r.path, r.last_use, r.size, r.parts, r.namespace) for r in a]
    reach = Reach(records=[*b, *old])
    for r in reach.records:
        reach.counts.update(r.parts)
    assert budget_victims(store, reach, 5000) == b


def test_regression_one_key_with_ten_salts_no_longer_evicts_another_keys(base, tmp_path):
    """The real server: key A sends ten conversations, each with its own cache_salt and each
    holding less than key B's two; past the budget A's go, never B's. Before, each salt was a
    tenant of its own holding less than B, so B's conversations were evicted for A's flood.
    Records of one key share one tenant digest whatever their salt; neither the key nor its
    fingerprint is in any file."""
    from kvsnap.http.guard import fingerprint

    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    server = serve(model, root, tmp, "tenant-b", "--persist-requests", env=KEYS_ENV)
    try:
        b1, b2 = Chat("b1", PLANNER, key=KEY_B), Chat("b2", SHARED_SYSTEM, key=KEY_B)
        for chat in (b1, b2, b1):  # b1's second turn supersedes its first: a record of its
            chat.send(server.url)  # whole blocks stays, written by the writer itself
        status = settle(server, root, 3, ADMIN)
    finally:
        server.stop()
    b_keys, b_bytes = record_keys(root), stored_conversation_bytes(root)
    assert status["superseded"] == 1 and len(b_keys) == 3, status
    budget = 3 * b_bytes
    gb = f"{budget / 2**30:.9f}"
    server = serve(
        model, root, tmp, "salts", "--persist-requests", "--persist-max-gb", gb, env=KEYS_ENV
    )
    half = SHARED_SYSTEM[: len(SHARED_SYSTEM) // 2]
    try:
        for i in range(10):  # about half of what B holds each; five times B's in all
            before = stored_conversation_bytes(root)
            Chat(f"a{i}", f"Tenant A, salt {i}. " + half, key=KEY_A, salt=f"s{i}").send(server.url)
            settle(server, root, i + 1, ADMIN)
            if i == 0:  # each salt alone holds less than B: per salt, B held the most
                assert 0 < stored_conversation_bytes(root) - before < b_bytes / 1.5
        deadline = time.monotonic() + 30
        while stored_conversation_bytes(root) > budget:
            assert time.monotonic() < deadline, (stored_conversation_bytes(root), budget)
            time.sleep(0.05)
        evicted = server.status(ADMIN)["persist"]["evicted"]
    finally:
        server.stop()
    assert evicted >= 1  # the budget did act
    assert b_keys <= record_keys(root)  # and every one of B's conversations stayed
    a_keys = record_keys(root) - b_keys
    assert a_keys  # A keeps what fits besides
    store = Store.open(root)
    tenants = {
        key: store.inspect(root / "conversations" / f"{key}.safetensors").tenant
        for key in record_keys(root)
    }
    a_tenants, b_tenants = {tenants[k] for k in a_keys}, {tenants[k] for k in b_keys}
    assert len(a_tenants) == len(b_tenants) == 1 and a_tenants != b_tenants, tenants
    assert "" not in a_tenants | b_tenants, tenants
    secrets_in_clear = [s.encode() for key in (KEY_A, KEY_B) for s in (key, fingerprint(key))]
    for path in conversation_files(root):
        data = path.read_bytes()
        assert not any(s in data for s in secrets_in_clear), path
    assert_sound(root)


def test_the_tenant_field_is_checked_like_every_header_field(conv_store, tmp_path):
    """``kvsnap.tenant`` is covered by the checksum (a flipped digit is caught) and checked
    itself (a value that is no digest, checksum recomputed, is refused naming the field); a
    keyless server's records carry none (each cache_salt stays its own unit there)."""
    from kvsnap.errors import SnapshotError
    from kvsnap.snapshot.file import OutTensor, read_header, tensor_bytes, write_snapshot
    from kvsnap.snapshot.format import TENANT, TOKENS

    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    store = Store.open(root)
    path = conversation_files(root)[0]
    assert store.inspect(path).tenant == ""  # conv_store's server has no API keys
    header = read_header(path)
    assert TENANT not in header.metadata
    raw = tensor_bytes(path, header, TOKENS)
    tokens = [OutTensor(TOKENS, "I32", header.tensors[TOKENS].shape, memoryview(raw))]
    meta = {k: v for k, v in header.metadata.items() if k != "kvsnap.xxh3_128"}

    def rewrite(tenant: str) -> None:
        with open(path, "wb") as f:
            write_snapshot(f, tokens, {**meta, TENANT: tenant})

    rewrite("ab" * 16)
    assert store.verify_file(path).tenant == "ab" * 16
    data = path.read_bytes()
    path.write_bytes(data.replace(b"ab" * 16, b"ab" * 15 + b"ac", 1))  # one digit flipped
    with pytest.raises(SnapshotError, match="checksum"):
        store.verify_file(path)
    rewrite("../" + "a" * 29)  # sound checksum, no digest
    with pytest.raises(SnapshotError, match="kvsnap.tenant is '../"):
        store.inspect(path)
    assert read_reach(store).unreadable == [path]  # the budget removes it first
