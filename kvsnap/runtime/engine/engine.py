"""The engine: model + prefix cache + continuous batching (mlx-lm's BatchGenerator) on one thread.

Every mlx call happens on the engine thread. Callers submit requests from any thread
and receive events through the callback they pass; the callback runs on the engine
thread and must only hand the event over (e.g. ``loop.call_soon_threadsafe``).

Per request: tokens -> longest cached strict prefix (a private copy) -> only the suffix
is inserted into the batch -> tokens stream back. The prompt minus its last token is
captured before any decode step and kept in an LRU for multi-turn reuse.

This module owns the thread, its command queue and the start-up; the parts
live beside it: ``scheduler`` (queue and slots), ``accounting`` (token counts),
``batch_runner`` and ``sequential`` (the two ways requests run), ``request_cache`` (a
request's lookup, accounting, privacy and capture), ``request_output`` and ``stop_strings``
(text out), ``warmup.rewarm`` (after ``DELETE /v1/cache/prefix``), ``startup``.

The parts are built in the order they need each other, each given its collaborators: loading
makes one ``LoadedEngine`` (the model, the prefix cache, the generators), there whole or not
at all (``ready()``); after the warm-up, the persister is started with the prefix cache, and
``ServingParts`` (each request's cache, given the persister; the batch runner, given that)
are built in one piece (``serving()``).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from kvsnap.blas import openblas_threads, preload_openblas

# before the first mlx import (here or on the engine thread): mlx keeps its slow reference BLAS
preload_openblas()

import mlx.core as mx

from kvsnap.errors import SnapshotError
from kvsnap.faults import FaultHook
from kvsnap.key import ModelIdentity
from kvsnap.runtime.cache.composed import BlockPool, copy_state, copy_state_head
from kvsnap.runtime.cache.prefix import Entry, PrefixCache
from kvsnap.runtime.engine.accounting import TokenAccounts, cache_stats
from kvsnap.runtime.engine.batch_runner import BatchRunner, Generators
from kvsnap.runtime.engine.request_cache import RequestCaches
from kvsnap.runtime.engine.request_output import finish_request
from kvsnap.runtime.engine.scheduler import Scheduler, uses_batching
from kvsnap.runtime.engine.sequential import SequentialRun
from kvsnap.runtime.engine.startup import (
    prefetch_snapshots,
    prefill_concurrency,
    prefill_many,
    run_then_park,
)
from kvsnap.runtime.engine.step_threads import StepThreads
from kvsnap.runtime.engine.types import (
    EngineConfig,
    EventFn,
    GenerationRequest,
    RequestState,
    check_request,
)
from kvsnap.runtime.model import loading
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.persist.persister import Persister, start_persister
from kvsnap.runtime.warmup.prefetch import Prefetched
from kvsnap.runtime.warmup.report import SnapshotCounts, WarmupReport
from kvsnap.runtime.warmup.rewarm import Rewarmer
from kvsnap.runtime.warmup.run import run_warmup
from kvsnap.runtime.warmup.store import open_store
from kvsnap.snapshot.codec import trim_cache
from kvsnap.store.local import Store

__all__ = ["Engine", "EngineConfig", "EventFn", "GenerationRequest", "LoadedEngine", "RequestState"]

log = logging.getLogger("kvsnap.runtime.engine.engine")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LoadedEngine:
    """What loading the model makes, built in one piece once it has all loaded."""

    lm: LoadedModel
    identity: ModelIdentity
    counts: SnapshotCounts
    prefix: PrefixCache
    generators: Generators  # the warm-up's batched prefill, then the batch runner's


@dataclass(frozen=True, slots=True)
class ServingParts:
    """What serves requests, built in one piece after the warm-up, once the persister is
    known: each request's cache (given the persister) and the batch runner (given those)."""

    caches: RequestCaches
    batch: BatchRunner
    threads: StepThreads  # OpenBLAS's count per step, batched or sequential


# how long the weights' read waits for ``read_weights_when`` at most
WEIGHTS_GATE_TIMEOUT_S = 30.0


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        early_prefetch: tuple[BlockPool, Future] | None = None,
        read_weights_when: threading.Event | None = None,
    ):
        """``early_prefetch``: ``startup.start_prefetch``'s pool and result, when the caller
        started the prefetch before making the engine. ``read_weights_when``: with
        ``weights_after_warm``, the weights are read once it is set (kvsnap serve: its API
        built), so on few cores the read does not slow the port's opening."""
        self.config = config
        self._loaded: LoadedEngine | None = None
        self._serving: ServingParts | None = None
        # opened by the warm-up when None (a caller may set one before ``start``)
        self.store: Store | None = None
        # blocks of v3 records, each held once however many warm entries share it
        self.pool = early_prefetch[0] if early_prefetch else BlockPool()
        self.prefetched: Future | None = early_prefetch[1] if early_prefetch else None
        self.warmup_report: WarmupReport | None = None
        self.warm = threading.Event()
        self.loaded = threading.Event()
        # set once the engine takes requests: after warm, the weights read (when
        # ``weights_after_warm``) and the kernels primed; ``failed`` says if that went wrong
        self.serving_started = threading.Event()
        self.stopped = threading.Event()  # set when the engine loop has ended
        self._stream_made = threading.Event()  # the engine thread's mlx stream exists
        self.read_weights_when = read_weights_when
        self.failed: BaseException | None = None
        self.sched = Scheduler(config.max_batch_size)
        self.accounts = TokenAccounts()
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stream: mx.Stream | None = None
        self.rewarmer = Rewarmer()  # re-warms after DELETE /v1/cache/prefix
        # snapshots read while the model loaded, until the warm-up takes them
        self._prefetched: Prefetched | None = None
        # with --persist-requests and a writable store
        self.persister: Persister | None = None
        self.persist_note = ""  # why persisting is off although asked for

    # --- what loading made -----------------------------------------------------

    def ready(self) -> LoadedEngine:
        """The loaded model and the parts built on it; a RuntimeError before it has loaded."""
        if self._loaded is None:
            raise RuntimeError("the engine has not loaded its model yet; call start() first")
        return self._loaded

    @property
    def lm(self) -> LoadedModel:
        return self.ready().lm

    @property
    def prefix(self) -> PrefixCache:
        return self.ready().prefix

    def serving(self) -> ServingParts:
        """The parts that serve requests; a RuntimeError before the warm-up has finished."""
        if self._serving is None:
            raise RuntimeError("the engine is not serving yet; wait_warm() first")
        return self._serving

    @property
    def _batch(self) -> BatchRunner:
        return self.serving().batch

    # --- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        """Load the model here, then warm up and serve on the engine thread (returns at once).

        Loading happens on the caller's thread: mlx-lm's tokenizer loader, run on another
        thread, leaves a native thread that aborts the process at exit. The engine thread
        itself never ends (see ``startup.run_then_park``).
        """
        # The engine thread starts first: it reads the snapshots to pin while the model loads here.
        self.start_serving()
        try:
            self._load()
        except BaseException as exc:
            self.failed = exc
            raise
        finally:
            self.loaded.set()

    def start_serving(self) -> None:
        """Start the engine thread: prefetch snapshots, wait for the model, warm up, serve."""
        self._thread = threading.Thread(
            target=run_then_park, args=([self._main],), name="kvsnap-engine", daemon=True
        )
        self._thread.start()

    def wait_warm(self, timeout: float | None = None) -> bool:
        ok = self.warm.wait(timeout)
        if self.failed:
            raise self.failed
        return ok

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine loop; requests still running end with finish_reason "cancelled"."""
        self._stopping = True
        self._commands.put(("stop",))
        if self.config.persist is not None:  # the queued conversation writes get their time
            timeout += self.config.persist.flush_timeout_s
        if self._thread is not None:
            self.stopped.wait(timeout)  # the thread itself stays parked, see run_then_park

    # --- public API (any thread) ---------------------------------------------

    def submit(self, request: GenerationRequest, on_event: EventFn) -> RequestState:
        state = RequestState(id=next(self._ids), request=request, on_event=on_event)
        if self._stopping or self.stopped.is_set():
            finish_request(state, "error", "the engine is shut down")
            return state
        self._commands.put(("submit", state))
        return state

    def asks_shared_tier(self) -> bool:
        """--shared-tier is on and its breaker lets a request ask it (no I/O)."""
        persister = self.persister
        return persister is not None and persister.tier is not None and persister.tier.asks()

    def fetch_shared(self, tokens: list[int], namespace: str) -> int:
        """With --shared-tier: make the namespace's longest prefix of ``tokens`` that the
        fleet's tier holds local before the request is submitted (a worker thread; waits at
        most the tier's budget); the tokens made local."""
        persister = self.persister
        if persister is None or persister.tier is None:
            return 0
        return persister.tier.fetch(tokens, namespace)

    def cancel(self, state: RequestState) -> None:
        self._commands.put(("cancel", state))

    def clear_prefix_cache(self, rewarm: bool = True, timeout: float = 60.0) -> int:
        """Drop the request prefixes, persisted ones too; returns once the engine thread has
        (the entries it held). Waiting makes the answer true when it is sent."""

        def clear() -> int:
            parts = self.ready()
            held = len(parts.prefix)
            self.rewarmer.clear(parts.prefix, parts.lm, rewarm=rewarm)
            if self.persister is not None:
                self.persister.pending.clear()
            return held

        return self.call(clear, timeout=timeout)

    def purge_persisted(self, timeout: float = 60.0) -> int | None:
        """Remove every persisted conversation from the store (any thread; waits for the
        writer); None when persisting is off or the writer did not finish in time."""
        persister = self.persister
        return persister.purge(timeout) if persister is not None else None

    def call(self, fn: Callable[[], T], timeout: float = 300.0) -> T:
        """Run ``fn`` on the engine thread (for tests and admin) and return its result."""
        if self.stopped.is_set():
            raise RuntimeError("the engine is shut down")
        box: dict[str, Any] = {}
        done = threading.Event()
        self._commands.put(("call", fn, box, done))
        if not done.wait(timeout):
            raise TimeoutError("engine call timed out")
        if "error" in box:
            raise box["error"]
        return box["value"]

    @property
    def batch_size(self) -> int:
        return len(self.sched.active)

    def status(self, tenant: str | None = None) -> dict:
        """Engine state; with ``tenant``, only that tenant's requests are listed."""
        parts = self._loaded
        batch = self._serving.batch if self._serving is not None else None
        return {
            "warm": self.warm.is_set(),
            "model": str(self.config.model),
            "batch_size": self.batch_size,
            "max_batch_size_seen": self.sched.max_batch_seen,
            "waiting": len(self.sched.pending),
            "requests": self.sched.rows(tenant),
            "cache": cache_stats(parts.prefix if parts else None, self.config.cache_memory_mb),
            "snapshots": parts.counts.as_dict() if parts else {},
            "tokens": self.accounts.as_dict(batch.gen if batch is not None else None),
            "requests_started": self.accounts.started_requests,
            "shared_prefills": batch.shared_prefills if batch is not None else 0,
            "shared_prefix_rows": batch.shared_prefix_rows if batch is not None else 0,
            **self.rewarmer.as_dict(),
            "persist": (
                self.persister.as_dict()
                if self.persister is not None
                else {"enabled": False, "note": self.persist_note}
            ),
            "warmup": self.warmup_report.__dict__ if self.warmup_report else None,
        }

    # --- engine thread ---------------------------------------------------------

    def _main(self) -> None:
        try:
            self._mx_stream()  # made on this thread: lazily loaded weights are bound to it
            self._stream_made.set()
            self._prefetch()
            self.loaded.wait()
            if self.failed is None:
                self._serve()
            else:
                self.warm.set()
        finally:
            if self._serving is not None:  # OpenBLAS's count is the process's, not this engine's
                self._serving.threads.restore()
            self.serving_started.set()
            self.stopped.set()

    def _prefetch(self) -> None:
        if self.prefetched is not None:  # started before the engine was made (kvsnap serve)
            self._prefetched = self.prefetched.result()
            return
        self._prefetched = prefetch_snapshots(self.config, self._mx_stream, self.pool)

    def _serve(self) -> None:
        try:
            self._warm_up()
            self._start_persisting()
            self._serving = self._assemble_serving()
            self.warm.set()
        except BaseException as exc:  # reported to the server, which exits non-zero
            self.failed = exc
            log.error("[kvsnap] engine failed to warm up: %s", exc)
            self.warm.set()
            return
        if not self._read_weights():  # after warm, before the loop takes its first command
            return
        self._prime_kernels()
        self.serving_started.set()
        batch = self.serving().batch
        while not self._stopping:
            busy = self.sched.busy or self.rewarmer.running
            try:
                self._drain(block=not busy)
                if self._stopping:
                    break
                self._step()
            except Exception as exc:  # a failed step fails its requests, never the server
                log.exception("[kvsnap] generation step failed")
                self._finish_all("error", f"{type(exc).__name__}: {exc}")
                batch.drop()
        self._finish_all("cancelled")
        batch.drop()
        self._refuse_queued()
        if self.persister is not None:  # SIGTERM: the queued writes, within a bound
            self.persister.close()

    def _read_weights(self) -> bool:
        """With ``weights_after_warm``: read the model's weights now, on this thread (their
        arrays are bound to its stream). A failure ends the engine, as a failed warm-up does:
        the requests already queued get its error and the server exits."""
        if not self.config.weights_after_warm:
            return True
        if self.read_weights_when is not None:  # bounded: a server that never opens still reads
            self.read_weights_when.wait(WEIGHTS_GATE_TIMEOUT_S)
        try:
            with mx.stream(self._mx_stream()):
                mx.eval(self.ready().lm.model.parameters())
            return True
        except Exception as exc:  # a weight file unreadable after the start: nothing can run
            self.failed = exc
            log.error("[kvsnap] reading the model's weights failed: %s", exc)
            self._stopping = True
            self._refuse_queued(f"{type(exc).__name__}: {exc}")
            if self.persister is not None:  # started with the warm-up: its queue is flushed
                self.persister.close()
            return False

    def _prime_kernels(self) -> None:
        """Run the model once when the warm-up did not (snapshots only, or nothing to warm):
        mlx compiles its kernels on a model's first pass (1-3 s on a hybrid), which the first
        request would otherwise pay.

        After warm, before the loop takes its first command: /health turns 200 without waiting
        for it (a plain mlx_lm.server primes nothing), and a request sent at once waits only for
        what is left of these two small passes, never for a compile of its own. A failure is
        logged, not fatal: each request then reports its own error.
        """
        report = self.warmup_report
        if report is not None and report.prefilled:
            return
        try:
            self.serving().batch.prime_kernels()
        except Exception:  # the requests that follow fail with their own error, if any
            log.exception("[kvsnap] kernel priming failed; the first request compiles instead")

    def _refuse_queued(self, error: str | None = None) -> None:
        """Commands that raced with the stop: requests end cancelled (with ``error``: failed
        with it), calls get an error."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit" and cmd[1].finish_reason is None:
                self.sched.submit(cmd[1])
                self._finish_all("cancelled" if error is None else "error", error)
            elif cmd[0] == "call":
                cmd[2]["error"] = RuntimeError("the engine is shut down")
                cmd[3].set()

    def _finish_all(self, reason: str, error: str | None = None) -> None:
        for state in self.sched.take_all():
            if state.finish_reason is not None and reason != "error":
                continue
            try:
                finish_request(state, reason, error)
            except Exception:  # a broken callback must not keep the others waiting
                log.exception("[kvsnap] request %d: event callback failed", state.id)

    def _load(self) -> None:
        cfg = self.config
        # looked up on its module when called, so a test can stand in for it
        if cfg.weights_after_warm:
            # mapped now, read by the engine thread after warm: a lazily loaded array can only
            # be evaluated on the thread whose stream it was created under
            self._stream_made.wait()
            with mx.stream(self._mx_stream()):
                lm = loading.load_model(cfg.model, cfg.settings, lazy=True)
        else:
            lm = loading.load_model(cfg.model, cfg.settings)
        identity = lm.identity(cfg.digest_cache)
        prefix = PrefixCache(
            max_bytes=int(cfg.cache_memory_mb * 2**20),
            copy_state=copy_state,
            copy_with_room=copy_state,
            copy_head=copy_state_head,
            trim_state=trim_cache,
            load_errors=(SnapshotError, OSError),
            on_load_error=self._on_load_error,
        )
        eos = getattr(lm.tokenizer, "eos_token_ids", None) or {lm.tokenizer.eos_token_id}
        stop_tokens = [[int(t)] for t in eos if t is not None]
        generators = Generators(lm, stop_tokens, self._mx_stream)
        self._loaded = LoadedEngine(lm, identity, SnapshotCounts(), prefix, generators)

    def _on_load_error(self, entry: Entry, exc: BaseException) -> None:
        """A snapshot indexed at start failed to load on first hit: report it, serve without it."""
        path = getattr(exc, "path", "") or entry.name or entry.key
        if entry.source == "persisted" and self.persister is not None:
            self.persister.load_error(str(path), exc)  # users' data, not a snapshot of the build
            return
        if self.persister is not None:  # a bad block of an agent's: conversations rewrite it too
            self.persister.part_failed(exc)
        self.ready().counts.reject(str(path), getattr(exc, "reason", None) or str(exc))

    def _warm_up(self, allow_prefill: bool = True) -> None:
        cfg = self.config
        parts = self.ready()
        if self.store is None and cfg.snapshots:
            self.store = open_store(
                cfg.snapshots, cfg.write_back, parts.counts, fault=FaultHook.from_env()
            )
        report = run_warmup(
            parts.lm,
            parts.prefix,
            parts.identity,
            parts.counts,
            self.store,
            cfg.warm_prompts,
            cfg.warm_prompts_file,
            budget_bytes=int(cfg.cache_memory_mb * 2**20),
            allow_prefill=allow_prefill,
            prefill_many=lambda token_lists: prefill_many(
                parts.lm, parts.generators.new, token_lists
            ),
            concurrency=prefill_concurrency(cfg, parts.lm.settings.kv_bits),
            prefetched=self._prefetched,
            pool=self.pool,
        )
        if self._prefetched is not None:
            report.prefetch_seconds = round(self._prefetched.seconds, 3)
        self._prefetched = None  # what the warm-up did not take (foreign, over budget) is dropped
        self.warmup_report = report
        log.info(report.summary(parts.counts))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "submit":
            self.sched.submit(cmd[1])
        elif kind == "cancel":
            self._cancel(cmd[1])
        elif kind == "call":
            _, fn, box, done = cmd
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            done.set()
        elif kind == "stop":
            self._stopping = True

    # --- scheduling ------------------------------------------------------------

    def _poll(self) -> bool:
        """Serve the commands waiting now (a cancel, a disconnect); True once stopping."""
        self._drain(block=False)
        return self._stopping

    def _step(self) -> None:
        parts = self.ready()
        if uses_batching(self.config.continuous_batching, parts.lm.settings.kv_bits):
            batch = self.serving().batch
            batch.admit()
            if self.sched.active:
                batch.step()
        else:
            state = self.sched.next_sequential()
            if state is not None:
                self._run_sequential(state)
        if self.persister is not None:  # after the step that evaluated the captured copies
            self.persister.pump()
        if self.rewarmer.running:
            if self._serving is not None:  # its prefill chunk on every BLAS thread
                self._serving.threads.restore()
            # one snapshot read or prefill chunk, between decode steps
            self.rewarmer.step(parts.prefix, parts.counts)

    def _start_persisting(self) -> None:
        """With --persist-requests: the persister on the warm-up's store, given the prefix
        cache (a conversation is also cut where a warm entry ends, sharing its blocks)."""
        if self.config.persist is None:
            return
        parts = self.ready()
        self.persister, self.persist_note = start_persister(
            self.config.persist, self.store, parts.lm, parts.identity, self.pool, parts.prefix
        )

    def _assemble_serving(self) -> ServingParts:
        """Each request's cache, given the persister (None: persisting is off), and the batch
        runner, given those: built once the warm-up has run and the persister is known."""
        parts = self.ready()
        caches = RequestCaches(parts.lm, parts.prefix, self.accounts, self.persister)
        threads = StepThreads(openblas_threads(), self.config.decode_blas_threads)
        batch = BatchRunner(
            parts.generators,
            caches,
            self.sched,
            self.accounts,
            self.config.prefill_batch_size,
            threads,
        )
        return ServingParts(caches, batch, threads)

    def _cancel(self, state: RequestState) -> None:
        uid = self.sched.withdraw(state)
        if uid is not None and self._serving is not None:
            self._serving.batch.remove(uid)
        if state.finish_reason is None:
            finish_request(state, "cancelled")

    def _run_sequential(self, state: RequestState) -> None:
        """One request alone (quantized KV, or --continuous-batching off); it fails alone."""
        parts, serving = self.ready(), self.serving()
        caches = serving.caches
        self.sched.activate(-state.id, state)

        def capture(cache: list) -> None:
            caches.capture(state, cache)

        def keep_reply(cache: list, held: list[int]) -> None:
            caches.capture_reply(state, cache, held, views=False)

        try:
            check_request(state.request)
            prepared = caches.prepare(state)
            eos = {t[0] for t in parts.generators.stop_tokens}
            run = SequentialRun(
                parts.lm,
                state,
                prepared.cache,
                self.accounts,
                eos,
                self._poll,
                capture,
                keep_reply,
                serving.threads,
            )
            run.run(prepared.suffix)
        except Exception as exc:  # this request fails; the engine goes on
            log.exception("[kvsnap] request %d failed", state.id)
            if state.finish_reason is None:
                finish_request(state, "error", f"{type(exc).__name__}: {exc}")
        finally:
            self.sched.release(-state.id)

    def _mx_stream(self) -> mx.Stream:
        """The engine's own mlx stream: mlx-lm's default thread-local one aborts the
        process at exit when it was used from a non-main thread."""
        if self._stream is None:
            self._stream = mx.new_stream(mx.default_device())
        return self._stream
