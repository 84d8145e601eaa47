"""The engine: model + prefix cache + continuous batching (mlx-lm's BatchGenerator) on one thread.

Every mlx call happens on the engine thread. Callers submit requests from any thread
and receive events through the callback they pass; the callback runs on the engine
thread and must only hand the event over (e.g. ``loop.call_soon_threadsafe``).

Per request: tokens -> longest cached strict prefix (a private copy) -> only the suffix
is inserted into the batch -> tokens stream back. The prompt minus its last token is
captured before any decode step and kept in an LRU for multi-turn reuse.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable

from kvsnap.runtime.engine_types import EngineConfig, EventFn, GenerationRequest, RequestState, check_request

__all__ = ["Engine", "EngineConfig", "EventFn", "GenerationRequest", "RequestState"]

log = logging.getLogger("kvsnap.runtime.engine")

MIN_SHARED_TOKENS_TO_COMPUTE = 32  # a shared prefix mostly cached already is not computed again

class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.lm = None
        self.identity = None
        self.prefix = None
        self.counts = None
        self.store = None
        self.warmup_report = None
        self.warm = threading.Event()
        self.loaded = threading.Event()
        self.stopped = threading.Event()  # set when the engine loop has ended
        self.failed: BaseException | None = None
        self._commands: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        self._active: dict[int, RequestState] = {}  # uid -> state
        self._pending: list[RequestState] = []  # waiting for a sequential slot
        self._deferred_evals: list = []  # captured prefix copies, evaluated after the next decode step
        self._gen = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._max_batch_seen = 0
        self._started_requests = 0
        self._tokens_prompt = 0
        self._tokens_cached = 0
        self._computed_measured = 0  # sequential prefill + each request's last token
        self._gen_counter_base = 0
        self._gen_counted = 0  # prompt tokens counted by generators already dropped
        self._batched_expected = 0  # what a batched prefill should count: the fallback source
        self._counter_missing = False
        self._stream = None
        self.rewarms = 0
        self.rewarms_coalesced = 0
        self.rewarm_error = ""
        self._rewarm = None  # a RewarmJob while a re-warm runs
        self._shared_prefills = 0  # shared prefixes of requests admitted together, computed once
        self._discard_after_admit: list = []
        self._prefetched = None  # prefetch.Prefetched: snapshots read while the model loaded

    # --- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        """Load the model here, then warm up and serve on the engine thread (returns at once).

        Loading happens on the caller's thread: mlx-lm's tokenizer loader, run on another
        thread, leaves a native thread that aborts the process at exit. The engine thread
        itself never ends (see ``_engine_thread``).
        """
        from kvsnap.blas import preload_openblas

        preload_openblas()  # before either thread imports mlx: the prefetch would otherwise get reference BLAS
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
        self._thread = threading.Thread(target=_engine_thread, args=([self._main],), name="kvsnap-engine", daemon=True)
        self._thread.parks = True
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
        if self._thread is None:
            return
        if getattr(self._thread, "parks", False):
            self.stopped.wait(timeout)  # the thread itself stays parked, see _engine_thread
        else:
            self._thread.join(timeout)

    # --- public API (any thread) ---------------------------------------------

    def submit(self, request: GenerationRequest, on_event: EventFn) -> RequestState:
        state = RequestState(id=next(self._ids), request=request, on_event=on_event)
        if self._stopping or self.stopped.is_set():
            self._finish(state, "error", "the engine is shut down")
            return state
        self._commands.put(("submit", state))
        return state

    def cancel(self, state: RequestState) -> None:
        self._commands.put(("cancel", state))

    def clear_prefix_cache(self, rewarm: bool = True) -> None:
        self._commands.put(("clear", rewarm))

    def call(self, fn: Callable[[], Any], timeout: float = 300.0) -> Any:
        """Run ``fn`` on the engine thread (for tests and admin) and return its result."""
        if self.stopped.is_set():
            raise RuntimeError("the engine is shut down")
        box: dict = {}
        done = threading.Event()
        self._commands.put(("call", fn, box, done))
        if not done.wait(timeout):
            raise TimeoutError("engine call timed out")
        if "error" in box:
            raise box["error"]
        return box["value"]

    @property
    def batch_size(self) -> int:
        return len(self._active)

    def status(self, tenant: str | None = None) -> dict:
        """Engine state; with ``tenant``, only that tenant's requests are listed."""
        p = self.prefix  # an empty PrefixCache is falsy (it has __len__): test for None
        st = p.stats if p is not None else None
        lookups = (st.hits + st.misses) if st is not None else 0
        cache = {
            "entry_count": len(p) if p is not None else 0,
            "hits": st.hits if st is not None else 0,
            "misses": st.misses if st is not None else 0,
            "hit_rate": round(st.hits / lookups, 4) if lookups else 0.0,
            "tokens_saved": st.tokens_saved if st is not None else 0,
            "current_memory_mb": round(p.current_bytes / 2**20, 3) if p is not None else 0.0,
            "max_memory_mb": self.config.cache_memory_mb,
            "evictions": st.evictions if st is not None else 0,
            "lazy_loads": st.loads if st is not None else 0,
            "unloads": st.unloads if st is not None else 0,
            "load_errors": st.load_errors if st is not None else 0,
        }
        return {
            "warm": self.warm.is_set(),
            "model": str(self.config.model),
            "batch_size": self.batch_size,
            "max_batch_size_seen": self._max_batch_seen,
            "waiting": len(self._pending),
            "requests": [
                {"id": s.id, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens, "computed_tokens": s.computed_tokens, "completion_tokens": s.completion_tokens}
                for s in list(self._active.values()) + list(self._pending)
                if tenant is None or s.request.tenant == tenant
            ],
            "cache": cache,
            "snapshots": self.counts.as_dict() if self.counts else {},
            "tokens": {
                "prompt": self._tokens_prompt,
                "cached": self._tokens_cached,
                "computed": self._computed_tokens(),
                "computed_source": self._computed_source(),
            },
            "requests_started": self._started_requests,
            "shared_prefills": self._shared_prefills,
            "rewarms": self.rewarms,
            "rewarms_coalesced": self.rewarms_coalesced,
            "rewarm_in_progress": self._rewarm is not None,
            "rewarm_error": self.rewarm_error,
            "warmup": self.warmup_report.__dict__ if self.warmup_report else None,
        }

    # --- engine thread ---------------------------------------------------------

    def _main(self) -> None:
        try:
            self._prefetch()
            self.loaded.wait()
            if self.failed is None:
                self._serve()
            else:
                self.warm.set()
        finally:
            self.stopped.set()

    def _prefetch(self) -> None:
        """Read and checksum the snapshots to pin, on this thread's own stream, while the model loads."""
        cfg = self.config
        if not cfg.snapshots or "://" in cfg.snapshots:
            return
        import mlx.core as mx  # OpenBLAS is already loaded: ``start`` (or ``load_model``) preloaded it

        from kvsnap.runtime.model_source import resolve_model
        from kvsnap.runtime.prefetch import prefetch

        try:
            model_dir = resolve_model(cfg.model).path
            names = [p.name for p in cfg.warm_prompts.entries] if cfg.warm_prompts else []
            with mx.stream(self._mx_stream()):
                self._prefetched = prefetch(cfg.snapshots, model_dir, cfg.settings, int(cfg.cache_memory_mb * 2**20), names)
        except Exception as exc:  # an optimisation only: the warm-up reads the files itself
            log.warning("[kvsnap] snapshot prefetch skipped: %s", exc)
            self._prefetched = None

    def _serve(self) -> None:
        try:
            self._warm_up()
            self.warm.set()
        except BaseException as exc:  # reported to the server, which exits non-zero
            self.failed = exc
            log.error("[kvsnap] engine failed to warm up: %s", exc)
            self.warm.set()
            return
        report = self.warmup_report
        if report is not None and report.from_snapshots and not report.prefilled:
            self._prime_kernels()  # after "warm": it costs start-up nothing, and a first request rarely comes this fast
        while not self._stopping:
            busy = bool(self._active) or bool(self._pending) or self._rewarm is not None
            try:
                self._drain(block=not busy)
                if self._stopping:
                    break
                self._step()
            except Exception as exc:  # a failed step fails its requests, never the server
                log.exception("[kvsnap] generation step failed")
                self._finish_all("error", str(exc))
                self._drop_gen()
        self._finish_all("cancelled")
        self._drop_gen()
        self._refuse_queued()

    def _refuse_queued(self) -> None:
        """Commands that raced with the stop: requests end cancelled, calls get an error."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit" and cmd[1].finish_reason is None:
                self._pending.append(cmd[1])
                self._finish_all("cancelled")
            elif cmd[0] == "call":
                cmd[2]["error"] = RuntimeError("the engine is shut down")
                cmd[3].set()

    def _finish_all(self, reason: str, error: str | None = None) -> None:
        states = list(self._active.values()) + self._pending
        self._active.clear()
        self._pending.clear()
        for state in states:
            if state.finish_reason is not None and reason != "error":
                continue
            try:
                self._finish(state, reason, error)
            except Exception:  # a broken callback must not keep the others waiting
                log.exception("[kvsnap] request %d: event callback failed", state.id)

    def _load(self) -> None:
        from kvsnap.runtime.modeling import load_model
        from kvsnap.runtime.prefix import PrefixCache
        from kvsnap.snapshot.codec import copy_cache, trim_cache
        from kvsnap.runtime.warmup import SnapshotCounts

        from kvsnap.errors import SnapshotError

        cfg = self.config
        self.lm = load_model(cfg.model, cfg.settings)
        self.identity = self.lm.identity(cfg.digest_cache)
        self.counts = SnapshotCounts()
        self.prefix = PrefixCache(
            max_bytes=int(cfg.cache_memory_mb * 2**20),
            copy_state=copy_cache,
            trim_state=trim_cache,
            load_errors=(SnapshotError, OSError),
            on_load_error=self._on_load_error,
        )
        eos = getattr(self.lm.tokenizer, "eos_token_ids", None) or {self.lm.tokenizer.eos_token_id}
        self._stop_tokens = [[int(t)] for t in eos if t is not None]

    def _on_load_error(self, entry, exc: BaseException) -> None:
        """A snapshot indexed at start failed to load on first hit: report it, serve without it."""
        path = getattr(exc, "path", "") or entry.name or entry.key
        self.counts.reject(str(path), getattr(exc, "reason", None) or str(exc))

    def _warm_up(self, allow_prefill: bool = True) -> None:
        from kvsnap.runtime.warmup import open_store, run_warmup

        cfg = self.config
        if self.store is None and cfg.snapshots:
            from kvsnap.faults import FaultHook

            self.store = open_store(cfg.snapshots, cfg.write_back, self.counts, fault=FaultHook.from_env())
        report = run_warmup(
            self.lm,
            self.prefix,
            self.identity,
            self.counts,
            self.store,
            cfg.warm_prompts,
            cfg.warm_prompts_file,
            budget_bytes=int(cfg.cache_memory_mb * 2**20),
            allow_prefill=allow_prefill,
            prefill_many=self._prefill_many,
            concurrency=self._prefill_concurrency(),
            prefetched=self._prefetched,
        )
        if self._prefetched is not None:
            report.prefetch_seconds = round(self._prefetched.seconds, 3)
        self._prefetched = None  # what the warm-up did not take (foreign, over budget) is dropped
        self.warmup_report = report
        log.info(report.summary(self.counts))

    def _prime_kernels(self) -> None:
        """A throwaway 3-token request, run right after reporting warm. mlx's CPU backend
        compiles ``mx.compile``'d kernels (mlx-lm's swiglu, ...) on first use; a server restored
        from snapshots has run no model pass yet and would pay 1-3 s of that in its first TTFT
        (a warm-prompts server pays it in its start-up prefill). Own generator: the engine's
        token counters stay exact."""
        from kvsnap.runtime.sampling import make_request_sampler

        tokens = list(self.lm.tokenizer.encode("hello world"))[:3] or [0]
        gen = self._new_generator(1, 1)
        gen.insert([tokens], max_tokens=[1], caches=[self.lm.make_cache()], samplers=[make_request_sampler(0.0, 1.0, None)])
        for _ in range(8):  # one prefill step and one decode step finish it; bounded regardless
            if any(r.finish_reason for r in gen.next()[1]):
                break

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

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "submit":
            self._pending.append(cmd[1])
        elif kind == "cancel":
            self._cancel(cmd[1])
        elif kind == "clear":
            self._clear(cmd[1])
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

    def _batching(self) -> bool:
        # mlx-lm's batch caches cannot hold a quantized KV: run those one at a time.
        return self.config.continuous_batching and self.lm.settings.kv_bits is None

    def _step(self) -> None:
        if self._batching():
            self._admit_batched()
            if self._active:
                self._step_batched()
        else:
            if not self._active and self._pending:
                self._run_sequential(self._pending.pop(0))
        if self._rewarm is not None:
            self._rewarm_step()

    # --- re-warm after DELETE /v1/cache/prefix ---------------------------------------

    def _clear(self, rewarm: bool) -> None:
        """Drop request prefixes; re-warm in steps between serving. At most one re-warm runs:
        a clear during one only drops request prefixes again (coalesced, never queued)."""
        from kvsnap.runtime.rewarm import start_rewarm

        if self._rewarm is not None:
            self.rewarms_coalesced += 1
            self.prefix.drop_request_prefixes()
            return
        if not rewarm:
            self.prefix.clear()
            return
        self.rewarms += 1
        self.rewarm_error = ""
        self._rewarm = start_rewarm(self.prefix, self.lm)
        if self._rewarm.finished:
            self._rewarm = None

    def _rewarm_step(self) -> None:
        from kvsnap.runtime.rewarm import rewarm_step

        try:
            rewarm_step(self._rewarm, self.prefix, self.counts)
        except Exception as exc:  # serve on (cold for what is left) rather than die; status says why
            self.rewarm_error = f"{type(exc).__name__}: {exc}"
            log.exception("[kvsnap] re-warm failed")
            self._rewarm = None
            return
        if self._rewarm.finished:
            self._rewarm = None

    def _prepare(self, state: RequestState):
        """Fetch the longest cached prefix (a private copy) and account for it."""
        tokens = state.request.tokens
        cache, n_cached, match = self.prefix.fetch(tokens, state.request.namespace)
        if cache is None:
            cache = self.lm.make_cache()
        state.cached_tokens = n_cached
        state.cache_source = match.entry.source if match else ""
        # A partial match on an entry shared with others tells how far the prompts agree.
        state.cache_shared_partial = bool(match) and n_cached < len(match.entry.tokens) and (match.entry.namespace is None or match.entry.namespace == "")
        state.computed_tokens = len(tokens) - n_cached
        state.detok = self.lm.tokenizer.detokenizer
        state.detok.reset()
        self._started_requests += 1
        self._tokens_prompt += len(tokens)
        self._tokens_cached += n_cached
        return cache, tokens[n_cached:]

    def _mx_stream(self):
        """The engine's own mlx stream: mlx-lm's default thread-local one aborts the
        process at exit when it was used from a non-main thread."""
        if self._stream is None:
            import mlx.core as mx

            self._stream = mx.new_stream(mx.default_device())
        return self._stream

    def _new_generator(self, batch_size: int, prefill_batch_size: int):
        from mlx_lm.generate import BatchGenerator

        return BatchGenerator(
            self.lm.model,
            stop_tokens=self._stop_tokens,
            completion_batch_size=batch_size,
            prefill_batch_size=min(prefill_batch_size, batch_size),
            prefill_step_size=self.lm.settings.prefill_step_size,
            max_kv_size=self.lm.settings.max_kv_size,
            stream=self._mx_stream(),
        )

    def _ensure_gen(self):
        if self._gen is None:
            self._gen = self._new_generator(self.config.max_batch_size, self.config.prefill_batch_size)
            base = _prompt_counter(self._gen)
            self._counter_missing = base is None
            self._gen_counter_base = base or 0
        return self._gen

    def _drop_gen(self) -> None:
        """Forget the generator, keeping the prompt tokens it counted."""
        if self._gen is not None:
            counted = _prompt_counter(self._gen)
            if counted is not None:
                self._gen_counted += counted - self._gen_counter_base
            self._gen = None

    def _computed_source(self) -> str:
        if self._counter_missing:
            return "engine count (this mlx-lm's BatchGenerator has no prompt token counter)"
        return "measured: mlx-lm BatchGenerator prompt counter + sequential prefill + 1 per started decode"

    def _computed_tokens(self) -> int:
        """Prompt tokens the model really ran: mlx-lm's own prefill counter, the sequential
        path's chunks, and each request's last prompt token (counted when its first decode
        step has run)."""
        if self._counter_missing:
            return self._computed_measured + self._batched_expected
        gen = self._gen
        batched = self._gen_counted
        if gen is not None:
            batched += (_prompt_counter(gen) or 0) - self._gen_counter_base
        return self._computed_measured + batched

    def _admit_batched(self) -> None:
        from kvsnap.runtime.sampling import make_request_sampler

        if not self._pending:
            return
        gen = self._ensure_gen()
        room = self.config.max_batch_size - len(self._active)
        self._prefill_shared_prefixes(self._pending[:room])
        while self._pending and room > 0:
            state = self._pending.pop(0)
            r = state.request
            try:
                check_request(r)
                cache, suffix = self._prepare(state)
                uid = gen.insert([list(suffix)], max_tokens=[r.max_tokens], caches=[cache], samplers=[make_request_sampler(r.temperature, r.top_p, r.seed)])[0]
            except Exception as exc:  # this request fails; the batch goes on
                log.warning("[kvsnap] request %d failed to start: %s", state.id, exc)
                self._finish(state, "error", f"{type(exc).__name__}: {exc}")
                continue
            state.uid = uid
            state.capture = len(suffix) > 1
            self._batched_expected += len(suffix) - 1  # mlx-lm runs the last token in the first decode step
            self._active[uid] = state
            room -= 1
        while self._discard_after_admit:
            self.prefix.discard(self._discard_after_admit.pop())
        self._max_batch_seen = max(self._max_batch_seen, len(self._active))

    def _prefill_shared_prefixes(self, batch: list[RequestState]) -> None:
        """Requests admitted together that share an uncached prefix: compute it once, as a
        prefix entry of their namespace that each of them then hits."""
        from kvsnap.runtime.prefix import Entry
        from kvsnap.runtime.prefill import PrefillCursor
        from kvsnap.runtime.shared_prefix import shared_groups
        from kvsnap.snapshot.codec import CaptureError, cache_nbytes_of, check_captured_at, is_trimmable

        if len(batch) < 2:
            return
        for group in shared_groups([s.request.tokens for s in batch], [s.request.namespace for s in batch]):
            first = batch[group.members[0]].request
            shared = tuple(first.tokens[: group.length])
            match = self.prefix.lookup(first.tokens[: group.length + 1], first.namespace)
            start = match.n_cached if match else 0
            if group.length - start < MIN_SHARED_TOKENS_TO_COMPUTE:
                continue  # the cache already holds (nearly) all of it
            try:
                cache, start, _ = self.prefix.fetch(first.tokens[: group.length + 1], first.namespace)
                cursor = PrefillCursor(self.lm, shared, done_tokens=start, cache=cache or self.lm.make_cache())
                while cursor.step():
                    pass
                check_captured_at(cursor.cache, group.length)
            except (CaptureError, ValueError, RuntimeError) as exc:  # the members then prefill on their own
                log.warning("[kvsnap] shared prefix of %d requests not computed: %s", len(group.members), exc)
                continue
            self._computed_measured += group.length - start
            self._shared_prefills += 1
            entry = Entry(tokens=shared, state=cursor.cache, nbytes=cache_nbytes_of(cursor.cache), trimmable=is_trimmable(cursor.cache), pinned=False, source="shared", namespace=first.namespace)
            self.prefix.add(entry)
            if not first.capture:
                self._discard_after_admit.append(entry)  # serves this batch only: request prefixes are off

    def _flush_deferred(self) -> None:
        if self._deferred_evals:
            import mlx.core as mx

            pending, self._deferred_evals = self._deferred_evals, []
            mx.eval(pending)

    def _step_batched(self) -> None:
        gen = self._gen
        prompt_responses, generation_responses = gen.next()
        self._max_batch_seen = max(self._max_batch_seen, len(self._active))
        for r in prompt_responses:
            state = self._active.get(r.uid)
            if state is not None and state.capture and r.end_of_segment and not r.end_of_prompt:
                self._capture(state, gen.extract_cache([r.uid])[r.uid][0], defer=True)
        for r in generation_responses:
            state = self._active.get(r.uid)
            if state is None:
                continue
            if not state.last_token_counted:
                state.last_token_counted = True
                self._computed_measured += 1  # the decode step that produced this token ran the last prompt token
            self._on_token(state, r.token, r.finish_reason)
            if state.finish_reason is not None:
                self._active.pop(r.uid, None)
                if r.finish_reason is None:  # stopped by a stop string: free the slot now
                    gen.remove([r.uid])
        if generation_responses:
            self._flush_deferred()

    def _capture(self, state: RequestState, cache: list, defer: bool = False) -> None:
        """Keep the prompt minus its last token for multi-turn reuse; captured before any decode."""
        from kvsnap.runtime.prefix import Entry
        from kvsnap.snapshot.codec import CaptureError, cache_arrays, cache_nbytes_of, check_captured_at, copy_cache, is_trimmable

        import mlx.core as mx

        state.capture = False
        if not state.request.capture:
            return
        tokens = tuple(state.request.tokens[:-1])
        try:
            check_captured_at(cache, len(tokens))
        except CaptureError as exc:
            log.debug("[kvsnap] not capturing request %d: %s", state.id, exc)
            return
        own = copy_cache(cache)
        arrays = [a for c in own for a in cache_arrays(c)]
        if defer:
            # Evaluated right after the next decode step, so the copy is not on the
            # critical path of this request's first token.
            self._deferred_evals.extend(arrays)
        else:
            mx.eval(arrays)
        self.prefix.add(Entry(tokens=tokens, state=own, nbytes=cache_nbytes_of(own), trimmable=is_trimmable(own), pinned=False, source="request", namespace=state.request.namespace))

    def _on_token(self, state: RequestState, token: int, finish_reason: str | None) -> None:
        if state.t_first_token is None:
            state.t_first_token = time.perf_counter()
        state.completion_tokens += 1
        if finish_reason == "stop":
            state.detok.finalize()
            self._emit_text(state, state.detok.last_segment, final=True)
            self._finish(state, "stop")
            return
        state.detok.add_token(token)
        self._emit_text(state, state.detok.last_segment, final=False)
        if state.finish_reason is None and finish_reason is not None:
            state.detok.finalize()
            self._emit_text(state, state.detok.last_segment, final=True)
            self._finish(state, finish_reason)

    def _emit_text(self, state: RequestState, segment: str, final: bool) -> None:
        """Send text, holding back a tail that could still become a stop string."""
        if state.finish_reason is not None:
            return
        text = state.held_text + segment
        stops = state.request.stop
        if stops:
            hits = [(text.find(s), s) for s in stops if s and s in text]
            if hits:
                at = min(h[0] for h in hits)
                self._send(state, text[:at])
                state.held_text = ""
                self._finish(state, "stop")
                return
            keep = 0 if final else max((len(s) - 1 for s in stops if s), default=0)
            keep = min(keep, len(text))
            out, state.held_text = (text[: len(text) - keep], text[len(text) - keep :]) if keep else (text, "")
        else:
            out, state.held_text = text, ""
        self._send(state, out)

    def _send(self, state: RequestState, text: str) -> None:
        if text:
            state.text += text
            state.on_event(state, "token", text)

    def _finish(self, state: RequestState, reason: str, error: str | None = None) -> None:
        if state.finish_reason is not None and reason != "error":
            return
        if state.held_text and reason != "error":
            self._send(state, state.held_text)
            state.held_text = ""
        state.finish_reason = reason
        state.t_done = time.perf_counter()
        state.on_event(state, "error" if reason == "error" else "done", error)
        state.done.set()

    def _cancel(self, state: RequestState) -> None:
        if state in self._pending:
            self._pending.remove(state)
        elif state.uid is not None and state.uid in self._active:
            self._active.pop(state.uid)
            if self._gen is not None:
                self._gen.remove([state.uid])
        if state.finish_reason is None:
            self._finish(state, "cancelled")

    # --- sequential path (quantized KV, or --continuous-batching off) ------------

    def _run_sequential(self, state: RequestState) -> None:
        import mlx.core as mx
        from mlx_lm.generate import maybe_quantize_kv_cache

        from kvsnap.runtime.sampling import make_request_sampler

        s = self.lm.settings
        model = self.lm.model
        self._active[-state.id] = state
        self._max_batch_seen = max(self._max_batch_seen, 1)
        try:
            check_request(state.request)
            cache, suffix = self._prepare(state)
            sampler = make_request_sampler(state.request.temperature, state.request.top_p, state.request.seed)
            body, last = list(suffix[:-1]), suffix[-1]
            for start in range(0, len(body), s.prefill_step_size):
                chunk = body[start : start + s.prefill_step_size]
                model(mx.array(chunk, dtype=mx.int32)[None], cache=cache)
                maybe_quantize_kv_cache(cache, s.quantized_kv_start, s.kv_group_size, s.kv_bits)
                mx.eval([c.state for c in cache])
                self._computed_measured += len(chunk)
                self._drain(block=False)  # a cancel (or a disconnect) ends a long prefill early
                if self._stopping and state.finish_reason is None:
                    self._finish(state, "cancelled")
                if state.finish_reason is not None:
                    return
            if body:
                state.capture = True
                self._capture(state, cache)
            token = mx.array([[last]], dtype=mx.int32)
            eos = {t[0] for t in self._stop_tokens}
            for i in range(state.request.max_tokens):
                logits = model(token, cache=cache)[:, -1, :]
                if i == 0:
                    self._computed_measured += 1  # the last prompt token
                maybe_quantize_kv_cache(cache, s.quantized_kv_start, s.kv_group_size, s.kv_bits)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                nxt = sampler(logprobs)
                tok = int(nxt.item())
                reason = "stop" if tok in eos else ("length" if i + 1 >= state.request.max_tokens else None)
                self._on_token(state, tok, reason)
                if state.finish_reason is not None:
                    break
                self._drain(block=False)  # lets a cancel (or a disconnect) end this request early
                if self._stopping:
                    self._finish(state, "cancelled")
                if state.finish_reason is not None:
                    break
                token = nxt.reshape(1, 1)
        except Exception as exc:  # this request fails; the engine goes on
            log.exception("[kvsnap] request %d failed", state.id)
            if state.finish_reason is None:
                self._finish(state, "error", f"{type(exc).__name__}: {exc}")
        finally:
            self._active.pop(-state.id, None)

    # --- warm-up prefill -------------------------------------------------------------

    def _prefill_concurrency(self) -> int:
        """At most this many warm prompts are prefilled at once, as one batch.

        1 with a quantized KV: mlx-lm's batch caches cannot hold one.
        """
        n = max(1, int(self.config.warm_prompts_concurrency or 1))
        return n if self.lm.settings.kv_bits is None else 1

    def _prefill_many(self, token_lists) -> list:
        """Prefill warm prefixes: one alone exactly as ``kvsnap build`` does, several as one batch."""
        from kvsnap.runtime.prefill import prefill

        if len(token_lists) <= 1 or self.lm.settings.kv_bits is not None:
            return [prefill(self.lm, tokens) for tokens in token_lists]
        from kvsnap.runtime.batch_prefill import prefill_batched

        return prefill_batched(self._new_generator(len(token_lists), len(token_lists)), token_lists)


def _prompt_counter(gen) -> int | None:
    """mlx-lm's own count of prompt tokens its BatchGenerator has run (padding excluded).

    0.32: ``_counters.prompt_tokens``, added per prefill chunk as the real lengths of the
    sequences in it (the last prompt token runs in the first decode step and is not in it).
    """
    counters = getattr(gen, "_counters", None)
    if counters is not None and hasattr(counters, "prompt_tokens"):
        return int(counters.prompt_tokens)
    legacy = getattr(gen, "_prompt_tokens_counter", None)  # an older layout, if present
    return int(legacy) if legacy is not None else None


def _engine_thread(box: list) -> None:
    """Run the engine loop, then park this daemon thread for good instead of ending it.

    mlx keeps a compile cache per thread; its destructor runs when the thread ends and
    needs the GIL. A thread ending while the interpreter finalizes (right after
    ``shutdown``) then aborts the process ("terminate called without an active
    exception"). A parked daemon thread never runs that destructor; the process exits
    around it.
    """
    main = box.pop()
    try:
        main()
    finally:
        del main
        threading.Event().wait()
