"""Persisted conversations survive SIGTERM, kill -9 and a full disk, end to end:
real `kvsnap serve --persist-requests` processes on loopback, real store files, demo models.

Every answer is compared with a server that never restarted (greedy decoding), and after
every kill `kvsnap verify` must pass and no record may name a missing or torn part.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from helpers.persist_servers import (
    CONVERSATION,
    SYSTEMS,
    TURNS,
    Conversation,
    ask,
    assert_sound,
    cached,
    content,
    persist_status,
    record_lengths,
    server_pid,
    sigterm,
    start,
    wait_for_point,
    wait_written,
)

from kvsnap.faults import CONVERSATION_POINTS
from kvsnap.snapshot.blocks import DEFAULT_BLOCK_TOKENS
from kvsnap.store.conversations import conversation_files
from kvsnap.tools.serverproc import ServerProcess

RANDOM_KILLS = 3
CHATS = tuple(
    Conversation(system, TURNS + ("And the logging?", "Anything else to check?"), f"chat-{i}")
    for i, system in enumerate(SYSTEMS)
)
FULL_DISK = "the store's disk is full"
LEFT_UNWRITTEN = "not written within"


def _restart_for_turn_four(model: Path, store: Path, want: list[str], log: Path) -> dict:
    """Start on ``store`` and ask turn 4: its reply, once /v1/status says the one persisted
    record it needed was indexed and loaded without an error."""
    server = start(model, store, log)
    try:
        with httpx.Client(timeout=60) as client:
            fourth = ask(client, server, CONVERSATION.body(model, 4, want))
        persist = persist_status(server)
    finally:
        server.stop()
    assert persist["disk_hits"] == 1 and persist["load_errors"] == 0, persist
    assert "Traceback" not in server.log()
    return fourth


# --- 1. SIGTERM ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_after_a_sigterm_restart_the_fourth_turn_hits_the_third_turns_prefix(
    name, reference, demo_models, tmp_path
):
    model, store = demo_models.path(name), tmp_path / "store"
    want, lengths = reference.answers(name), reference.prefix_lengths(name)
    server = start(model, store, tmp_path / "first.log")
    answers: list[str] = []
    try:
        with httpx.Client(timeout=60) as client:
            for turn in (1, 2, 3):
                answers.append(
                    content(ask(client, server, CONVERSATION.body(model, turn, answers)))
                )
        assert answers == want[:3]
        wait_written(server, 3)  # the queue is empty when SIGTERM comes
        sigterm(server)
    finally:
        server.stop()
    assert LEFT_UNWRITTEN not in server.log()  # nothing was left to write

    fourth = _restart_for_turn_four(model, store, want, tmp_path / "again.log")
    assert cached(fourth) == lengths[2]  # turn 3's prompt minus its last token
    assert content(fourth) == want[3]  # as the server that never restarted answers


# --- 2. kill -9 at each fault point of the writer ------------------------------------------


@pytest.fixture(scope="module")
def two_turn_stores(reference, tmp_path_factory):
    """A store per model holding turns 1 and 2, written by a server stopped with SIGTERM;
    each test copies it."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            tmp = tmp_path_factory.mktemp(f"two-turns-{name}")
            model, store = reference.model(name), tmp / "store"
            answers = reference.answers(name)
            server = start(model, store, tmp / "seed.log")
            try:
                with httpx.Client(timeout=60) as client:
                    for turn in (1, 2):
                        ask(client, server, CONVERSATION.body(model, turn, answers))
                wait_written(server, 2)
                sigterm(server)
            finally:
                server.stop()
            made[name] = store
        return made[name]

    return make


def _fault_cases() -> list:
    # a hybrid's records are never superseded: they cannot be cut to serve a shorter prompt
    return [
        pytest.param(name, point, id=f"{name}-{point}")
        for name in ("dense", "hybrid")
        for point in CONVERSATION_POINTS
        if not (name == "hybrid" and point == "conversation-after-supersede")
    ]


@pytest.mark.parametrize("name, point", _fault_cases())
def test_killed_at_each_writer_fault_point_the_store_verifies_and_the_next_turn_is_served(
    name, point, reference, two_turn_stores, tmp_path
):
    """Turn 3 hits turn 2's record from disk; its own record's write is killed at ``point``.
    After a restart, turn 4 hits turn 3's record where it was written, else turn 2's."""
    model, store, faults = reference.model(name), tmp_path / "store", tmp_path / "faults.log"
    shutil.copytree(two_turn_stores(name), store)
    want, lengths = reference.answers(name), reference.prefix_lengths(name)
    edge = (lengths[1] // DEFAULT_BLOCK_TOKENS + 1) * DEFAULT_BLOCK_TOKENS
    assert lengths[2] > edge, f"turn 3's record {lengths} brings one new block, not two"
    env = {"KVSNAP_FAULT": f"{point}=kill", "KVSNAP_FAULT_LOG": str(faults)}
    server = start(model, store, tmp_path / "killed.log", env=env)
    try:
        with httpx.Client(timeout=60) as client:
            try:  # the kill may come before or after the reply
                third = ask(client, server, CONVERSATION.body(model, 3, want))
                assert content(third) == want[2] and cached(third) == lengths[1]
            except httpx.TransportError:
                pass
        rc = server.proc.wait(30)
    finally:
        server.stop()
    assert rc == -signal.SIGKILL, f"exit status {rc}:\n{server.log()[-3000:]}"
    assert point in faults.read_text().split(), "the fault point was never reached"
    assert_sound(store)
    # turn 3's record once written; turn 2's until it is superseded
    written = point in ("conversation-after-record", "conversation-after-supersede")
    held = record_lengths(store)
    assert (lengths[2] in held, lengths[1] in held) == (
        written,
        point != "conversation-after-supersede",
    ), (point, lengths, held)

    fourth = _restart_for_turn_four(model, store, want, tmp_path / "again.log")
    assert cached(fourth) == lengths[2 if written else 1], (point, lengths)
    assert content(fourth) == want[3]


# --- 3. kill -9 at random moments ----------------------------------------------------------


@dataclass
class Chats:
    """Where each conversation is, and every reply the crashing servers gave."""

    model: Path
    done: dict  # conversation -> turns answered
    replies: list = field(default_factory=list)  # (conversation, turn, status, cached, text)

    def next_turns(self, server: ServerProcess, want: dict, rounds: int) -> None:
        """A turn of each conversation per round (its last turn again once all are done);
        stops at the first connection error: the server was killed."""
        with httpx.Client(timeout=60) as client:
            for _ in range(rounds):
                for conv in CHATS:
                    turn = min(self.done[conv] + 1, len(conv.users))
                    body = conv.body(self.model, turn, want[conv])
                    try:
                        r = client.post(f"{server.url}/v1/chat/completions", json=body)
                    except httpx.TransportError:
                        return
                    if r.status_code != 200:
                        self.replies.append((conv, turn, r.status_code, -1, r.text))
                        return
                    self.replies.append((conv, turn, 200, cached(r.json()), content(r.json())))
                    self.done[conv] = turn


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_killed_at_random_moments_while_serving_the_store_verifies_and_the_restart_serves(
    name, reference, tmp_path
):
    """Three conversations, each in its own namespace, turn after turn; SIGKILL at a seeded
    random moment: half the draws just after a random write began (the fault log says when),
    the rest anywhere in the loop. After each kill the store verifies; each restart serves
    the next turns on. Every reply equals the never-restarted server's, and its cached
    tokens are none or one of the conversation's own earlier prefixes."""
    rng = random.Random(f"issue-23-{name}")
    model, store = reference.model(name), tmp_path / "store"
    want = {conv: reference.answers(name, conv) for conv in CHATS}
    lengths = {conv: reference.prefix_lengths(name, conv) for conv in CHATS}
    chats = Chats(model, {conv: 0 for conv in CHATS})
    landings = []
    for i in range(RANDOM_KILLS):
        faults = tmp_path / f"faults-{i}.log"
        env = {"KVSNAP_FAULT_LOG": str(faults)}
        server = start(model, store, tmp_path / f"server-{i}.log", env=env)
        loop = threading.Thread(target=chats.next_turns, args=(server, want, 3), daemon=True)
        try:
            loop.start()
            if rng.random() < 0.5:
                n = rng.randint(1, 3)
                wait_for_point(
                    faults, "conversation-mid-parts", n, server.proc, time.monotonic() + 20
                )
                time.sleep(rng.uniform(0, 0.005))  # a demo model's write lasts milliseconds
            else:
                time.sleep(rng.uniform(0, 1.2))
            os.kill(server_pid(server), signal.SIGKILL)
            rc = server.proc.wait(30)
            loop.join(60)
        finally:
            server.stop()
        assert rc == -signal.SIGKILL, f"kill {i}: exit status {rc}"
        points = faults.read_text().split() if faults.exists() else []
        landings.append(points[-1] if points else "before any write")
        assert_sound(store)

    survived = conversation_files(store)
    final = start(model, store, tmp_path / "final.log")
    try:
        chats.next_turns(final, want, 1)
        persist = persist_status(final)
    finally:
        final.stop()
    assert "Traceback" not in final.log()
    for conv, turn, status, n_cached, text in chats.replies:
        where = f"{conv.salt} turn {turn}, kills landed at {landings}"
        assert status == 200, f"{where}: {text}"
        assert text == want[conv][turn - 1], where
        assert n_cached in {0, *lengths[conv][:turn]}, f"{where}: {n_cached}, {lengths[conv]}"
    assert len(chats.replies) >= len(CHATS)  # the final start answered each conversation
    assert persist["load_errors"] == 0, persist
    if survived:  # a record survived the kills: its conversation's next turn hit it
        assert persist["disk_hits"] >= 1, (persist, landings)


# --- 4. a full disk ------------------------------------------------------------------------


def test_a_full_disk_stops_persisting_with_one_warning_and_serving_goes_on(
    reference, two_turn_stores, tmp_path
):
    """ENOSPC at the record's write (after its new block is written): turn 3 of a persisted
    conversation and three turns of a new one are all answered, persisting stops once."""
    name = "dense"
    model, store = reference.model(name), tmp_path / "store"
    shutil.copytree(two_turn_stores(name), store)
    other = CHATS[1]
    want, other_want = reference.answers(name), reference.answers(name, other)
    env = {"KVSNAP_FAULT": "conversation-before-record=enospc"}
    server = start(model, store, tmp_path / "server.log", env=env)
    try:
        with httpx.Client(timeout=60) as client:
            third = ask(client, server, CONVERSATION.body(model, 3, want))
            deadline = time.monotonic() + 30
            while not persist_status(server)["disabled"]:
                assert time.monotonic() < deadline, persist_status(server)
                time.sleep(0.02)
            others = [
                ask(client, server, other.body(model, turn, other_want)) for turn in (1, 2, 3)
            ]
        persist = persist_status(server)
        sigterm(server)
    finally:
        server.stop()
    assert content(third) == want[2] and cached(third) == reference.prefix_lengths(name)[1]
    assert [content(r) for r in others] == other_want[:3]
    assert "disk full" in persist["disabled"] and persist["written"] == 0, persist
    assert server.log().count(FULL_DISK) == 1, server.log()
    assert_sound(store)  # turn 2's record is whole, and names only parts present


# --- 5. SIGTERM with writes left -----------------------------------------------------------


def test_sigterm_with_writes_stuck_behind_another_writer_exits_within_the_flush_bound(
    reference, tmp_path
):
    """Another writer (a build, a gc) holds the store's lock: the writer thread waits on it
    and the writes queue. SIGTERM still exits within --persist-flush-timeout plus a few
    seconds, and the log says how many writes were left."""
    name, flush_s = "dense", 1.0
    model, store = reference.model(name), tmp_path / "store"
    want = {conv: reference.answers(name, conv) for conv in CHATS}
    extra = ["--persist-flush-timeout", str(flush_s)]
    server = start(model, store, tmp_path / "server.log", extra=extra)
    lock = os.open(store / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with httpx.Client(timeout=60) as client:
            for conv in CHATS:
                assert (
                    content(ask(client, server, conv.body(model, 1, want[conv]))) == want[conv][0]
                )
        deadline = time.monotonic() + 30
        while persist_status(server)["queued"] < len(CHATS) - 1:  # and one waits on the lock
            assert time.monotonic() < deadline, persist_status(server)
            time.sleep(0.02)
        elapsed = sigterm(server, timeout=flush_s + 30)
    finally:
        os.close(lock)  # releases the lock
        server.stop()
    assert elapsed < flush_s + 5, f"{elapsed:.1f}s to exit"
    assert f"shutdown: {len(CHATS)} conversation write(s) not written within" in server.log()
    assert_sound(store)
