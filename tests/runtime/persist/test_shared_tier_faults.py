"""`kvsnap serve --shared-tier` when the tier misbehaves, end to end: real servers, a real
redis-server on 127.0.0.1, the dense demo model.

Replica A serves the first turns of a conversation and writes them behind to the tier;
replica B, with its own store, serves the next turn. Whatever the tier does (stopped,
paused, flushed, a flipped value, no memory left, a write queue too small, two tenants on
one prompt) every request is answered 200 with the answer of a reference server that never
shared anything (greedy decoding), and /v1/status's `persist.shared_tier` counters say why
B reused what it did. Each scenario has its own conversation (its own system prompt and
cache_salt): no block or record of one is any other's.
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers.fleet import RedisServer
from helpers.models import LONG_SYSTEM
from helpers.persist_servers import (
    ADMIN,
    KEY_A,
    KEY_B,
    KEYS_ENV,
    TURNS,
    Conversation,
    assert_sound,
    cached,
    content,
)

from kvsnap.store.tier_backends import PASSWORD_ENV, SECRET_ENV
from kvsnap.store.tier_values import MAGIC
from kvsnap.tools.serverproc import ServerProcess, start_server

MODEL = "dense"
FLEET_SECRET = "fault-tests-fleet-secret-0123456789"
ENV = {**KEYS_ENV, SECRET_ENV: FLEET_SECRET, PASSWORD_ENV: ""}
NO_SECRET_ENV = {**KEYS_ENV, SECRET_ENV: "", PASSWORD_ENV: ""}
DEFAULT_BUDGET_S = 5.0
SLACK_S = 10.0  # a loaded machine's prefill and scheduling on top of a budget, never a hang
COOLDOWN_S = 15.0  # the breaker's (TierOptions.cooldown_s: no flag sets it)
REUSE = 0.9


# --- helpers ----------------------------------------------------------------------------------


def conversation(name: str) -> Conversation:
    """A conversation of its own: its first tokens (and so every block) and its namespace
    are no other scenario's."""
    system = f"Scenario {name}: keep this review apart from the others. " + LONG_SYSTEM
    return Conversation(system, TURNS + ("And the logging?",), salt=f"faults-{name}")


@dataclass
class Scenario:
    conv: Conversation
    model: Path
    want: list[str]  # the reference server's answers, turn by turn
    prefixes: list[int]  # the tokens each turn's persisted record holds

    def body(self, turn: int) -> dict:
        return self.conv.body(self.model, turn, self.want)


def post(server: ServerProcess, body: dict, key: str = KEY_A) -> tuple[dict, float]:
    """The reply (asserted 200) and the seconds it took."""
    started = time.monotonic()
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    return r.json(), elapsed


def turn(server: ServerProcess, sc: Scenario, n: int, key: str = KEY_A) -> tuple[dict, float]:
    """Turn ``n`` of ``sc`` (the earlier turns answered as the reference answered them): its
    answer is the reference's."""
    reply, elapsed = post(server, sc.body(n), key)
    assert content(reply) == sc.want[n - 1], (n, content(reply), sc.want[n - 1])
    return reply, elapsed


def persist(server: ServerProcess) -> dict:
    return server.status(ADMIN)["persist"]


def tier(server: ServerProcess) -> dict:
    return persist(server)["shared_tier"]


def grew(after: dict, before: dict, *fields: str) -> dict:
    return {f: after[f] - before[f] for f in fields}


def wait_settled(server: ServerProcess, records: int, timeout: float = 30.0) -> dict:
    """Wait until the server has written ``records`` records locally (since its start),
    nothing is queued for the tier and its counters have stood still for half a second:
    each record is then written behind, failed, dropped, or superseded locally by its
    conversation's next one before its turn came (that one serves all it did)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        p = persist(server)
        st = p["shared_tier"]
        now = tuple(st[k] for k in ("writes", "errors", "drops", "superseded", "parts_written"))
        if p["written"] >= records and p["queued"] == 0 and st["queue_depth"] == 0:
            if now == last:
                return st
            last = now
        assert time.monotonic() < deadline, f"not {records} settled: {p}\n" + (server.log()[-3000:])
        time.sleep(0.5)


def wait_for(ok, timeout: float = 30.0) -> bool:
    """Poll ``ok()`` until it holds (True) or ``timeout`` passes (False); bounded."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def keys_by_kind(keys: set[str]) -> dict[str, set[str]]:
    """kvsnap:t2:<model>:<kv>:<namespace>:<kind>:<key> (and …:<namespace>:records) by kind."""
    out: dict[str, set[str]] = {}
    for k in keys:
        fields = k.split(":")
        if len(fields) in (6, 7):
            out.setdefault(fields[5], set()).add(k)
    return out


def namespaces(keys: set[str]) -> set[str]:
    return {k.split(":")[4] for k in keys if len(k.split(":")) >= 6}


def flip(client, key: str) -> None:
    """One byte of the value's payload (past its header) flipped, the value put back."""
    value = client.get(key)
    assert value.startswith(MAGIC), key
    (n,) = struct.unpack(">I", value[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4 + n
    i = start + (len(value) - start) // 2
    client.set(key, value[:i] + bytes([value[i] ^ 0xFF]) + value[i + 1 :])


def launch(
    model: Path, store: Path, log: Path, tier_url: str, env: dict, extra=()
) -> ServerProcess:
    args = ["--continuous-batching", "--kv-snapshots", str(store), "--persist-requests"]
    args += ["--shared-tier", tier_url, *extra]
    env = {"KVSNAP_CACHE_DIR": str(log.parent / "kvsnap-cache"), **env}
    return start_server(model, args, log, env=env, limit_s=600)


class Fleet(contextlib.ExitStack):
    """A redis-server and replicas A and B on it (started together), all stopped at the
    end however the test ends."""

    def __init__(self, model: Path, tmp: Path, env=ENV, a_extra=(), b_extra=(), tier_url=None):
        super().__init__()
        self.tmp = tmp
        try:  # not yet entered: stop what started if the rest fails
            self.redis = self.enter_context(RedisServer(tmp / "redis"))
            url = tier_url or self.redis.url
            self.a = launch(model, tmp / "a", tmp / "a.log", url, env, a_extra)
            self.callback(self.a.stop)
            self.b = launch(model, tmp / "b", tmp / "b.log", url, env, b_extra)
            self.callback(self.b.stop)
            for server in (self.a, self.b):
                server.wait_ready(120)
        except BaseException:
            self.close()
            raise

    def keys(self) -> set[str]:
        return set(self.redis.keys())


@pytest.fixture(scope="module")
def scenario(reference, demo_models):
    def make(name: str) -> Scenario:
        conv = conversation(name)
        return Scenario(
            conv,
            demo_models.path(MODEL),
            reference.answers(MODEL, conv),
            reference.prefix_lengths(MODEL, conv),
        )

    return make


@pytest.fixture(scope="module")
def fleet(demo_models, tmp_path_factory):
    """The shared pair: A and B with API keys and the fleet's secret, a healthy Redis."""
    with Fleet(demo_models.path(MODEL), tmp_path_factory.mktemp("fleet")) as f:
        yield f


def a_writes_three_turns(f: Fleet, sc: Scenario, key: str = KEY_A) -> set[str]:
    """A serves turns 1-3 of ``sc`` and writes them behind; the tier's keys they added."""
    before_keys, before = f.keys(), tier(f.a)
    written = persist(f.a)["written"]
    for n in (1, 2, 3):
        turn(f.a, sc, n, key)
    st = wait_settled(f.a, written + 3)
    assert st["writes"] > before["writes"], st  # the third turn's at least
    assert sum(grew(st, before, "writes", "superseded").values()) == 3, st
    assert grew(st, before, "errors", "drops") == {"errors": 0, "drops": 0}, st
    return f.keys() - before_keys


# --- 1. the happy path ------------------------------------------------------------------------
# The shared B's tests run in this order: until B has prefilled a long prompt itself it has
# no prefill rate and always fetches, so the happy path and the flipped block (found bad only
# when its part is fetched) come before any test that has B prefill.


def test_b_continues_a_conversation_a_served_from_the_tier(fleet, scenario):
    sc = scenario("happy")
    added = a_writes_three_turns(fleet, sc)
    kinds = keys_by_kind(added)
    assert kinds.get("record") and kinds.get("block") and kinds.get("records"), sorted(added)
    assert len(namespaces(added)) == 1
    before, disk = tier(fleet.b), persist(fleet.b)["disk_hits"]
    written = persist(fleet.b)["written"]
    reply, _ = turn(fleet.b, sc, 4)
    after = tier(fleet.b)
    prompt = reply["usage"]["prompt_tokens"]
    assert cached(reply) >= REUSE * prompt and cached(reply) == sc.prefixes[2], reply["usage"]
    assert grew(after, before, "hits", "misses", "bad_values", "errors", "timeouts") == {
        "hits": 1,
        "misses": 0,
        "bad_values": 0,
        "errors": 0,
        "timeouts": 0,
    }
    assert after["fetched_tokens"] - before["fetched_tokens"] == sc.prefixes[2]
    assert after["bytes_in"] > before["bytes_in"]
    # every block fetched: received into one buffer per tensor, read as one prefix
    assert after["contiguous"] - before["contiguous"] == 1, after
    # loaded from the fetch's memory, not read back from B's disk; then kept in B's store
    assert persist(fleet.b)["disk_hits"] == disk
    assert wait_for(lambda: tier(fleet.b)["kept"] == before["kept"] + 1), tier(fleet.b)
    assert not list((fleet.tmp / "b").glob(".tmp-tier-*"))  # nothing left staged
    # turn 4's own record is written once the keeper has stored the fetched parts it names
    assert wait_for(lambda: persist(fleet.b)["written"] >= written + 1), persist(fleet.b)
    assert after["breaker"] == "closed"
    # turn 5 on B reads turn 4's kept prefix: the fetched buffers, turn 4's tokens written
    # into their room (tier_layout.RecordBuffers.extend); answered as the reference
    reply, _ = turn(fleet.b, sc, 5)
    assert cached(reply) >= prompt, reply["usage"]
    assert tier(fleet.b)["hits"] == after["hits"]  # from B's memory, not fetched again


def test_a_branch_of_a_conversation_continues_from_its_earlier_turn_on_another_replica(
    fleet, scenario
):
    """Turn 3 asked again with another question (a regenerated or edited turn) on B: turn 3's
    record does not hold it, turn 2's does, and stays in the tier for it; the answer is A's."""
    sc = scenario("branch")
    a_writes_three_turns(fleet, sc)
    body = sc.body(3)
    body["messages"][-1] = {"role": "user", "content": "A different third question, then?"}
    before = tier(fleet.b)
    on_b, _ = post(fleet.b, body)
    assert cached(on_b) == sc.prefixes[1], on_b["usage"]
    assert grew(tier(fleet.b), before, "hits", "bad_values") == {"hits": 1, "bad_values": 0}
    on_a, _ = post(fleet.a, body)  # A holds the whole conversation in memory
    assert content(on_b) == content(on_a)


def test_metrics_report_the_tier_as_status_does(fleet):
    """/metrics (admin) carries the tier's counters and breaker state, equal to /v1/status'."""
    text = httpx.get(
        f"{fleet.b.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ).text
    st = tier(fleet.b)
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvsnap_tier_")
    }
    # what only B's own requests move (its writes behind may still be under way)
    for counter in ("hits", "misses", "bad_values", "fetched_tokens"):
        assert samples[f"kvsnap_tier_{counter}_total"] == st[counter], (counter, st)
    assert samples['kvsnap_tier_breaker_state{state="closed"}'] == 1.0
    assert samples['kvsnap_tier_breaker_state{state="open"}'] == 0.0
    assert "kvsnap_tier_queue_depth" in samples and "kvsnap_tier_writes_total" in samples
    assert st["hits"] >= 1  # the earlier tests fetched (this one runs after them)


# --- 5. a flipped value -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["block", "record"])
def test_a_flipped_value_is_never_loaded(fleet, scenario, kind):
    sc = scenario(f"flipped-{kind}")
    added = a_writes_three_turns(fleet, sc)
    targets = keys_by_kind(added).get(kind, set())
    assert targets, sorted(added)
    client = fleet.redis.client()
    for key in targets:  # every one: whichever B reads is flipped
        flip(client, key)
    before, p_before = tier(fleet.b), persist(fleet.b)
    reply, _ = turn(fleet.b, sc, 4)
    after, p_after = tier(fleet.b), persist(fleet.b)
    assert after["bad_values"] - before["bad_values"] >= 1, after
    assert after["hits"] == before["hits"] and after["fetched_tokens"] == before["fetched_tokens"]
    assert cached(reply) < 0.1 * reply["usage"]["prompt_tokens"], reply["usage"]
    assert p_after["disk_hits"] == p_before["disk_hits"]
    assert p_after["load_errors"] == p_before["load_errors"]
    assert not list((fleet.tmp / "b").glob(".tmp-tier-*"))
    assert after["breaker"] == "closed"  # a bad value is the value's fault, not the tier's
    assert f"shared tier: tier {kind} " in fleet.b.log()  # logged with the value's name


# --- 4. FLUSHALL ------------------------------------------------------------------------------


def test_a_flushed_tier_is_a_miss(fleet, scenario):
    sc = scenario("flushed")
    assert a_writes_three_turns(fleet, sc)
    fleet.redis.client().flushall()
    before = tier(fleet.b)
    reply, _ = turn(fleet.b, sc, 4)
    after = tier(fleet.b)
    assert grew(after, before, "hits", "misses", "bad_values", "errors") == {
        "hits": 0,
        "misses": 1,
        "bad_values": 0,
        "errors": 0,
    }
    assert cached(reply) < 0.1 * reply["usage"]["prompt_tokens"]


# --- 7. tenants -------------------------------------------------------------------------------


def test_two_keys_on_one_prompt_share_nothing_in_the_tier(fleet, scenario):
    sc = scenario("tenants")
    keys_a = a_writes_three_turns(fleet, sc, KEY_A)
    before_keys, written = fleet.keys(), persist(fleet.a)["written"]
    turn(fleet.a, sc, 1, KEY_B)  # the same first prompt, another key
    wait_settled(fleet.a, written + 1)
    keys_b = fleet.keys() - before_keys
    assert keys_a and keys_b
    assert namespaces(keys_a).isdisjoint(namespaces(keys_b))
    assert (keys_a & keys_b) == set()
    for secret in (KEY_A, KEY_B):
        shown = {secret, hashlib.sha256(secret.encode()).hexdigest()}
        assert not [k for k in keys_a | keys_b if any(s in k for s in shown)]

    # B, asked turn 4 with key 2, gets at most key 2's own first turn from the tier
    before = tier(fleet.b)
    reply, _ = turn(fleet.b, sc, 4, KEY_B)
    after = tier(fleet.b)
    assert cached(reply) <= sc.prefixes[0] < sc.prefixes[2], reply["usage"]
    assert after["fetched_tokens"] - before["fetched_tokens"] <= sc.prefixes[0]
    assert after["bad_values"] == before["bad_values"]

    assert "persist" not in fleet.b.status(KEY_B)  # a tenant's key sees no tier counters

    # the same turn with key 1: key 1's three turns were there all along
    before = tier(fleet.b)
    reply, _ = turn(fleet.b, sc, 4, KEY_A)
    after = tier(fleet.b)
    fetched = grew(after, before, "hits", "skipped_slower")
    if fetched["hits"]:
        assert cached(reply) == sc.prefixes[2]
    else:  # B measured prefilling as sooner: it saw the record and chose not to fetch it
        assert fetched["skipped_slower"] == 1, after


# --- 8. a write-behind queue too small --------------------------------------------------------


def test_a_tiny_write_queue_drops_the_oldest_counted_and_nothing_fails(
    demo_models, scenario, tmp_path
):
    """Redis holds every write (CLIENT PAUSE WRITE: reads still answer) while A serves four
    conversations: the first waits in its put, the newest waits queued, the two between are
    dropped (the queue holds one past its 1 KB bound). Nothing fails; B continues the newest
    from the tier."""
    scs = [scenario(f"queue-{i}") for i in range(4)]
    a_extra = ["--shared-tier-queue-mb", "0.001", "--shared-tier-budget", "20"]
    with Fleet(demo_models.path(MODEL), tmp_path, a_extra=a_extra) as f:
        f.redis.client().execute_command("CLIENT", "PAUSE", "5000", "WRITE")
        for sc in scs:
            turn(f.a, sc, 1)
        during = tier(f.a)
        # the one being written and the newest: never more
        assert during["queue_depth"] <= 2 and during["errors"] == 0, during
        st = wait_settled(f.a, 4)
        assert st["drops"] >= 1 and st["writes"] + st["drops"] == 4, st
        assert st["errors"] == 0 and st["timeouts"] == 0 and st["breaker"] == "closed", st
        before = tier(f.b)
        reply, _ = turn(f.b, scs[-1], 2)
        assert tier(f.b)["hits"] == before["hits"] + 1
        assert cached(reply) == scs[-1].prefixes[0]


# --- 2. Redis stopped -------------------------------------------------------------------------


def test_a_stopped_tier_costs_no_wait_opens_the_breaker_and_is_probed_again(
    demo_models, scenario, tmp_path
):
    sc, later = scenario("stopped"), scenario("stopped-later")
    with Fleet(demo_models.path(MODEL), tmp_path) as f:
        a_writes_three_turns(f, sc)
        f.redis.stop()
        before = tier(f.b)
        _, elapsed = turn(f.b, sc, 4)
        assert elapsed < DEFAULT_BUDGET_S + SLACK_S
        st = tier(f.b)
        assert st["errors"] - before["errors"] >= 1 and st["hits"] == before["hits"], st

        # the same turn again until the breaker opens (failures in a row: fetches, writes)
        for _ in range(5):
            if tier(f.b)["breaker"] == "open":
                break
            _, elapsed = turn(f.b, sc, 4)
            assert elapsed < DEFAULT_BUDGET_S + SLACK_S
        opened = tier(f.b)
        opened_at = time.monotonic()
        assert opened["breaker"] == "open" and opened["breaker_opens"] == 1, opened
        # open: not asked at all
        _, elapsed = turn(f.b, sc, 4)
        st = tier(f.b)
        assert st["skipped_open"] - opened["skipped_open"] == 1, st
        assert st["errors"] == opened["errors"], st

        f.redis.start()  # back, empty, on the same port
        closed = None
        while time.monotonic() - opened_at < COOLDOWN_S + SLACK_S + 20:
            turn(f.b, sc, 5)
            st = tier(f.b)
            if st["breaker"] == "closed":
                closed = time.monotonic() - opened_at
                break
            assert st["breaker"] in ("open", "half-open"), st
            time.sleep(1.0)
        assert closed is not None, (st, f.b.log()[-3000:])
        assert closed >= COOLDOWN_S - 2.0, closed  # it waited its cooldown
        assert st["breaker_opens"] == 1

        # and the tier serves again: A's next conversation continues on B
        written = persist(f.a)["written"]
        for n in (1, 2):
            turn(f.a, later, n)
        wait_settled(f.a, written + 2)
        before = tier(f.b)
        reply, _ = turn(f.b, later, 3)
        assert tier(f.b)["hits"] == before["hits"] + 1
        assert cached(reply) == later.prefixes[1]


# --- 3. Redis paused --------------------------------------------------------------------------


def test_a_paused_tier_costs_at_most_the_budget_and_never_holds_a_shutdown(
    demo_models, scenario, tmp_path
):
    """SIGSTOP: connections open, nothing answers. B (--shared-tier-budget 1) answers each
    turn within the budget plus its own prefill, the breaker opens on the timeouts, and B
    stopped meanwhile exits by itself within its flush timeout."""
    sc = scenario("paused")
    budget, flush_s = 1.0, 5.0  # --persist-flush-timeout's default
    with Fleet(demo_models.path(MODEL), tmp_path, b_extra=["--shared-tier-budget", "1"]) as f:
        a_writes_three_turns(f, sc)
        before = tier(f.b)
        f.redis.pause()
        try:
            _, elapsed = turn(f.b, sc, 4)
            st = tier(f.b)  # /v1/status does not wait on the tier
            assert elapsed < budget + SLACK_S, elapsed
            assert st["timeouts"] - before["timeouts"] >= 1, st
            assert st["hits"] == before["hits"] and st["bad_values"] == before["bad_values"]
            _, elapsed = turn(f.b, sc, 5)
            assert elapsed < budget + SLACK_S, elapsed
            st = tier(f.b)
            assert st["breaker_opens"] >= 1 and st["hits"] == before["hits"], st
            started = time.monotonic()
            f.b.proc.send_signal(signal.SIGINT)
            rc = f.b.proc.wait(flush_s + budget + SLACK_S)
            assert time.monotonic() - started < flush_s + budget + SLACK_S
            assert rc in (0, 130, -signal.SIGINT), rc  # 130: `kvsnap serve: interrupted`
            assert "Application shutdown complete" in f.b.log()
        finally:
            f.redis.resume()
        turn(f.a, sc, 4)  # and after: answered


# --- 6. no memory left ------------------------------------------------------------------------


@pytest.mark.parametrize("room", ["1mb", "a-few-mb"])
def test_a_tier_out_of_memory_never_fails_a_request(demo_models, scenario, tmp_path, room):
    """1mb: below what an empty Redis uses, so every write is refused (OOM); a few MB: the
    LRU evicts values as A writes, so B may find a record whose parts are gone."""
    sc = scenario(f"memory-{room}")
    with Fleet(demo_models.path(MODEL), tmp_path) as f:
        client = f.redis.client()
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", "1mb" if room == "1mb" else str(used + 3 * 2**20))
        client.config_set("maxmemory-policy", "allkeys-lru")
        for n in (1, 2, 3):
            turn(f.a, sc, n)
        st_a = wait_settled(f.a, 3)
        if room == "1mb":  # refused: counted (reads still answer, so the breaker stays shut)
            assert st_a["errors"] >= 1 and st_a["writes"] == 0, st_a
        else:
            assert int(client.info("stats")["evicted_keys"]) >= 1
        for n in (4, 5):
            turn(f.b, sc, n)
        st_b = tier(f.b)
        assert st_b["bad_values"] == 0, st_b  # evicted is a miss, never a torn value
        decided = ("hits", "misses", "skipped_slower", "skipped_open", "errors", "timeouts")
        assert sum(st_b[k] for k in decided) >= 1, st_b
        if room == "1mb":
            assert st_b["hits"] == 0, st_b
        b_store = f.tmp / "b"
    assert_sound(b_store)  # whatever B fetched names only parts it holds


# --- a tier holding the fleet's secret --------------------------------------------------------


def test_a_replica_started_after_a_flush_still_shares_with_the_fleet(
    demo_models, scenario, tmp_path
):
    """Without KVSNAP_SHARED_TIER_SECRET the first replica stores a random secret in the
    tier (kvsnap:t2:secret). A FLUSHALL (or an LRU eviction of that key, or a Redis restarted
    without persistence) removes it: replicas running keep theirs, a replica started after
    must still end up with the same one, or it never finds the fleet's conversations."""
    model = demo_models.path(MODEL)
    sc = scenario("secret-flushed")
    with Fleet(model, tmp_path, env=NO_SECRET_ENV) as f:
        turn(f.a, sc, 1)  # A's first request: the secret is made and kept
        assert f.redis.client().exists("kvsnap:t2:secret")
        wait_settled(f.a, 1)
        f.redis.client().flushall()
        c = launch(model, tmp_path / "c", tmp_path / "c.log", f.redis.url, NO_SECRET_ENV)
        f.callback(c.stop)
        c.wait_ready(120)
        for n in (2, 3):
            turn(f.a, sc, n)
        wait_settled(f.a, 3)
        reply, _ = turn(c, sc, 4)
        st = tier(c)
        counts = {k: st[k] for k in ("hits", "misses", "bad_values", "errors")}
        assert st["hits"] == 1 and cached(reply) == sc.prefixes[2], counts


# --- a shared folder --------------------------------------------------------------------------


def test_a_shared_folder_tier_carries_a_conversation_and_refuses_a_flipped_file(
    demo_models, scenario, tmp_path
):
    good, bad = scenario("folder"), scenario("folder-flipped")
    shared = tmp_path / "shared"
    shared.mkdir()

    def files() -> set[Path]:
        return {p for p in (shared / "kvsnap-t2").rglob("*") if p.is_file()}

    with Fleet(demo_models.path(MODEL), tmp_path, tier_url=str(shared)) as f:
        for n in (1, 2, 3):
            turn(f.a, good, n)
        wait_settled(f.a, 3)
        first = files()
        for n in (1, 2, 3):
            turn(f.a, bad, n)
        wait_settled(f.a, 6)
        added = files() - first
        assert not [p for p in files() if p.name.startswith(".tmp-")]
        records = [p for p in added if p.parent.name == "record"]
        assert records and len({p.parent.parent for p in added}) == 1  # one namespace
        for path in records:
            value = path.read_bytes()
            (n,) = struct.unpack(">I", value[len(MAGIC) : len(MAGIC) + 4])
            i = len(MAGIC) + 4 + n + 100
            path.write_bytes(value[:i] + bytes([value[i] ^ 0x01]) + value[i + 1 :])

        reply, _ = turn(f.b, good, 4)
        assert cached(reply) == good.prefixes[2] and tier(f.b)["hits"] == 1
        before = tier(f.b)
        reply, _ = turn(f.b, bad, 4)
        after = tier(f.b)
        assert after["bad_values"] == before["bad_values"] + 1, after
        assert after["hits"] == before["hits"]
        assert cached(reply) < 0.1 * reply["usage"]["prompt_tokens"]
