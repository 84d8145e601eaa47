"""Continuous batching through mlx-lm's BatchGenerator: admit waiting requests, run one step,
free finished slots. Runs on the engine thread.

Per request: its private cache copy goes in with only the suffix (``batch_cache`` keeps the
batch from copying it again); at the end of the prompt's first segment (all but the last
token) its cache is captured into the prefix cache, and at its finish its prompt + reply (the
row's cache, taken before the slot is freed); its tokens go out through ``request_output``.
Built with what it works with: the generators of the loaded model, each request's cache
(``request_cache.RequestCaches``), the scheduler and the token accounts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from kvsnap.runtime.cache.composed import ComposedState
from kvsnap.runtime.cache.prefix import Match
from kvsnap.runtime.engine.accounting import TokenAccounts
from kvsnap.runtime.engine.batch_cache import (
    MIN_SHARED_TOKENS,
    SharedPrefix,
    for_batch,
    install_shared_attention,
    shared_prefix_of,
    with_shared_prefix,
)
from kvsnap.runtime.engine.request_cache import RequestCaches, SharedHead
from kvsnap.runtime.engine.request_output import deliver_token, finish_request
from kvsnap.runtime.engine.sampling import (
    OwnSampler,
    batch_sampler,
    make_request_sampler,
    token_logprob,
)
from kvsnap.runtime.engine.scheduler import Scheduler
from kvsnap.runtime.engine.step_threads import StepThreads
from kvsnap.runtime.engine.types import RequestState, check_request
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.persist.persister import PERSISTED

log = logging.getLogger("kvsnap.runtime.engine.engine")

MAX_SHARED_PREFIXES = 8  # distinct shared prefixes remembered while the batch runs


@dataclass(frozen=True)
class Generators:
    """mlx-lm BatchGenerators of the loaded model on the engine's own stream: the warm-up's
    batched prefill, the batch runner's, the kernel priming's."""

    lm: LoadedModel
    # one list per stop token, as mlx-lm's BatchGenerator takes them
    stop_tokens: list[list[int]]
    stream: Callable[[], mx.Stream]  # gives the engine's own mlx stream

    def new(self, batch_size: int, prefill_batch_size: int) -> BatchGenerator:
        """A generator of ``batch_size`` rows, prefilling at most ``prefill_batch_size``."""
        return BatchGenerator(
            self.lm.model,
            stop_tokens=self.stop_tokens,
            completion_batch_size=batch_size,
            prefill_batch_size=min(prefill_batch_size, batch_size),
            prefill_step_size=self.lm.settings.prefill_step_size,
            max_kv_size=self.lm.settings.max_kv_size,
            stream=self.stream(),
        )


class BatchRunner:
    def __init__(
        self,
        generators: Generators,
        caches: RequestCaches,
        sched: Scheduler,
        accounts: TokenAccounts,
        prefill_batch_size: int,
        threads: StepThreads,
    ):
        self.lm, self.new_generator = generators.lm, generators.new
        self.caches, self.sched, self.accounts = caches, sched, accounts
        self.prefill_batch_size = prefill_batch_size
        # the live generator, made on first use
        self.gen: BatchGenerator | None = None
        self.shared_prefills = 0  # shared prefixes of requests admitted together, computed once
        self.shared_prefix_rows = 0  # rows admitted reading their hit shared (``batch_cache``)
        # by uid: the warm blocks a running request's cache was copied from, until its finish
        # (its kept prompt and its kept prompt + reply share them)
        self._heads: dict[int, SharedHead] = {}
        # by uid: the samplers that may raise (not greedy's), checked after each step
        self._samplers: dict[int, OwnSampler] = {}
        # whether the model's attention reads a batch's shared prefix (dense llama/qwen)
        self.shares_prefixes = install_shared_attention(self.lm.model)
        # by the tokens they hold: the prefixes running rows read shared (read-only arrays)
        self._prefixes: dict[tuple[int, ...], list[SharedPrefix]] = {}
        # uids whose prompt is still being computed: while there are none, a step only decodes
        self._prompting: set[int] = set()
        self.threads = threads  # OpenBLAS's count per step

    def drop(self) -> None:
        """Forget the generator, keeping the prompt tokens it counted."""
        if self.gen is not None:
            self.accounts.detach(self.gen)
            self.gen = None
        self._heads.clear()
        self._samplers.clear()
        self._prefixes.clear()
        self._prompting.clear()

    def remove(self, uid: int) -> None:
        """Free a cancelled request's slot."""
        self._heads.pop(uid, None)
        self._samplers.pop(uid, None)
        self._prompting.discard(uid)
        if self.gen is not None:
            self.gen.remove([uid])

    def admit(self) -> None:
        """Start waiting requests while slots are free; a request that cannot start fails alone."""
        if not self.sched.pending:
            return
        if self.gen is None:
            self.gen = self.new_generator(self.sched.max_batch_size, self.prefill_batch_size)
            self.accounts.attach(self.gen)
        gen = self.gen
        if not self.sched.active:
            self._prefixes.clear()  # no row reads them any more
        self.threads.before_step(decoding_only=False)  # a shared prefix may be computed here
        computed, discard = self.caches.prefill_shared_prefixes(self.sched.next_batch())
        self.shared_prefills += computed
        while (state := self.sched.next_to_admit()) is not None:
            r = state.request
            try:
                check_request(r)
                prepared = self.caches.prepare(state)
                cache, suffix = prepared.cache, prepared.suffix
                sampler = batch_sampler(
                    make_request_sampler(r.temperature, r.top_p, r.seed, r.top_k, r.min_p)
                )
                uid = gen.insert(
                    [list(suffix)],
                    max_tokens=[r.max_tokens],
                    caches=[self._batch_cache(r.tokens, cache, len(suffix))],
                    samplers=[sampler],
                )[0]
            except Exception as exc:  # this request fails; the batch goes on
                log.warning("[kvsnap] request %d failed to start: %s", state.id, exc)
                finish_request(state, "error", f"{type(exc).__name__}: {exc}")
                continue
            state.uid = uid
            self._prompting.add(uid)
            if isinstance(sampler, OwnSampler):
                self._samplers[uid] = sampler
            state.capture = len(suffix) > 1
            head = self._shared_head(prepared.match, len(r.tokens) - len(suffix))
            if r.capture and head is not None:
                self._heads[uid] = head
            # mlx-lm runs the last token in the first decode step
            self.accounts.expect_batched(len(suffix))
            self.sched.activate(uid, state)
        self.caches.discard(discard)

    def _batch_cache(self, tokens: list[int], cache: list, new: int) -> list:
        """The request's cache as the batch takes it: with a long enough hit, its cached tokens
        read shared with the other rows (the batch keeps what they have in common shared:
        ``batch_cache``), its private copy then computed once at most; else that private copy
        (``batch_cache.for_batch``)."""
        n = len(tokens) - new
        if not self.shares_prefixes or n < MIN_SHARED_TOKENS:
            return for_batch(cache, new)
        key = tuple(tokens[:n])
        prefixes = self._prefixes.get(key)
        if prefixes is None:
            prefixes = shared_prefix_of(cache, key)
            if prefixes is None:
                return for_batch(cache, new)
            if len(self._prefixes) >= MAX_SHARED_PREFIXES:
                self._prefixes.pop(next(iter(self._prefixes)))
            self._prefixes[key] = prefixes
        self.shared_prefix_rows += 1
        return with_shared_prefix(prefixes, new)

    def _shared_head(self, match: Match | None, n_cached: int) -> SharedHead | None:
        """The warm blocks the request's cache was copied from, when the fetch's ``match`` (of
        ``n_cached`` tokens) was a composed state."""
        if n_cached == 0:
            return None
        if match is None or match.n_cached != n_cached:
            return None
        found = match.entry.state
        if not isinstance(found, ComposedState):
            return None
        if match.entry.source == PERSISTED:
            # A conversation's next record slices its new blocks out of the kept prefix: a
            # shared head would leave that a concatenation of every block, which the persister
            # then computes on the serving path (2.6 s at 4k fp32 tokens; one copy: 0.5 s).
            # A fetched record's buffers are the exception: the kept prefix extends them.
            whole = found.buffers is not None and n_cached == found.buffers.n
            return SharedHead(found, n_cached) if whole else None
        return SharedHead(found, n_cached)

    def step(self) -> None:
        """One BatchGenerator step: prompt chunks (capturing finished prompt prefixes), then
        tokens."""
        gen = self.gen
        if gen is None:  # nothing admitted yet
            return
        self.threads.before_step(decoding_only=not self._prompting)
        prompt_responses, generation_responses = gen.next()
        failed = self._fail_sampling(gen)
        for r in prompt_responses:
            if r.end_of_prompt:
                self._prompting.discard(r.uid)
            state = self.sched.active.get(r.uid)
            if state is not None and state.capture and r.end_of_segment and not r.end_of_prompt:
                # copied now: a copy still to compute would hold the batch's buffer, and the
                # next decode step would copy the whole buffer instead of writing in place
                self.caches.capture(
                    state,
                    gen.extract_cache([r.uid])[r.uid][0],
                    self._heads.get(r.uid),
                    views=True,
                )
        for r in generation_responses:
            state = self.sched.active.get(r.uid)
            if state is None or r.uid in failed:
                continue
            # the decode step that produced this token ran the last prompt token
            self.accounts.first_decode(state)
            n = state.request.top_logprobs
            lp = None if n is None else token_logprob(r.logprobs, r.token, n)
            deliver_token(state, r.token, r.finish_reason, lp)
            if state.finish_reason is not None:
                self.sched.release(r.uid)
                self._samplers.pop(r.uid, None)
                self._keep_reply(gen, r, state, self._heads.pop(r.uid, None))
                if r.finish_reason is None:  # stopped by a stop string: free the slot now
                    gen.remove([r.uid])

    def _keep_reply(
        self, gen: BatchGenerator, r: Any, state: RequestState, head: SharedHead | None
    ) -> None:
        """A finished request's prompt + reply kept: mlx-lm hands a row it ended its cache and
        tokens; a row ended by a stop string is read before its slot is freed."""
        if not state.request.capture:
            return
        if r.prompt_cache is not None:
            cache, held = r.prompt_cache, r.all_tokens
        else:
            cache, held = gen.extract_cache([r.uid])[r.uid]
        self.caches.capture_reply(state, cache, held, head)

    def _fail_sampling(self, gen: BatchGenerator) -> set[int]:
        """End each request whose sampler raised in this step, alone: its slot is freed and the
        others' tokens go on."""
        failed = {uid for uid, s in self._samplers.items() if s.error is not None}
        for uid in failed:
            error = self._samplers.pop(uid).error
            self._heads.pop(uid, None)
            self._prompting.discard(uid)
            state = self.sched.active.get(uid)
            if state is not None:
                self.accounts.first_decode(state)  # the step ran its last prompt token
                log.warning("[kvsnap] request %d: sampling failed: %s", state.id, error)
                finish_request(state, "error", f"{type(error).__name__}: {error}")
                self.sched.release(uid)
        if failed:
            gen.remove(list(failed))
        return failed

    def prime_kernels(self) -> None:
        """A throwaway 3-token request on its own generator (the token counters stay exact).

        mlx's CPU backend compiles ``mx.compile``'d kernels (mlx-lm's swiglu, ...) on first
        use; a server restored from snapshots has run no model pass yet and would pay 1-3 s
        of that in its first TTFT (a warm-prompts server pays it in its start-up prefill).
        """
        tokens = list(self.lm.tokenizer.encode("hello world"))[:3] or [0]
        gen = self.new_generator(1, 1)
        gen.insert(
            [tokens],
            max_tokens=[1],
            caches=[self.lm.make_cache()],
            samplers=[make_request_sampler(0.0, 1.0, None)],
        )
        for _ in range(8):  # one prefill step and one decode step finish it; bounded regardless
            if any(r.finish_reason for r in gen.next()[1]):
                break
