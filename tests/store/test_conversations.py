"""Persisted conversations in the block store, with real `kvsnap serve` processes.

Tenants stay apart on disk and across a restart, the flags that contradict each other are
refused, DELETE /v1/cache/prefix purges, the disk budget evicts the least recently used
conversations and never a block a kept record reaches, gc runs during writes, two servers
and a build share one store, and ls / pack treat conversations as users' data. The tiny
dense demo model on 127.0.0.1; every check reads the store's real files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import xxhash
from helpers.cli import run_kvsnap
from helpers.models import LONG_SYSTEM
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
    persist_status,
    record_keys,
    serve,
    settle,
)

from kvsnap.snapshot.blocks import DEFAULT_BLOCK_TOKENS
from kvsnap.store.conversation_space import read_reach
from kvsnap.store.conversations import conversation_files
from kvsnap.store.local import Store
from kvsnap.tools.serverproc import start_server

SALT_A = "salt-of-alpha-ledger-7f3c"


# --- helpers ------------------------------------------------------------------------------


# --- fixtures -----------------------------------------------------------------------------


# --- 1. tenants stay apart on disk and across a restart ----------------------------------


def secrets_of(key: str, namespace: str) -> dict[str, bytes]:
    """What must never be on disk: the key, its unsalted hashes, and the namespace's."""
    out = {}
    for label, text in (("key", key), ("namespace", namespace)):
        data = text.encode()
        out[label] = data
        out[f"sha256({label})"] = hashlib.sha256(data).hexdigest().encode()
        out[f"sha256({label}) raw"] = hashlib.sha256(data).digest()
        out[f"xxh3_128({label})"] = xxhash.xxh3_128_hexdigest(data).encode()
        out[f"xxh64({label})"] = xxhash.xxh64_hexdigest(data).encode()
    out["fingerprint"] = hashlib.sha256(key.encode()).hexdigest()[:16].encode()
    return out


def test_tenants_stay_apart_across_a_restart_and_nothing_on_disk_names_them(base, tmp_path):
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    # The system prompt shares only its first half with the reviewer's warm prompt: another
    # tenant's match on that shared entry is partial, so it is rounded (granularity 128).
    system = LONG_SYSTEM[: len(LONG_SYSTEM) // 2] + " Alpha's ledger: account 4812, pin 7731."
    chat = Chat("alpha", system, key=KEY_A, salt=SALT_A)
    server = serve(model, root, tmp, "tenant1", "--persist-requests", env=KEYS_ENV)
    try:
        for _ in range(3):
            chat.send(server.url)
        settle(server, root, 3, ADMIN)
    finally:
        server.stop()
    # Each turn superseded the one before, which keeps only its whole blocks: the longest
    # record is the conversation's.
    record = max(conversation_files(root), key=lambda p: Store.open(root).inspect(p).n_tokens)
    used = record.stat().st_mtime_ns

    server = serve(model, root, tmp, "tenant2", "--persist-requests", env=KEYS_ENV)
    try:
        fresh = chat.send(server.url, key=KEY_B, salt="never-used-before")  # warm entries only
        assert fresh >= 128 and fresh % 128 == 0 and fresh < chat.last_prompt - 1
        assert chat.send(server.url, key=KEY_B) == fresh  # another key: A's record unseen
        assert chat.send(server.url, key=KEY_A, salt="another-salt") == fresh  # another salt
        assert chat.send(server.url, key=KEY_A, salt="") == fresh  # no salt is another one
        assert persist_status(server, ADMIN)["disk_hits"] == 0
        assert record.stat().st_mtime_ns == used  # nobody else's request used it
        prev = chat.last_prompt
        assert chat.send(server.url) == prev - 1  # A's own: all of turn 3's prompt but one
        assert persist_status(server, ADMIN)["disk_hits"] == 1
        settle(server, root, 5, ADMIN)
    finally:
        server.stop()

    folder = root / "conversations"
    assert stat.S_IMODE((folder / ".secret").stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # users' data: the owner's alone
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o600}
    fingerprint_a = hashlib.sha256(KEY_A.encode()).hexdigest()[:16]
    forbidden = {
        **secrets_of(KEY_A, f"{fingerprint_a}/{SALT_A}"),
        **{f"B {k}": v for k, v in secrets_of(KEY_B, "").items() if k.endswith("(key)")},
        "admin key": ADMIN.encode(),
        "salt": SALT_A.encode(),
    }
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(conversation_files(root)) >= 5 and len(files) > 10
    found = [(str(p), what) for p in files for what, b in forbidden.items() if b in p.read_bytes()]
    assert found == []


# --- 2. flags ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--persist-requests", "--no-request-prefix-cache", "--kv-snapshots", "S"], "drop one"),
        (["--persist-requests"], "add --kv-snapshots DIR"),
        (["--persist-max-gb", "1", "--kv-snapshots", "S"], "needs --persist-requests"),
        (["--persist-flush-timeout", "2", "--kv-snapshots", "S"], "needs --persist-requests"),
    ],
)
def test_contradicting_persist_flags_are_refused_before_the_model_loads(
    base, tmp_path, flags, says
):
    tmp, model, _ = base
    store = tmp_path / "store"
    args = [str(store) if f == "S" else f for f in flags]
    r = run_kvsnap("serve", model, "--continuous-batching", *args, timeout=60)
    assert r.returncode != 0
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not store.exists()  # refused before anything was opened


def test_without_persist_requests_nothing_is_written_into_conversations(base, tmp_path):
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    before = part_set(root)
    server = serve(model, root, tmp, "off")
    try:
        chat = Chat("off", LONG_SYSTEM)
        for _ in range(2):
            chat.send(server.url)
        assert persist_status(server)["enabled"] is False
    finally:
        server.stop()
    assert not (root / "conversations").exists()
    assert part_set(root) == before


# --- 3. DELETE /v1/cache/prefix ------------------------------------------------------------


def test_delete_prefix_cache_removes_persisted_conversations_and_only_their_blocks(base, tmp_path):
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    server = serve(model, root, tmp, "delete", "--persist-requests", env=KEYS_ENV)
    try:
        chats = [
            Chat("d1", LONG_SYSTEM, key=KEY_A),
            Chat("d2", PLANNER, key=KEY_A),
            Chat("d3", SHARED_SYSTEM, key=KEY_B, salt="x"),
        ]
        for chat in chats + chats[:1]:
            chat.send(server.url)
        settle(server, root, 4, ADMIN)
        reach = read_reach(Store.open(root))
        n = len(reach.records)
        assert n >= 3  # and d1's first turn, up to its last whole block
        conv_only = {rel for rel in reach.counts if rel not in reach.agent_parts}
        assert conv_only and set(reach.counts) & reach.agent_parts  # dedup with the agents

        url = f"{server.url}/v1/cache/prefix"
        r = httpx.delete(url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
        assert r.status_code == 403, r.text
        assert len(conversation_files(root)) == n
        r = httpx.delete(url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["persisted_removed"] == n
        assert conversation_files(root) == []
        parts = part_set(root)
        assert reach.agent_parts <= parts and not conv_only & parts
        prev = chats[0].last_prompt
        assert chats[0].send(server.url) < prev - 1  # memory and disk both forgot it
    finally:
        server.stop()
    assert_sound(root)


# --- 4. the disk budget ----------------------------------------------------------------------


def test_budget_evicts_least_recently_used_across_a_restart_and_keeps_reached_blocks(
    base, tmp_path
):
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    # c2 is the only conversation on the planner's prompt: its eviction leaves the planner's
    # first block, which the planner's record reaches, to the agent alone.
    c1, c2, c3, c4 = (Chat(f"c{i}", PLANNER if i == 2 else LONG_SYSTEM) for i in range(1, 5))
    whose: dict[str, str] = {}  # record key -> conversation
    server = serve(model, root, tmp, "budget1", "--persist-requests")
    try:
        for n, chat in enumerate((c1, c2, c3, c4, c1), 1):
            before = record_keys(root)
            cached = chat.send(server.url)
            if chat is c2:
                c2_warm = cached
            settle(server, root, n)
            whose.update(dict.fromkeys(record_keys(root) - before, chat.name))
            time.sleep(0.02)  # distinct last uses
    finally:
        server.stop()
    reach = read_reach(Store.open(root))
    lru = [
        whose[r.path.name.split(".")[0]] for r in sorted(reach.records, key=lambda r: r.last_use)
    ]
    # c1's first turn, kept up to its last whole block when its second superseded it, keeps
    # that turn's last use
    assert lru[-4:] == ["c2", "c3", "c4", "c1"] and set(lru[:-4]) <= {"c1"}
    budget = 0.75 * reach.nbytes(Store.open(root))  # room for c1 and one more, not for all
    gb = f"{budget / 2**30:.9f}"

    server = serve(model, root, tmp, "budget2", "--persist-requests", "--persist-max-gb", gb)
    try:
        time.sleep(0.5)
        # start reads (and evicts) nothing
        assert len(conversation_files(root)) == len(reach.records)
        c5 = Chat("c5", LONG_SYSTEM)
        c5.send(server.url)
        assert settle(server, root, 1)["evicted"] >= 1  # the pass before the write
        store = Store.open(root)
        deadline = time.monotonic() + 30  # the pass after it runs once the lock is let go
        while read_reach(store).nbytes(store) > budget:
            assert time.monotonic() < deadline, persist_status(server)
            time.sleep(0.05)
        kept = {whose.get(k, "c5") for k in record_keys(root)}
        assert {"c1", "c5"} <= kept and "c2" not in kept
        order = ["c2", "c3", "c4"]  # the evicted are the least recently used
        gone = [c for c in order if c not in kept]
        assert gone == order[: len(gone)]
        prev = c1.last_prompt
        assert c1.send(server.url) == prev - 1  # the kept one still hits from disk
        assert c2.send(server.url) == c2_warm  # the evicted one: the planner's warm prefix only
    finally:
        server.stop()
    assert_sound(root)
    assert reach.agent_parts <= part_set(root)


# --- 5. gc while the writer writes ------------------------------------------------------------


def test_gc_during_writes_keeps_every_reached_block_and_drops_unused_conversations(base, tmp_path):
    tmp, model, _ = base
    root = copy_store(base, tmp_path)
    server = serve(model, root, tmp, "gc", "--persist-requests")
    errors: list[BaseException] = []
    chats = [Chat(f"g{i}", (LONG_SYSTEM, SHARED_SYSTEM, PLANNER)[i % 3]) for i in range(4)]

    def talk():
        try:
            for _ in range(2):
                for chat in chats:
                    chat.send(server.url)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    try:
        writer = threading.Thread(target=talk)
        writer.start()
        runs = 0
        while runs < 3 or (writer.is_alive() and runs < 8):
            r = run_kvsnap("gc", root, "--yes", timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr
            runs += 1
        writer.join(120)
        assert not writer.is_alive() and errors == []
        settle(server, root, 8)
    finally:
        server.stop()
    assert_sound(root)
    agent_parts = read_reach(Store.open(root)).agent_parts
    n = len(conversation_files(root))
    assert n >= 4  # and earlier turns kept up to their last whole block

    time.sleep(1.2)
    r = run_kvsnap("gc", root, "--conversations-unused-for", "1s")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("(conversation unused for over 1s)") == n, r.stdout
    assert len(conversation_files(root)) == n  # a dry run
    r = run_kvsnap("gc", root, "--conversations-unused-for", "1s", "--yes")
    assert r.returncode == 0 and r.stdout.count("removed ") >= n, r.stdout
    assert conversation_files(root) == []
    assert part_set(root) == agent_parts  # only the agents' blocks are left
    assert_sound(root)


# --- 6. two servers and a build on one store -----------------------------------------------


def test_two_servers_and_a_build_share_one_store(base, tmp_path):
    tmp, model, _ = base
    root = tmp_path / "store"  # empty: the build and both servers make it at once
    env = {**KEYS_ENV, "KVSNAP_CACHE_DIR": str(tmp / "cache")}
    starts = [
        start_server(
            model,
            ["--continuous-batching", "--kv-snapshots", str(root), "--persist-requests"],
            tmp_path / f"s{i}.log",
            env=env,
            limit_s=600,
        )
        for i in (1, 2)
    ]
    servers = list(starts)
    try:
        for s in servers:
            s.wait_ready(120)
        build = subprocess.Popen(
            [sys.executable, "-m", "kvsnap", "build", str(tmp / "agents.json"), "--model"]
            + [str(model), "--out", str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "KVSNAP_CACHE_DIR": str(tmp / "cache")},
        )
        x, y = Chat("x", LONG_SYSTEM, key=KEY_A), Chat("y", PLANNER, key=KEY_A)
        errors: list[BaseException] = []

        def talk(chat, server):
            try:
                for _ in range(4):
                    chat.send(server.url)
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        threads = [
            threading.Thread(target=talk, args=a) for a in ((x, servers[0]), (y, servers[1]))
        ]
        for t in threads:
            t.start()
        out, _ = build.communicate(timeout=300)
        for t in threads:
            t.join(120)
        assert build.returncode == 0, out
        assert errors == []
        for s in servers:
            settle(s, root, 4, ADMIN)
        assert_sound(root)
        records = {p.name for p in conversation_files(root)}
        others = [p.name for p in (root / "conversations").iterdir() if p.name not in records]
        assert others == [".secret"]  # one secret, no temp file left

        servers[1].stop()  # x's record was written by the first server
        servers[1] = serve(
            model, root, tmp_path, "s2b", "--persist-requests", env=env, agents=False
        )
        prev = x.last_prompt
        assert x.send(servers[1].url) == prev - 1
        servers[0].stop()  # y's by the second (before its restart)
        servers[0] = serve(
            model, root, tmp_path, "s1b", "--persist-requests", env=env, agents=False
        )
        prev = y.last_prompt
        assert y.send(servers[0].url) == prev - 1
        for s in servers:
            assert persist_status(s, ADMIN)["disk_hits"] == 1
    finally:
        for s in starts + servers:
            s.stop()
    assert_sound(root)


# --- 7. ls and pack ------------------------------------------------------------------------


def test_ls_summarises_conversations_apart_from_the_agents(conv_store):
    from kvsnap.store.conversation_space import conversation_stats

    stats = conversation_stats(Store.open(conv_store, readonly=True))
    assert stats.count == 3 and stats.nbytes > 0
    r = run_kvsnap("ls", conv_store)
    assert r.returncode == 0, r.stderr
    assert "reviewer" in r.stdout and "planner" in r.stdout
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("conversations:")]
    assert line.startswith("conversations: 3 persisted, ") and " last used 20" in line
    assert not [k for k in record_keys(conv_store) if k in r.stdout]  # summarised, not listed
    r = run_kvsnap("ls", conv_store, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    conv = data["conversations"]
    assert conv["count"] == 3 and conv["bytes"] == stats.nbytes
    assert conv["oldest_use"] <= conv["newest_use"]
    assert {s["name"] for s in data["snapshots"]} == {"reviewer", "planner"}


def test_pack_ships_no_conversation_nor_a_block_only_conversations_reach(conv_store, tmp_path):
    reach = read_reach(Store.open(conv_store))
    conv_only = {rel for rel in reach.counts if rel not in reach.agent_parts}
    assert conv_only
    archive = tmp_path / "out.tar"
    r = run_kvsnap("pack", conv_store, "-o", archive)
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(archive) as tar:
        names = {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}
    assert not [n for n in names if "conversations" in n or ".secret" in n]
    shipped_parts = {n for n in names if n.startswith(("blocks/", "checkpoints/"))}
    assert shipped_parts == reach.agent_parts and not shipped_parts & conv_only


# --- units: names and the tenant tag (kvsnap/store/conversations.py) ----------------------


def test_longest_persisted_finds_the_longest_own_prefix_and_leaves_one_token():
    from kvsnap.key import tokens_digest
    from kvsnap.store.conversations import (
        conversation_digest,
        longest_persisted,
        namespace_tag,
        record_key,
    )

    model, secret, tokens = "ab" * 16, bytes(range(32)), list(range(100, 140))
    conv = conversation_digest(namespace_tag(secret, "fingerprint/salt"))

    def key(n: int, conv_digest: str = conv) -> str:
        return record_key(model, conv_digest, tokens_digest(tokens[:n]), n)

    keys = {key(10), key(25), key(40)}  # key(40): the whole request, never (one token is left)
    assert longest_persisted(keys, model, conv, tokens, 0) == (25, key(25))
    assert longest_persisted(keys, model, conv, tokens, 24) == (25, key(25))
    assert longest_persisted(keys, model, conv, tokens, 25) is None  # memory holds as much
    assert longest_persisted(keys, model, conv, tokens[:20] + [7] * 20, 0) == (10, key(10))
    assert longest_persisted(keys, model, conv, tokens[:10], 0) is None  # n < len(tokens)
    assert longest_persisted(set(), model, conv, tokens, 0) is None
    assert longest_persisted(keys, "cd" * 16, conv, tokens, 0) is None  # another model's
    other = conversation_digest(namespace_tag(secret, "fingerprint/other-salt"))
    assert longest_persisted(keys, model, other, tokens, 0) is None  # another namespace's
    assert longest_persisted(keys | {key(30, other)}, model, other, tokens, 0) == (
        30,
        key(30, other),
    )


def test_the_namespace_tag_is_keyed_by_the_stores_secret():
    from kvsnap.key import tokens_digest
    from kvsnap.store.conversations import conversation_digest, namespace_tag, record_key

    namespace, one, two = "0123456789abcdef/salt", b"\x01" * 32, b"\x02" * 32
    tag = namespace_tag(one, namespace)
    assert tag == namespace_tag(one, namespace) and len(tag) == 32
    assert namespace_tag(two, namespace) != tag  # another store's secret: another tag
    assert namespace_tag(one, namespace + "x") != tag
    unsalted = (
        hashlib.sha256(namespace.encode()).hexdigest(),
        xxhash.xxh3_128_hexdigest(namespace.encode()),
        hashlib.md5(namespace.encode()).hexdigest(),
    )
    assert not [h for h in unsalted if tag in h or h[:32] == tag]

    def key(secret: bytes) -> str:
        digest = conversation_digest(namespace_tag(secret, namespace))
        return record_key("ab" * 16, digest, tokens_digest([1, 2, 3]), 3)

    assert key(one) != key(two)


def test_the_store_secret_is_private_made_once_and_a_readable_one_refused(tmp_path):
    from kvsnap.errors import StoreError
    from kvsnap.store.conversations import store_secret

    secret = store_secret(tmp_path)
    path = tmp_path / "conversations" / ".secret"
    assert len(secret) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store_secret(tmp_path) == secret
    assert [p.name for p in path.parent.iterdir()] == [".secret"]  # no temp file left
    path.chmod(0o644)
    with pytest.raises(StoreError, match="0600"):
        store_secret(tmp_path)


# --- units: freeing space (kvsnap/store/conversation_space.py) ----------------------------


def roles(store: Store):
    """(reach, the two records on SHARED_SYSTEM, the reviewer's, their shared block): the
    shared block is the one part two conversations and no agent reach."""
    reach = read_reach(store)
    (shared,) = [r for r, c in reach.counts.items() if c == 2 and r not in reach.agent_parts]
    pair = [r for r in reach.records if shared in r.parts]
    (reviewer,) = [r for r in reach.records if shared not in r.parts]
    assert len(pair) == 2 and set(reviewer.parts) & reach.agent_parts
    return reach, pair, reviewer, shared


def own_parts(reach, record) -> set[str]:
    return {r for r in record.parts if reach.counts[r] == 1 and r not in reach.agent_parts}


def test_remove_records_never_deletes_a_part_another_record_reaches(conv_store, tmp_path):
    from kvsnap.store.conversation_space import remove_records

    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    store = Store.open(root)
    reach, (first, second), reviewer, shared = roles(store)
    gone = own_parts(reach, first)
    assert gone
    with store.lock():
        freed = remove_records(store, reach, [first])
    parts = part_set(root)
    assert shared in parts and not gone & parts and not first.path.exists()
    assert freed == first.size + sum(os.path.getsize(conv_store / r) for r in gone)
    assert_sound(root)
    reach = read_reach(store)
    with store.lock():  # the rest too: what an agent reaches stays, the rest goes
        remove_records(store, reach, list(reach.records))
    assert part_set(root) == reach.agent_parts and conversation_files(root) == []
    assert_sound(root)


def test_evict_to_budget_goes_by_last_use_and_keeps_shared_blocks(conv_store, tmp_path):
    from kvsnap.store.conversation_space import conversation_stats, evict_to_budget

    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    store = Store.open(root)
    reach, (first, second), reviewer, shared = roles(store)
    now = time.time()
    for age, record in ((30, first), (20, reviewer), (10, second)):
        os.utime(record.path, (now - age, now - age))
    total = reach.nbytes(store)
    assert evict_to_budget(store, total) == (0, total)  # within the budget: nothing goes
    removed, left = evict_to_budget(store, total - 1)
    assert removed == 1 and not first.path.exists() and reviewer.path.exists()
    assert shared in part_set(root) and left == conversation_stats(store).nbytes < total
    removed, left = evict_to_budget(store, 1)
    assert removed == 2 and left == 0 and conversation_files(root) == []
    assert part_set(root) == reach.agent_parts
    assert_sound(root)


def test_regression_an_unreadable_conversation_record_goes_first_and_then_blocks_go(
    conv_store, tmp_path
):
    """An unreadable record in conversations/ (a newer format's, a damaged one) serves no
    request, yet it once stayed through DELETE /v1/cache/prefix (users' data kept after an
    admin removed "every persisted conversation"), and it stopped every block removal: the
    budget then evicted every readable conversation one after another while the blocks they
    left piled up without bound. Now the purge, the budget and gc's unused-for drop remove
    it first, then read the chains again."""
    from kvsnap.store.conversation_space import drop_unused, evict_to_budget, purge

    def fresh(name: str) -> tuple[Path, Store, Path]:
        root = tmp_path / name
        shutil.copytree(conv_store, root)
        bad = root / "conversations" / f"{'0' * 32}.safetensors"
        bad.write_bytes(BAD_HEADER)
        return root, Store.open(root), bad

    root, store, bad = fresh("purge")
    agent_parts = read_reach(store).agent_parts
    assert purge(store)[0] == 4  # the three readable ones and the unreadable one
    assert conversation_files(root) == [] and part_set(root) == agent_parts
    assert_sound(root)

    root, store, bad = fresh("budget")
    reach, (first, second), reviewer, shared = roles(store)
    now = time.time()
    for age, path in ((40, first.path), (30, reviewer.path), (20, second.path), (5, bad)):
        os.utime(path, (now - age, now - age))
    total = reach.nbytes(store)
    removed, left = evict_to_budget(store, total - 1)
    assert removed == 2 and not bad.exists() and not first.path.exists()
    assert second.path.exists() and reviewer.path.exists()
    assert not own_parts(reach, first) & part_set(root) and shared in part_set(root)
    assert_sound(root)

    root, store, bad = fresh("gc")
    os.utime(bad, (now - 60, now - 60))
    assert bad in drop_unused(store, 30, apply=False)[0] and bad.exists()
    r = run_kvsnap("gc", root, "--conversations-unused-for", "30s", "--yes")
    assert r.returncode == 0 and str(bad) in r.stdout, r.stdout + r.stderr
    assert not bad.exists() and len(conversation_files(root)) == 3  # the rest were used
    os.utime(conversation_files(root)[0], (now - 60, now - 60))
    drop_unused(store, 30, apply=True)
    reach = read_reach(store)
    assert reach.complete and len(reach.records) == 2
    assert_sound(root)


# --- units: verify (kvsnap/commands/conversations.py) ---------------------------------------


def test_regression_verify_skips_a_record_superseded_while_it_runs(
    conv_store, tmp_path, monkeypatch, capsys
):
    """`kvsnap verify` run while a server persisted printed `BAD ... does not exist; rebuild it
    with kvsnap build` and exited 1 for a record the writer superseded between the listing and
    the read (1 run in 40 against a live server). The race, made certain: the record goes just
    before verify reads it."""
    from kvsnap.commands.conversations import verify_conversations

    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    victim = conversation_files(root)[0]
    real = Store.verify_file

    def superseded_first(self, path, *args, **kwargs):
        if path == victim:
            path.unlink()  # the writer supersedes it now
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(Store, "verify_file", superseded_first)
    assert verify_conversations(Store.open(root, readonly=True), None, None) == (2, 0, 0)
    assert "BAD" not in capsys.readouterr().out


def test_a_bad_conversation_record_is_named_with_a_fix_that_fits_it(conv_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(conv_store, root)
    record = conversation_files(root)[0]
    data = bytearray(record.read_bytes())
    data[-3] ^= 0x01  # a byte of its tokens: the checksum no longer matches
    record.write_bytes(bytes(data))
    r = run_kvsnap("verify", root)
    assert r.returncode == 1
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("BAD")]
    assert str(record) in line and "kvsnap build" not in line
    assert f"delete {record} (that conversation's next turn prefills)" in line


# --- a fork across a restart -----------------------------------------------------------------


def test_a_forked_conversation_keeps_its_shared_turn_across_a_restart(base, tmp_path):
    """A regenerated or edited turn (a fork) extends the same record as the original:
    superseding it must keep its whole blocks, or after a restart the other branch's next
    turn (the disk lookup serves strict prefixes only) prefills all of it. It loses at most
    the partial last block against a server that never stopped (which trims in memory)."""
    tmp, model, _ = base
    root = copy_store(base, tmp_path)

    def fork(url: str, salt: str | None) -> tuple[Chat, Chat]:
        first = Chat("p", SHARED_SYSTEM, salt=salt)
        first.send(url)
        other = Chat("q", SHARED_SYSTEM, salt=salt)  # the same history so far, then its own
        other.messages, other.turns = list(first.messages), first.turns
        other.send(url)
        return first, other

    server = serve(model, root, tmp, "fork1", "--persist-requests")
    try:
        never_stopped = fork(server.url, "control")[0].send(server.url)
        assert never_stopped > 0
        first, _ = fork(server.url, None)
        settle(server, root, 5)
    finally:
        server.stop()
    server = serve(model, root, tmp, "fork2", "--persist-requests")
    try:
        assert first.send(server.url) >= never_stopped - DEFAULT_BLOCK_TOKENS > 0
    finally:
        server.stop()


def test_a_conversation_shares_its_agents_partial_last_block(conv_store):
    """A warm entry's end is a block end of the conversations that start with it: the agent's
    partial last block is theirs too, not a second copy of the agent's tail tokens."""
    store = Store.open(conv_store, readonly=True)
    agents = {i.name: i for i in store.scan()[0]}
    reviewer = agents["reviewer"]
    last = reviewer.chain.blocks[-1]
    assert last[2] - last[1] < DEFAULT_BLOCK_TOKENS  # partial: the case that matters
    on_reviewer = [
        info
        for info in (store.inspect(p) for p in conversation_files(conv_store))
        if info.tokens[: reviewer.n_tokens] == reviewer.tokens
    ]
    assert on_reviewer
    for info in on_reviewer:
        assert last[0] in {b[0] for b in info.chain.blocks}, (last, info.chain.blocks)
