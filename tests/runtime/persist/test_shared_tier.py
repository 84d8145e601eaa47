"""The shared tier's own machinery (kvsnap/runtime/persist/shared_tier.py), in process: the
breaker's states, the write-behind queue's byte bound, a fetch that waits at most its
budget and a tier that fails or is shut off by the breaker. A tier in memory stands in for
Redis (tests/runtime/persist/test_shared_tier_faults.py runs real servers on a real one)."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.shared_tier import open_shared_tier
from helpers.snapshot_meta import fixed_identity

from kvsnap.runtime.persist.options import TierOptions
from kvsnap.runtime.persist.shared_tier import Breaker, SharedTier, TierPush
from kvsnap.store.tier_backends import SECRET_ENV, TierUnavailable

COOLDOWN_S = 0.2
SLACK_S = 2.0
IDENTITY = fixed_identity(["KVCache"])
TOKENS = list(range(100, 200))


# --- the breaker ------------------------------------------------------------------------------


def test_a_closed_breaker_allows_and_opens_after_that_many_failures_in_a_row():
    b = Breaker(failures_to_open=3, cooldown_s=COOLDOWN_S)
    assert b.state == "closed" and b.allow()
    b.failure()
    b.failure()
    b.success()  # in a row: a success starts the count again
    b.failure()
    b.failure()
    assert b.state == "closed" and b.allow() and b.opens == 0
    b.failure()
    assert b.state == "open" and b.opens == 1
    assert not b.allow() and not b.allow()


def test_an_open_breaker_lets_one_probe_through_after_its_cooldown():
    b = Breaker(failures_to_open=1, cooldown_s=COOLDOWN_S)
    b.failure()
    assert not b.allow()
    time.sleep(COOLDOWN_S * 1.5)
    assert b.state == "open"
    assert b.allow()  # the probe
    assert b.state == "half-open"
    assert not b.allow()  # one probe at a time
    b.success()
    assert b.state == "closed" and b.failures == 0 and b.allow()
    assert b.opens == 1


def test_a_failed_probe_opens_the_breaker_for_another_cooldown():
    b = Breaker(failures_to_open=2, cooldown_s=COOLDOWN_S)
    b.failure()
    b.failure()
    time.sleep(COOLDOWN_S * 1.5)
    assert b.allow()
    b.failure()  # the probe failed: open again at once, whatever the count
    assert b.state == "open" and b.opens == 2
    assert not b.allow()
    time.sleep(COOLDOWN_S * 1.5)
    assert b.allow()
    b.success()
    assert b.state == "closed"


def test_failures_reported_while_open_count_no_new_opening():
    b = Breaker(failures_to_open=1, cooldown_s=COOLDOWN_S)
    b.failure()
    b.failure()  # a write already under way when it opened, failing too
    b.failure()
    assert b.opens == 1 and b.state == "open"


def test_of_many_threads_after_the_cooldown_exactly_one_probes():
    b = Breaker(failures_to_open=1, cooldown_s=COOLDOWN_S)
    b.failure()
    time.sleep(COOLDOWN_S * 1.5)
    start = threading.Barrier(16)
    allowed = []

    def ask():
        start.wait()
        allowed.append(b.allow())

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(allowed) == [False] * 15 + [True]


# --- a shared tier on a tier in memory --------------------------------------------------------


class MemoryTier:
    """A TierBackend in a dict: ``down`` fails every call, ``gate`` holds ``missing`` (the
    first call of a write-behind) until set, ``delay`` slows every call."""

    where = "memory://test"

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.indexes: dict[str, set[str]] = {}
        self.calls: list[str] = []
        self.down = False
        self.delay = 0.0
        self.gate = threading.Event()
        self.gate.set()

    def _call(self, what: str) -> None:
        self.calls.append(what)
        if self.delay:
            time.sleep(self.delay)
        if self.down:
            raise TierUnavailable(f"{self.where}: down")

    def get(self, name):
        self._call("get")
        return self.values.get(name)

    def put(self, name, value):
        self._call("put")
        self.values[name] = value

    def missing(self, names):
        self._call("missing")
        self.gate.wait(30)
        return [n for n in names if n not in self.values]

    def index_add(self, index, member, limit):
        self._call("index_add")
        self.indexes.setdefault(index, set()).add(member)

    def index_remove(self, index, members):
        self._call("index_remove")
        self.indexes.get(index, set()).difference_update(members)

    def index_members(self, index):
        self._call("index_members")
        return set(self.indexes.get(index, ()))

    def shared_secret(self, keep=None):
        self._call("shared_secret")
        return b"s" * 32

    def close(self):
        return None


@pytest.fixture()
def make_tier(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    made: list[SharedTier] = []

    def make(backend: MemoryTier, **options) -> SharedTier:
        store = tmp_path / f"store-{len(made)}"
        store.mkdir()
        tier = open_shared_tier(backend, TierOptions("memory://test", **options), IDENTITY, store)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close(1.0)


def push(tier: SharedTier, i: int, nbytes: int) -> None:
    """A record this replica does not hold (the write-behind ends at reading it)."""
    tier.push(TierPush("", f"{i:032x}", 10, "e" * 32, [], nbytes))


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def idle(tier: SharedTier) -> bool:
    return tier.as_dict()["queue_depth"] == 0  # nothing queued, nothing being written


def test_the_write_behind_queue_drops_its_oldest_past_its_byte_bound(make_tier):
    backend = MemoryTier()
    backend.gate.clear()
    tier = make_tier(backend, queue_bytes=1000)
    push(tier, 1, 600)
    wait_for(lambda: "missing" in backend.calls)  # the first is being written: held
    push(tier, 2, 600)
    assert tier.stats.drops == 0  # one queued may be past the bound on its own
    push(tier, 3, 600)
    push(tier, 4, 600)
    status = tier.as_dict()
    assert status["drops"] == 2 and status["queue_depth"] == 2  # the one being written counts
    assert status["queue_bytes"] == 600
    backend.gate.set()
    wait_for(lambda: idle(tier))
    assert tier.stats.drops == 2 and tier.stats.errors == 0
    assert tier.stats.superseded == 2  # the two not dropped: no local record to write
    assert tier.breaker.state == "closed"


def test_closing_waits_for_the_queue_at_most_its_timeout(make_tier):
    backend = MemoryTier()
    backend.gate.clear()
    tier = make_tier(backend)
    push(tier, 1, 10)
    push(tier, 2, 10)
    wait_for(lambda: "missing" in backend.calls)
    started = time.monotonic()
    assert tier.close(0.3) == 2  # the one being written and the one queued
    assert time.monotonic() - started < 0.3 + SLACK_S
    push(tier, 3, 10)  # after close: ignored
    assert tier.as_dict()["queue_depth"] == 1  # the one still being written, only
    backend.gate.set()


def test_a_fetch_waits_at_most_its_budget_on_a_tier_that_does_not_answer(make_tier):
    backend = MemoryTier()
    backend.delay = 3.0
    tier = make_tier(backend, budget_s=0.3)
    started = time.monotonic()
    assert tier.fetch(TOKENS, "") == 0
    assert time.monotonic() - started < 0.3 + SLACK_S
    assert tier.stats.timeouts == 1 and tier.stats.hits == 0
    assert tier.breaker.failures >= 1


def test_a_failing_tier_opens_the_breaker_and_is_not_asked_while_open(make_tier):
    backend = MemoryTier()
    backend.down = True
    tier = make_tier(backend, failures_to_open=3, cooldown_s=60.0)
    for _ in range(3):
        assert tier.fetch(TOKENS, "") == 0
    assert tier.stats.errors == 3 and tier.breaker.state == "open"
    asked = len(backend.calls)
    assert tier.fetch(TOKENS, "") == 0
    assert tier.stats.skipped_open == 1
    push(tier, 1, 10)  # not written behind while open: dropped, counted
    wait_for(lambda: idle(tier))
    assert tier.stats.drops == 1
    assert len(backend.calls) == asked
    assert tier.as_dict()["breaker"] == "open" and tier.as_dict()["breaker_opens"] == 1


def test_a_probe_that_ends_in_a_local_error_does_not_shut_the_tier_off_for_good(make_tier):
    """The breaker's probe after the cooldown may be a write-behind whose local record was
    superseded or evicted meanwhile: it neither succeeds nor fails on the tier. The breaker
    must let a later call probe again, or the tier is never asked again (every fetch
    skipped, every write dropped) until the replica restarts."""
    backend = MemoryTier()
    backend.down = True
    tier = make_tier(backend, failures_to_open=1, cooldown_s=COOLDOWN_S)
    assert tier.fetch(TOKENS, "") == 0
    assert tier.breaker.state == "open"
    backend.down = False  # the tier is back
    time.sleep(COOLDOWN_S * 1.5)
    push(tier, 1, 10)  # the probe: its local record is gone
    wait_for(lambda: idle(tier))
    assert tier.stats.superseded == 1
    time.sleep(COOLDOWN_S * 1.5)
    tier.fetch(TOKENS, "")
    assert tier.stats.skipped_open == 0, tier.as_dict()
    assert tier.breaker.state == "closed"


def test_a_fetched_record_goes_once_to_a_request_of_its_namespace_that_extends_it(make_tier):
    """What a fetch holds in memory for the engine (``take_fresh``) is handed to a request of
    the namespace it was fetched for, holding its tokens as a strict prefix and more than the
    memory already matched, once; a tenant never takes another's fetch."""
    from types import SimpleNamespace

    from kvsnap.runtime.persist.shared_tier import FetchedRecord

    tier = make_tier(MemoryTier())
    info = SimpleNamespace(n_tokens=60, tokens=TOKENS[:60])
    tier._fresh["k" * 32] = FetchedRecord("tenant-a", info, b"", {})  # type: ignore[arg-type]
    assert tier.take_fresh(TOKENS, "tenant-b", 0) is None  # another namespace
    assert tier.take_fresh(TOKENS[:60], "tenant-a", 0) is None  # nothing left to compute
    assert tier.take_fresh([7, *TOKENS[1:]], "tenant-a", 0) is None  # another prefix
    assert tier.take_fresh(TOKENS, "tenant-a", 60) is None  # memory holds as much
    taken = tier.take_fresh(TOKENS, "tenant-a", 59)
    assert taken is not None and taken.namespace == "tenant-a"
    assert tier.take_fresh(TOKENS, "tenant-a", 0) is None  # handed over once


def test_the_keeper_stores_a_taken_record_once_a_prompt_is_computed_never_before(
    make_tier, monkeypatch
):
    """Storing a fetched conversation (1.9 GB at 8k fp32 tokens) beside the prompt that uses
    it slowed that prompt: the keeper waits until a request's prompt has been computed since
    the record was taken (``note_prefill``), at most KEEP_AFTER_S; closing never waits that
    long and still stores what was fetched."""
    from types import SimpleNamespace

    import kvsnap.runtime.persist.shared_tier as shared_tier
    from kvsnap.runtime.persist.shared_tier import FetchedRecord
    from kvsnap.store.paths import part_path

    def fetched(tier: SharedTier, name: str) -> FetchedRecord:
        path = tier.store.root / "records" / f"{name}.safetensors"
        info = SimpleNamespace(n_tokens=60, tokens=TOKENS[:60], path=path)
        part = SimpleNamespace(head=b"head", runs=(memoryview(b"da"), memoryview(b"ta")))
        parts = {("block", name): part}
        record = FetchedRecord("tenant-a", info, b"record", parts)  # type: ignore[arg-type]
        tier._fresh[name] = record
        tier._keeping.add(name)
        tier._unreleased.append(record)
        tier._keeping_parts[("block", name)] = record.stored
        tier._keeper.submit(tier._keep, name, record)
        return record

    tier = make_tier(MemoryTier())
    record = fetched(tier, "a" * 32)
    assert tier.take_fresh(TOKENS, "tenant-a", 0) is record
    time.sleep(0.5)
    assert tier.stats.kept == 0 and not record.info.path.exists()  # its prompt is running
    # the local writer's record naming the part waits for the keeper (the engine copies
    # nothing): an event that is set once the part is stored
    waiting = tier.keeping("block", "a" * 32)
    assert waiting is not None and not waiting.is_set()
    assert tier.keeping("block", "f" * 32) is None
    tier.note_prefill(8, 0.1)  # a prompt computed (too short to teach the rate)
    assert waiting.wait(SLACK_S) and tier.stats.kept == 1
    assert record.info.path.read_bytes() == b"record"
    assert part_path(tier.store, "block", "a" * 32).read_bytes() == b"headdata"
    assert tier.keeping("block", "a" * 32) is None

    monkeypatch.setattr(shared_tier, "KEEP_AFTER_S", 0.3)
    never_taken = fetched(tier, "b" * 32)  # its request went away: kept all the same
    wait_for(lambda: tier.stats.kept == 2)
    assert never_taken.info.path.exists()

    monkeypatch.setattr(shared_tier, "KEEP_AFTER_S", 60.0)
    closing = make_tier(MemoryTier())
    last = fetched(closing, "c" * 32)
    started = time.monotonic()
    closing.close(1.0)
    assert time.monotonic() - started < SLACK_S and last.info.path.exists()
