"""docs/fleet.md end to end: two real `kvsnap serve` replicas behind a real HAProxy running the
documented configuration, sharing a Redis or folder tier. A session stays on its replica; when
that replica is killed (-9), the conversation's next turn lands on the other one, which
fetches the conversation from the tier instead of prefilling it, and every answer is the one a
never-killed server gives."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from helpers.fleet import RedisServer
from helpers.haproxy import HAProxy
from helpers.persist_servers import (
    SYSTEMS,
    TURNS,
    Conversation,
    Reference,
    cached,
    content,
    persist_status,
    server_pid,
    start,
)

from kvsnap.tools.serverproc import ServerProcess

pytestmark = pytest.mark.slow

# Six turns; turn 3 (helpers.persist_servers.TURNS) is long, so the record a killed replica
# wrote behind after it holds most of turn 4's prompt.
SIX_TURNS = Conversation(
    SYSTEMS[0],
    users=(
        *TURNS,
        "Question five: and after that fix, what next?",
        "Question six: how do I check it is done?",
    ),
)
MODEL = "dense"
SECRET = "fleet-test-secret-0123456789abcdef"  # KVSNAP_SHARED_TIER_SECRET, >= 16 characters
WAIT_S = 60.0


@pytest.fixture(scope="module")
def model(demo_models) -> Path:
    return demo_models.path(MODEL)


@pytest.fixture(scope="module")
def reference(demo_models, tmp_path_factory) -> Iterator[Reference]:
    """A server that persists nothing and is never killed: the answers to match."""
    ref = Reference(demo_models, tmp_path_factory.mktemp("reference"))
    yield ref
    ref.close()


def session_id(client: str, n: int) -> str:
    """A session id as agent clients send them (a UUID), the same every run: HAProxy's
    placement on the ring is deterministic."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"kvsnap-fleet-test/{client}/{n}"))


def address(server: ServerProcess) -> str:
    return server.url.removeprefix("http://")


@contextlib.contextmanager
def fleet(
    model: Path, tmp: Path, extra=(), env: dict | None = None, persist: bool = True
) -> Iterator[tuple[dict[str, ServerProcess], HAProxy]]:
    """Replicas r1 and r2 (each its own folder, store and log), started together, behind
    HAProxy; all stopped however the block ends."""
    with contextlib.ExitStack() as stack:

        def replica(name: str) -> ServerProcess:
            folder = tmp / name
            folder.mkdir()
            store = folder / "snaps" if persist else None
            return start(model, store, folder / "serve.log", env=env, extra=extra)

        with ThreadPoolExecutor(2) as pool:
            futures = {name: pool.submit(replica, name) for name in ("r1", "r2")}
        replicas = {}
        for name, future in futures.items():
            if future.exception() is None:
                replicas[name] = future.result()
                stack.callback(replicas[name].stop)
        for future in futures.values():
            if future.exception() is not None:
                raise future.exception()
        servers = {name: address(server) for name, server in replicas.items()}
        proxy = stack.enter_context(HAProxy(tmp / "haproxy", servers))
        yield replicas, proxy


def started(replicas: dict[str, ServerProcess]) -> dict[str, int]:
    """Requests each live replica's engine has started (health checks start none)."""
    return {
        name: server.status()["requests_started"]
        for name, server in replicas.items()
        if server.proc.poll() is None
    }


def served_by(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return [name for name in after if after[name] > before.get(name, 0)]


def post(client: httpx.Client, proxy: HAProxy, body: dict, headers=None) -> dict:
    r = client.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, (r.status_code, r.text, proxy.log())
    return r.json()


def wait_tier_writes(server: ServerProcess, writes: int) -> dict:
    """Wait until ``server`` has written ``writes`` records behind to the tier and nothing
    is queued."""
    deadline = time.monotonic() + WAIT_S
    while True:
        tier = persist_status(server)["shared_tier"]
        if tier["writes"] >= writes and tier["queue_depth"] == 0:
            return tier
        assert time.monotonic() < deadline, f"not {writes} records written behind: {tier}"
        time.sleep(0.05)


def kill_9(server: ServerProcess) -> None:
    """SIGKILL the kvsnap process itself (not the `timeout` around it) and reap it."""
    os.kill(server_pid(server), signal.SIGKILL)
    rc = server.proc.wait(30)
    assert rc != 0, rc


# --- a replica dies: its sessions continue warm on the other one, from the tier ------------


@pytest.fixture(params=["redis", "folder"])
def tier(request, tmp_path) -> Iterator[tuple[str, dict]]:
    """The shared tier (``--shared-tier`` value) and the replicas' environment: Redis with the
    fleet's secret set, as docs/fleet.md advises; a folder without one (the first replica
    stores a random secret in the tier)."""
    if request.param == "redis":
        with RedisServer(tmp_path / "redis") as redis:
            yield redis.url, {"KVSNAP_SHARED_TIER_SECRET": SECRET}
    else:
        folder = tmp_path / "shared"
        folder.mkdir()
        yield str(folder), {}


def test_a_killed_replicas_session_continues_warm_on_the_other_from_the_shared_tier(
    model, reference, tier, tmp_path
):
    where, env = tier
    expected = reference.answers(MODEL, SIX_TURNS)
    with fleet(model, tmp_path, ["--shared-tier", where], env) as (replicas, proxy):
        session = {"X-Claude-Code-Session-Id": session_id("claude-code", 0)}
        answers: list[str] = []
        with httpx.Client(timeout=120) as client:
            before = started(replicas)
            for turn in (1, 2, 3):
                reply = post(client, proxy, SIX_TURNS.body(model, turn, answers), session)
                answers.append(content(reply))
                assert answers[-1] == expected[turn - 1], f"turn {turn}"
                if turn == 1:
                    (home,) = served_by(before, started(replicas))
                # each turn's record in the tier before the next turn supersedes it locally
                # (a write-behind that finds its record superseded is skipped, uncounted)
                wait_tier_writes(replicas[home], turn)
            after = started(replicas)
            assert served_by(before, after) == [home], (before, after)  # the whole session
            assert after[home] - before[home] == 3, (before, after)
            (other,) = set(replicas) - {home}
            kill_9(replicas[home])

            before = started(replicas)
            reply = post(client, proxy, SIX_TURNS.body(model, 4, answers), session)
            answers.append(content(reply))
            assert answers[-1] == expected[3], "turn 4"
            prompt = reply["usage"]["prompt_tokens"]
            assert cached(reply) >= 0.9 * prompt, (cached(reply), prompt)
            tier_status = persist_status(replicas[other])["shared_tier"]
            assert tier_status["hits"] >= 1, tier_status
            assert tier_status["fetched_tokens"] >= 0.9 * prompt, tier_status
            assert tier_status["bad_values"] == tier_status["errors"] == 0, tier_status

            for turn in (5, 6):
                reply = post(client, proxy, SIX_TURNS.body(model, turn, answers), session)
                answers.append(content(reply))
                assert answers[-1] == expected[turn - 1], f"turn {turn}"
            after = started(replicas)
            assert after[other] - before[other] == 3, (before, after)
    assert answers == expected


# --- routing: a session's requests go to one replica; requests without one are answered ----


@pytest.fixture(scope="module")
def routing_fleet(model, tmp_path_factory):
    """Replicas that persist nothing: routing needs no tier."""
    with fleet(model, tmp_path_factory.mktemp("routing"), persist=False) as (replicas, proxy):
        yield replicas, proxy


def short(model: Path, text: str) -> dict:
    return {
        "model": model.name,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "temperature": 0,
    }


@pytest.mark.parametrize("header", ["X-Session-Id", "session_id"])
def test_every_request_of_a_session_goes_to_one_replica(routing_fleet, model, header):
    replicas, proxy = routing_fleet
    homes: dict[str, set[str]] = {}
    with httpx.Client(timeout=60) as client:
        for turn in range(3):
            for n in range(6):
                session = session_id(header, n)
                before = started(replicas)
                post(client, proxy, short(model, f"{session} turn {turn}"), {header: session})
                served = served_by(before, started(replicas))
                assert len(served) == 1, (before, served)
                homes.setdefault(session, set()).update(served)
    assert all(len(home) == 1 for home in homes.values()), homes
    # the sessions are hashed onto both replicas, not all onto one
    assert set().union(*homes.values()) == set(replicas), homes


def test_requests_without_a_session_are_answered_by_the_least_busy_replica(routing_fleet, model):
    replicas, proxy = routing_fleet
    served: list[str] = []
    with httpx.Client(timeout=60) as client:
        for n in range(4):
            before = started(replicas)
            reply = post(client, proxy, short(model, f"A question of conversation {n}."))
            assert reply["usage"]["completion_tokens"] >= 1, reply
            (where,) = served_by(before, started(replicas))
            served.append(where)
    # idle replicas are equally busy: leastconn takes them in turn
    assert set(served) == set(replicas), served
