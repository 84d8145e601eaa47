"""``--shared-tier``: a fleet's conversations, written behind to a shared tier and fetched by
whichever replica gets the next turn. No mlx import: a fetched part's buffer is made by
``store.fileio`` on the fetching thread.

Write-behind: once the local writer has put a conversation record (and its parts) on disk,
the record and the parts the tier lacks are sealed (``tier_values``) and put, each under its
own name, record after parts and index after record; a kill between two puts leaves values
no index names, never a record naming a part never put. The queue is bounded in bytes and
drops its oldest (counted) when full.

Fetch, on a request that will be captured: the namespace's longest record in the tier that
holds a strict prefix of the request, when this replica holds none as long. Its parts are
fetched only if that is expected to be sooner than prefilling the same tokens (measured
fetch and prefill rates) and within ``budget_s``; each is received straight into the mlx
buffer the cache will hold (a record's blocks, all fetched: one buffer per tensor for all its
tokens, ``store/tier_layout``, so the engine reads it as one prefix) and checked there
(this name, this model, the fleet's MAC, then as a stored part) before anything uses it.
The engine takes the record (re-keyed for the local store) at the request's lookup
(``take_fresh``) and those tensors as they are; meanwhile a keeper thread writes them from
the same buffers to a staging folder, fsyncs and moves them into the local store under its
lock, record last. Every failure is a miss that
is counted and logged; the request waits at most the budget whatever the tier does, and a
breaker stops asking a failing tier for ``cooldown_s`` before one probe.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvsnap.errors import SnapshotError, StoreError
from kvsnap.key import ModelIdentity, pack_tokens, tokens_digest
from kvsnap.runtime.persist.options import TierOptions
from kvsnap.snapshot.file import FormatError
from kvsnap.snapshot.format import BLOCK_KIND, CHECKPOINT_KIND
from kvsnap.snapshot.header import SnapshotInfo
from kvsnap.store.conversations import (
    conversation_digest,
    longest_persisted,
    namespace_tenant,
    read_parts,
    record_key,
    record_path,
    tenant_digest,
)
from kvsnap.store.fileio import TMP_PREFIX, fsync_dir, make_dirs, unfilled_tensors
from kvsnap.store.local import Store
from kvsnap.store.part_readers import on_mlx_thread, run_concurrently
from kvsnap.store.paths import has_part, part_path
from kvsnap.store.tier_backends import (
    TierBackend,
    TierUnavailable,
    ValueGone,
    fleet_secret_from_env,
    open_value,
)
from kvsnap.store.tier_layout import WAIT, ChainLayout, RecordBuffers
from kvsnap.store.tier_values import (
    BLOCK,
    CHECKPOINT,
    RECORD,
    RecordFields,
    TierNames,
    namespace_tag,
    receive_part,
    record_fields,
    record_info,
    rekeyed_record,
    seal,
    unseal,
)

log = logging.getLogger("kvsnap.tier")

TIER_KIND = {BLOCK_KIND: BLOCK, CHECKPOINT_KIND: CHECKPOINT}
RATE_WEIGHT = 0.3  # an exponentially weighted rate: the newest measure counts this much
MIN_PREFILL_SAMPLE = 64  # prefills shorter than this say little about the rate
STAGING_PREFIX = TMP_PREFIX + "tier-"
FETCH_THREADS = 4  # fetches at once (each waited for at most the budget)
PART_THREADS = 3  # parts of one fetch read at once: the tier's latency overlaps the checks
ALLOC_THREADS = 2  # threads that make a fetched record's buffers (tier_layout.ChainLayout)
FRESH_LIMIT = 4  # fetched records held for requests that have not looked them up yet
# The keeper stores a fetched record once a request's prompt has been computed since it was
# taken (writing 1.9 GB beside that prompt slowed it), or after this long whatever happens.
KEEP_AFTER_S = 30.0


@dataclass
class Breaker:
    """Closed → open after ``failures_to_open`` failures in a row; open → one probe after
    ``cooldown_s``; the probe's success closes it, its failure opens it again."""

    failures_to_open: int
    cooldown_s: float
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False
    opens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self) -> bool:
        with self._lock:
            if self.opened_at is None:
                return True
            if self.probing or time.monotonic() - self.opened_at < self.cooldown_s:
                return False
            self.probing = True
            return True

    def shut(self) -> bool:
        """Open and still cooling down: nothing to ask (a read, no probe taken)."""
        with self._lock:
            return self.opened_at is not None and (
                self.probing or time.monotonic() - self.opened_at < self.cooldown_s
            )

    def success(self) -> None:
        with self._lock:
            self.failures, self.opened_at, self.probing = 0, None, False

    def abandon(self) -> None:
        """A call that never reached the tier: a probe it was is given back (the next call
        probes), nothing else changes."""
        with self._lock:
            self.probing = False

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.probing or self.failures >= self.failures_to_open:
                if self.opened_at is None or self.probing:
                    self.opens += 1
                self.opened_at, self.probing = time.monotonic(), False

    @property
    def state(self) -> str:
        with self._lock:
            if self.opened_at is None:
                return "closed"
            return "half-open" if self.probing else "open"


@dataclass
class TierStats:
    hits: int = 0  # fetches that made a prefix local
    kept: int = 0  # fetched records then written to the local store (off the request's path)
    misses: int = 0  # nothing in the tier for the request (or it was evicted)
    contiguous: int = 0  # hits received as one buffer per tensor (read as one prefix)
    fetched_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    fetch_seconds: float = 0.0
    skipped_slower: int = 0  # expected slower than prefilling (or past the budget)
    skipped_local: int = 0  # this replica held it already
    skipped_open: int = 0  # not asked: the breaker was open
    timeouts: int = 0  # past the budget
    bad_values: int = 0  # torn, flipped, foreign: never loaded
    errors: int = 0  # the tier failed or refused
    writes: int = 0  # records written behind
    parts_written: int = 0
    drops: int = 0  # write-behind items dropped for a full queue (or an open breaker)
    superseded: int = 0  # its local record was replaced (the next turn's) before it went


@dataclass
class TierPush:
    """A conversation record the local writer has just put, to write behind."""

    namespace: str
    local_key: str
    n_tokens: int
    tokens_digest: str
    reaches: list  # (kind, key) of its parts
    nbytes: int


class SharedTier:
    def __init__(
        self,
        backend: TierBackend,
        options: TierOptions,
        identity: ModelIdentity,
        store_root: Path,
        local_conv_digest: Callable[[str], str],
        local_tenant: Callable[[str], str],
        on_fetched: Callable[[], None],
    ) -> None:
        self.backend = backend
        self.options = options
        self.identity = identity
        self.store = Store.open(store_root)  # its own: the lock's depth is per object
        sweep_staging(self.store.root)
        self.local_conv_digest = local_conv_digest
        self.local_tenant = local_tenant
        self.on_fetched = on_fetched
        self.stats = TierStats()
        self.breaker = Breaker(options.failures_to_open, options.cooldown_s)
        self.fetch_rate = 0.0  # bytes/s, measured
        self.prefill_rate = 0.0  # tokens/s, measured
        self.recent_local: dict[str, None] = {}  # local record keys captured here (bounded)
        self._secret: bytes | None = fleet_secret_from_env()
        self._env_secret = self._secret is not None
        self._queue: deque[TierPush] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        # conversations being fetched (local record key -> done): a second request for one
        # waits for that fetch instead of making its own
        self._inflight: dict[str, threading.Event] = {}
        self._inflight_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            FETCH_THREADS, thread_name_prefix="kvsnap-tier"
        )
        # fetched records the engine has not taken yet, and those the keeper is storing
        self._fresh: dict[str, FetchedRecord] = {}
        self._keeping: set[str] = set()
        self._unreleased: list[FetchedRecord] = []  # their keeper waits (KEEP_AFTER_S at most)
        self._keeping_parts: dict[tuple[str, str], threading.Event] = {}  # set once stored
        self._keeper = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvsnap-keep", initializer=_lowest_priority
        )
        # makes a fetched record's buffers (mlx zeros, a stream per thread): the kernel's fresh
        # pages cost the CPU time, which two threads halve (1.2 -> 0.6 s per 2 GB here)
        self._allocator = concurrent.futures.ThreadPoolExecutor(
            ALLOC_THREADS, thread_name_prefix="kvsnap-tier-alloc"
        )
        self._thread = threading.Thread(target=self._run, name="kvsnap-tier-push", daemon=True)
        self._thread.start()

    # --- names ------------------------------------------------------------------------------

    def _secret_now(self) -> bytes:
        if self._secret is None:
            self._secret = self.backend.shared_secret()
        return self._secret

    def _names(self, namespace: str) -> TierNames:
        return TierNames.of(self.identity, namespace_tag(self._secret_now(), namespace))

    def _tier_fields(self, names: TierNames, namespace: str, tdigest: str, n: int):
        conv = conversation_digest(names.namespace_tag)
        # the store's formula under the fleet's secret: a key's records share it in the tier too
        tenant = tenant_digest(self._secret_now(), namespace_tenant(namespace))
        key = record_key(self.identity.digest, conv, tdigest, n)
        return RecordFields(key, conv, tenant)

    # --- the engine's notes (engine thread) -------------------------------------------------

    def note_local(self, local_key: str) -> None:
        """A request prefix this replica captured: a tier fetch of the same is not needed."""
        self.recent_local[local_key] = None
        if len(self.recent_local) > 4096:
            del self.recent_local[next(iter(self.recent_local))]

    def note_prefill(self, n_tokens: int, seconds: float) -> None:
        """A request's prompt was computed (its prefix kept): the rate, and the records taken
        before it may be stored now."""
        if n_tokens >= MIN_PREFILL_SAMPLE and seconds > 0:
            self.prefill_rate = _blend(self.prefill_rate, n_tokens / seconds)
        self._release(taken_only=True)

    def _release(self, taken_only: bool) -> None:
        """Let the keeper store the records taken by a request (or all, at close)."""
        with self._inflight_lock:
            held = [f for f in self._unreleased if f.taken or not taken_only]
            for fetched in held:
                self._unreleased.remove(fetched)
        for fetched in held:
            fetched.release.set()

    # --- write-behind (the local writer's thread, then ours) ---------------------------------

    def push(self, item: TierPush) -> None:
        """Queue a write-behind; never blocks. Past the byte bound the oldest are dropped."""
        with self._cond:
            if self._closing:
                return
            self._queue.append(item)
            self._queued_bytes += item.nbytes
            while len(self._queue) > 1 and self._queued_bytes > self.options.queue_bytes:
                dropped = self._queue.popleft()
                self._queued_bytes -= dropped.nbytes
                self.stats.drops += 1
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._queued_bytes -= item.nbytes
                self._busy = True
            try:
                self._write_behind(item)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write_behind(self, item: TierPush) -> None:
        if not self.breaker.allow():
            self.stats.drops += 1
            return
        try:
            self._put(item)
        except TierUnavailable as exc:
            self.breaker.failure()
            self.stats.errors += 1
            log.warning("[kvsnap] shared tier: a conversation was not written behind: %s", exc)
            return
        except (OSError, SnapshotError, StoreError) as exc:  # evicted or rewritten locally
            self.breaker.abandon()
            self.stats.superseded += 1
            log.info("[kvsnap] shared tier: %s not written behind: %s", item.local_key, exc)
            return
        except Exception:  # the thread must outlive one bad write: logged
            self.stats.errors += 1
            self.breaker.abandon()
            log.exception("[kvsnap] shared tier: writing behind failed")
            return
        self.breaker.success()

    def _put(self, item: TierPush) -> None:
        if not self._env_secret:  # put back if the tier lost it; adopt the tier's if it differs
            self._secret = self.backend.shared_secret(keep=self._secret)
        names = self._names(item.namespace)
        model = self.identity.digest
        parts = {names.value(TIER_KIND[kind], key): (kind, key) for kind, key in item.reaches}
        sizes = []
        missing = set(self.backend.missing(list(parts)))
        for name, (kind, key) in parts.items():
            path = part_path(self.store, kind, key)
            sizes.append([TIER_KIND[kind], key, path.stat().st_size])
            if name in missing:
                data = path.read_bytes()
                value = seal(self._secret_now(), name, TIER_KIND[kind], model, data)
                self.backend.put(name, value)
                self.stats.bytes_out += len(value)
                self.stats.parts_written += 1
        fields = self._tier_fields(names, item.namespace, item.tokens_digest, item.n_tokens)
        local = record_path(self.store.root, item.local_key).read_bytes()
        name = names.value(RECORD, fields.key)
        value = seal(
            self._secret_now(),
            name,
            RECORD,
            model,
            rekeyed_record(local, fields),
            parts=sizes,
        )
        self.backend.put(name, value)
        self.stats.bytes_out += len(value)
        # An earlier turn's record stays indexed (its values are never removed either): a
        # regenerated or edited turn, a branch, continues from it on any replica. The index's
        # bound (index_limit, the oldest dropped) keeps it small.
        self.backend.index_add(names.index, fields.key, self.options.index_limit)
        self.stats.writes += 1

    # --- fetch (a request's worker thread) ---------------------------------------------------

    def asks(self) -> bool:
        """Whether a request would ask the tier now (any thread, no I/O): the route skips the
        hop to a worker thread while the breaker is open."""
        if self.breaker.shut():
            self.stats.skipped_open += 1
            return False
        return True

    def fetch(self, tokens: Sequence[int], namespace: str) -> int:
        """Make the namespace's longest tier prefix of ``tokens`` local, if worth it; the
        tokens made local (0: nothing done). Waits at most the budget."""
        if len(tokens) < 2:
            return 0
        if not self.breaker.allow():
            self.stats.skipped_open += 1
            return 0
        attempt = _Attempt(time.monotonic() + self.options.budget_s)
        future = self._pool.submit(self._fetch_guarded, tuple(tokens), namespace, attempt)
        try:
            return future.result(timeout=self.options.budget_s)
        except concurrent.futures.TimeoutError:
            future.cancel()  # not started yet: it would ask the tier past its deadline
            self._past_budget(attempt)
            return 0

    def _past_budget(self, attempt: _Attempt) -> None:
        """The request gave up on the tier at its budget: counted once (by the request or by
        the fetch that noticed first), a failure for the breaker, and what was read by then
        teaches the fetch rate (so a tier too slow for the budget is not asked again)."""
        if not attempt.settle():
            return
        self.stats.timeouts += 1
        self.breaker.failure()
        if attempt.bytes_read:
            self.fetch_rate = _blend(self.fetch_rate, attempt.bytes_read / self.options.budget_s)
        log.warning(
            "[kvsnap] shared tier %s: not fetched within %.1fs (--shared-tier-budget); the "
            "request prefills",
            self.backend.where,
            self.options.budget_s,
        )

    def _fetch_guarded(self, tokens: tuple, namespace: str, attempt: _Attempt) -> int:
        try:
            n = self._fetch(tokens, namespace, attempt)
        except _PastBudget:
            self._past_budget(attempt)
            return 0
        except TierUnavailable as exc:
            if time.monotonic() >= attempt.deadline:
                # the client's socket timeout is the budget: a tier that did not answer in
                # time is past the budget, however the race with the request's own wait ends
                self._past_budget(attempt)
                return 0
            self.stats.errors += 1
            if attempt.settle():  # not when the request already gave up on it
                self.breaker.failure()
            log.warning("[kvsnap] shared tier: %s; the request prefills", exc)
            return 0
        except (OSError, StoreError) as exc:  # the local store: disk full, permissions
            self.stats.errors += 1
            self.breaker.abandon()
            log.warning("[kvsnap] shared tier: a fetched prefix was not stored: %s", exc)
            return 0
        except Exception:  # a request never fails for the tier: logged, counted
            self.stats.errors += 1
            self.breaker.abandon()
            log.exception("[kvsnap] shared tier: fetch failed; the request prefills")
            return 0
        if attempt.settle():  # a fetch that ended after its request gave up is no success
            self.breaker.success()
        return n

    def _bad(self, what: str, why: str) -> int:
        self.stats.bad_values += 1
        log.warning("[kvsnap] shared tier: %s not used: %s", what, why)
        return 0

    def _fetch(self, tokens: tuple, namespace: str, attempt: _Attempt) -> int:
        started = time.monotonic()
        names = self._names(namespace)
        conv = conversation_digest(names.namespace_tag)
        members = self.backend.index_members(names.index)
        found = longest_persisted(members, self.identity.digest, conv, tokens, 0)
        if found is None:
            self.stats.misses += 1
            return 0
        n, tier_key = found
        tdigest = tokens_digest(tokens[:n])
        local_key = record_key(self.identity.digest, self.local_conv_digest(namespace), tdigest, n)
        if local_key in self.recent_local or record_path(self.store.root, local_key).exists():
            self.stats.skipped_local += 1
            return 0
        with self._inflight_lock:
            if local_key in self._fresh or local_key in self._keeping:  # fetched: in memory
                self.stats.skipped_local += 1
                return 0
            running = self._inflight.get(local_key)
            if running is None:
                self._inflight[local_key] = threading.Event()
        if running is not None:  # another request's fetch of it: its result is ours
            running.wait(max(0.0, attempt.deadline - time.monotonic()))
            self.stats.skipped_local += 1
            return 0
        try:
            return self._fetch_record(
                names, conv, n, tier_key, local_key, tokens, namespace, attempt, started
            )
        finally:
            with self._inflight_lock:
                self._inflight.pop(local_key).set()

    def _fetch_record(
        self,
        names: TierNames,
        conv: str,
        n: int,
        tier_key: str,
        local_key: str,
        tokens: tuple,
        namespace: str,
        attempt: _Attempt,
        started: float,
    ) -> int:
        name = names.value(RECORD, tier_key)
        value = self.backend.get(name)
        if value is None:  # evicted: the index named a value the tier no longer holds
            self.stats.misses += 1
            self.backend.index_remove(names.index, [tier_key])
            return 0
        try:
            opened = unseal(self._secret_now(), name, RECORD, self.identity.digest, value)
            meta, raw = record_fields(opened.payload)
        except (FormatError, SnapshotError, ValueError) as exc:
            return self._bad(f"tier record {tier_key}", str(exc))
        if (
            meta.get("kvsnap.key") != tier_key
            or meta.get("kvsnap.prompt_digest") != conv
            or meta.get("kvsnap.model_digest") != self.identity.digest
            or raw != pack_tokens(tokens[:n])
        ):
            return self._bad(f"tier record {tier_key}", "holds another prefix than its name")
        fields = RecordFields(
            local_key, self.local_conv_digest(namespace), self.local_tenant(namespace)
        )
        target = record_path(self.store.root, local_key)
        try:
            data = rekeyed_record(opened.payload, fields)
            info = record_info(data, target, n)
        except (SnapshotError, ValueError) as exc:
            return self._bad(f"tier record {tier_key}", getattr(exc, "reason", str(exc)))
        sizes = _sizes(opened.header.get("parts"))
        wanted = [p for p in read_parts(info) if not has_part(self.store, *p)]
        nbytes = sum(sizes.get((TIER_KIND[k], key), 0) for k, key in wanted)
        if not self._worth_it(n, nbytes, attempt.deadline):
            self.stats.skipped_slower += 1
            return 0
        layout = _layout_for(
            info, wanted, self._allocator.submit, sizes, attempt.deadline, f"tier record {tier_key}"
        )
        fetched_all = False
        try:
            parts = self._fetch_parts(names, wanted, attempt, layout)
            fetched_all = True
        except _Missed as missed:
            setattr(self.stats, missed.counter, getattr(self.stats, missed.counter) + 1)
            if missed.why:
                log.warning("[kvsnap] shared tier: %s not used: %s", missed.what, missed.why)
            return 0
        finally:
            if layout is not None and not fetched_all:  # a miss, past the budget, the tier
                layout.abandon()  # failed: its buffers are not zeroed for nothing
        got = sum(p.nbytes for p in parts.values())
        buffers = None
        if layout is not None:  # the blocks received before the buffers were made: copied in
            blocks = {key: part for (kind, key), part in parts.items() if kind == BLOCK_KIND}
            buffers = layout.finish(blocks)
            parts.update({(BLOCK_KIND, key): part for key, part in blocks.items()})
        fetched = FetchedRecord(namespace, info, data, parts, buffers)
        with self._inflight_lock:
            self._fresh[local_key] = fetched
            while len(self._fresh) > FRESH_LIMIT:  # never taken (the request went away)
                self._fresh.pop(next(iter(self._fresh))).release.set()
            self._keeping.add(local_key)
            self._unreleased.append(fetched)
            for part in parts:
                self._keeping_parts[part] = fetched.stored
        self._keeper.submit(self._keep, local_key, fetched)
        elapsed = time.monotonic() - started
        self.stats.hits += 1
        self.stats.contiguous += buffers is not None
        self.stats.fetched_tokens += n
        self.stats.bytes_in += got + len(value)
        self.stats.fetch_seconds += elapsed
        if got:
            self.fetch_rate = _blend(self.fetch_rate, got / max(elapsed, 1e-6))
        return n

    def _fetch_parts(
        self, names: TierNames, wanted: list, attempt: _Attempt, layout: ChainLayout | None
    ) -> dict:
        """Fetch and check each (kind, key), PART_THREADS at a time, each received straight
        into the mlx buffers the cache will hold (made on this thread: store/part_readers;
        a block into ``layout``'s, when it fits): their ``ReceivedPart`` by (kind, key), or
        _Missed at the first that fails (in order; the parts not started then are never asked
        for)."""
        calls = [
            functools.partial(self._fetch_part, names, kind, key, attempt, layout)
            for kind, key in wanted
        ]
        return dict(zip(wanted, run_concurrently(calls, PART_THREADS)))

    def _fetch_part(
        self, names: TierNames, kind: str, key: str, attempt: _Attempt, layout: ChainLayout | None
    ):
        try:
            return self._receive_part(names, kind, key, attempt, layout)
        except ValueGone:  # evicted while it was read: as if the record named a part gone
            if layout is not None:
                layout.abandon()
            raise _Missed("misses") from None
        except BaseException:
            if layout is not None:  # the fetch is over: a block waiting for its buffers stops
                layout.abandon()
            raise

    def _receive_part(
        self, names: TierNames, kind: str, key: str, attempt: _Attempt, layout: ChainLayout | None
    ):
        if time.monotonic() > attempt.deadline:
            raise _PastBudget()
        name = names.value(TIER_KIND[kind], key)
        with open_value(self.backend, name) as value:
            if value is None:  # evicted: the record named a part the tier no longer holds
                raise _Missed("misses")
            attempt.bytes_read += value.size
            try:  # checked as it arrives, in the buffers the engine loads and the store keeps
                return receive_part(
                    value,
                    self._secret_now(),
                    name,
                    TIER_KIND[kind],
                    self.identity.digest,
                    kind,
                    part_path(self.store, kind, key),
                    functools.partial(_place, layout if kind == BLOCK_KIND else None, key),
                )
            except FormatError as exc:
                raise _Missed("bad_values", f"tier {kind} {key}", str(exc)) from None
            except SnapshotError as exc:
                raise _Missed("bad_values", f"tier {kind} {key}", exc.reason) from None

    def keeping(self, kind: str, key: str) -> threading.Event | None:
        """The event set once the keeper has stored (or failed to store) this fetched part,
        while it is to: a record naming it is written after that (the engine need not copy
        it again), None otherwise."""
        with self._inflight_lock:
            return self._keeping_parts.get((kind, key))

    def take_fresh(self, tokens: Sequence[int], namespace: str, above: int):
        """The engine thread, at a request's lookup: a record fetched for this namespace
        that holds more than ``above`` tokens of ``tokens`` (at least one left to compute),
        handed over once (its parts load from memory while the store keeps them)."""
        with self._inflight_lock:
            for key, fetched in self._fresh.items():
                n = fetched.info.n_tokens
                if (
                    fetched.namespace == namespace
                    and above < n < len(tokens)
                    and tuple(fetched.info.tokens) == tuple(tokens[:n])
                ):
                    fetched.taken = True
                    return self._fresh.pop(key)
        return None

    def _keep(self, local_key: str, fetched: FetchedRecord) -> None:
        """The keeper thread: a fetched record and its parts written to the local store with
        its crash safety (staged, fsynced, moved in under the lock, record last), off the
        request's path and once the request that took it has its prompt computed (at most
        KEEP_AFTER_S later); the engine's index then sees it."""
        fetched.release.wait(KEEP_AFTER_S)
        try:
            store = Store(root=self.store.root, fsync=self.store.fsync)  # this thread's lock
            with _Staged(store) as staged:
                staged.file(fetched.info.path).write_bytes(fetched.record)
                for (kind, key), part in fetched.parts.items():
                    if not has_part(self.store, kind, key):  # the engine may have written it
                        with open(staged.file(part_path(store, kind, key)), "wb") as f:
                            f.write(part.head)
                            for run in part.runs:
                                f.write(run)
                staged.install()
        except (OSError, StoreError) as exc:  # disk full, permissions: served, not kept
            self.stats.errors += 1
            log.warning("[kvsnap] shared tier: a fetched prefix was not stored: %s", exc)
        except Exception:  # the keeper must outlive one bad write: logged, counted
            self.stats.errors += 1
            log.exception("[kvsnap] shared tier: storing a fetched prefix failed")
        else:
            self.stats.kept += 1
            self.on_fetched()
        finally:
            with self._inflight_lock:
                self._keeping.discard(local_key)
                for part in fetched.parts:
                    if self._keeping_parts.get(part) is fetched.stored:
                        del self._keeping_parts[part]
            fetched.stored.set()

    def _worth_it(self, n: int, nbytes: int, deadline: float) -> bool:
        """Fetching ``nbytes`` expected sooner than prefilling ``n`` tokens, and within the
        budget. Before a rate is measured, fetching is assumed the faster."""
        fetch_s = nbytes / self.fetch_rate if self.fetch_rate else 0.0
        prefill_s = n / self.prefill_rate if self.prefill_rate else float("inf")
        return fetch_s < prefill_s and fetch_s <= deadline - time.monotonic()

    # --- status and shutdown ----------------------------------------------------------------

    def as_dict(self) -> dict:
        with self._cond:
            # the one being written counts: 0 means everything queued is in the tier
            depth, queued = len(self._queue) + int(self._busy), self._queued_bytes
        return {
            "enabled": True,
            "where": self.backend.where,
            "breaker": self.breaker.state,
            "breaker_opens": self.breaker.opens,
            "queue_depth": depth,
            "queue_bytes": queued,
            "fetch_rate_bytes_per_s": round(self.fetch_rate),
            "prefill_rate_tokens_per_s": round(self.prefill_rate, 1),
            "budget_s": self.options.budget_s,
            **{
                k: round(v, 3) if isinstance(v, float) else v
                for k, v in self.stats.__dict__.items()
            },
        }

    def close(self, timeout: float) -> int:
        """Write behind what is queued within ``timeout``; how many were left."""
        end = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while (self._queue or self._busy) and time.monotonic() < end:
                self._cond.wait(max(0.0, end - time.monotonic()))
            left = len(self._queue) + int(self._busy)
            self._queue.clear()
            self._queued_bytes = 0
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._allocator.shutdown(wait=False, cancel_futures=True)
        # what was fetched is stored before the process ends (bounded by the fetches' size)
        self._release(taken_only=False)
        self._keeper.shutdown(wait=True)
        self.backend.close()
        return left


def _layout_for(
    info: SnapshotInfo, wanted: list, allocate, sizes: dict, deadline: float, record: str
) -> ChainLayout | None:
    """Where a record's blocks are received: one buffer per tensor for all its tokens when
    every block is fetched and its size is sealed in the record (``sizes``, by (tier kind,
    key): they bound the buffers a block's unauthenticated header may make), else None (each
    part its own buffer; the blocks held here fill their tokens' place). ``tier_layout``: the
    engine then reads it as one prefix; the buffers made by ``allocate``'s threads before the
    blocks are received (waited for until ``deadline``)."""
    if info.chain is None:
        return None
    spans = [(key, start, end) for key, start, end, _ in info.chain.spans(info.n_tokens)]
    fetched = {key for kind, key in wanted if kind == BLOCK_KIND}
    sealed = {s[0]: sizes[(BLOCK, s[0])] for s in spans if (BLOCK, s[0]) in sizes}
    if not {s[0] for s in spans} <= fetched or sealed.keys() != {s[0] for s in spans}:
        return None
    return ChainLayout(
        spans,
        info.n_tokens,
        allocate=allocate,
        sizes=sealed,
        deadline=deadline,
        record=record,
        pieces=ALLOC_THREADS,
        wait=True,
    )


def _place(layout: ChainLayout | None, key: str, header) -> tuple:
    """A fetched part's buffers: its tokens' runs in ``layout``'s buffers when it fits there,
    else one buffer of its own (``_mlx_buffer``); made on the fetching thread."""
    if layout is not None:
        placed = on_mlx_thread(layout.place, key, header)
        if placed is WAIT:  # waited for here: the mlx thread serves the other blocks' readers
            layout.wait_for_buffers()
            placed = on_mlx_thread(layout.place, key, header)  # never WAIT once waited for
        if isinstance(placed, tuple):
            return placed
    return _mlx_buffer(header)


def _mlx_buffer(header) -> tuple:
    """An mlx buffer for a part's data and its tensors viewing it, made on the fetching thread
    (one of FETCH_THREADS, long-lived: each keeps the mlx stream it made). Zeroed: a fetch runs
    beside the engine's steps, where an unfilled buffer's Python reader hangs the process."""
    return on_mlx_thread(unfilled_tensors, header, True)


def _lowest_priority() -> None:
    """The keeper's thread yields the cores to the engine: its writes overlapped the fetching
    request's first steps, which took twice as long beside them (Linux nices threads one by
    one; elsewhere this is a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _blend(old: float, new: float) -> float:
    return new if old == 0 else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * new


def _sizes(raw: object) -> dict:
    sizes = {}
    if isinstance(raw, list):
        for item in raw:
            if (
                isinstance(item, list)
                and len(item) == 3
                and isinstance(item[2], int)
                and item[2] >= 0
            ):
                sizes[(item[0], item[1])] = item[2]
    return sizes


@dataclass(eq=False)  # by identity: its parts hold mlx arrays
class FetchedRecord:
    """A record fetched from the tier, checked and re-keyed for the local store: its header
    (``info``, its path the store's), its file's bytes and its parts by (kind, key), each a
    ``ReceivedPart`` in mlx memory (what the cache loads and the keeper writes); ``buffers``:
    what its blocks' tensors view, when all were received into one buffer per tensor."""

    namespace: str
    info: SnapshotInfo
    record: bytes
    parts: dict
    buffers: RecordBuffers | None = None  # its blocks' tensors in one buffer each (tier_layout)
    taken: bool = False  # by a request (take_fresh)
    release: threading.Event = field(default_factory=threading.Event)  # the keeper may store it
    stored: threading.Event = field(default_factory=threading.Event)  # the keeper is done


@dataclass
class _Attempt:
    """One request's fetch: its deadline, the bytes read so far, and whether its outcome was
    counted (by the request giving up, or by the fetch ending: whichever comes first)."""

    deadline: float
    bytes_read: int = 0
    _settled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def settle(self) -> bool:
        """True for the first caller only: it counts the outcome."""
        with self._lock:
            first, self._settled = not self._settled, True
            return first


class _PastBudget(Exception):
    """A fetch found its deadline passed: the request prefills."""


class _Missed(Exception):
    """A part that could not be used: the counter it adds to, and why (logged) if bad."""

    def __init__(self, counter: str, what: str = "", why: str = "") -> None:
        super().__init__(counter)
        self.counter, self.what, self.why = counter, what, why


class _Staged:
    """Files fetched into a private folder of the store (``.tmp-tier-*``, under their own
    names, so they are checked as stored files are), moved into place together under the
    store lock by ``install`` (parts first, the record last); whatever was not installed is
    removed with the folder."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.folder = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=store.root))
        self.files: list[tuple[Path, Path]] = []  # (staged, target)

    def __enter__(self) -> _Staged:
        return self

    def file(self, target: Path) -> Path:
        staged = self.folder / str(len(self.files)) / target.name
        staged.parent.mkdir()
        self.files.append((staged, target))
        return staged

    def install(self) -> None:
        record, *parts = self.files  # the record was staged first: it goes in last
        for staged, _ in self.files:
            with open(staged, "rb+") as f:
                self.store.fsync(f.fileno())
        with self.store.lock():
            for staged, target in (*parts, record):
                make_dirs(target.parent, self.store.fsync)
                os.replace(staged, target)
            for folder in {target.parent for _, target in self.files}:
                fsync_dir(folder, self.store.fsync)
        self.files = []

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def sweep_staging(root: Path, older_than_s: float = 3600.0) -> None:
    """Remove staging folders a killed server left (an hour old: none is still in use)."""
    now = time.time()
    for folder in root.glob(STAGING_PREFIX + "*"):
        with contextlib.suppress(OSError):
            if folder.is_dir() and now - folder.stat().st_mtime > older_than_s:
                shutil.rmtree(folder)
