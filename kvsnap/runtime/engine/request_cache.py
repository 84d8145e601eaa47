"""A request's cache on the engine thread, one job per function.

At admission (``RequestCaches.prepare``):

- lookup (``look_up``): the namespace's persisted record offered to the prefix cache, then the
  fetch, a private copy of the entry that saves the most tokens;
- accounting (``account_for``): cached and computed tokens, where the cache came from, the
  entry of its own it extends;
- privacy (``RequestCaches.keep_private``): what ``cached_tokens`` may tell a tenant about
  entries shared with others, and a tenant's own prefix kept when nothing is left to prefill;
- the detokenizer reset (``reset_detokenizer``).

At the end of a prompt's first segment its prefix is kept for later requests and handed to
the persister (``RequestCaches.capture``); at a request's normal finish its prompt + reply,
the tokens its cache holds, is kept the same way (``RequestCaches.capture_reply``), so the
next turn reuses the reply too; prefixes shared by requests admitted together are computed
once (``RequestCaches.prefill_shared_prefixes``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx

from kvsnap.runtime.cache.composed import ComposedState
from kvsnap.runtime.cache.prefix import Entry, Match, PrefixCache
from kvsnap.runtime.cache.shared_prefix import shared_groups
from kvsnap.runtime.engine.accounting import TokenAccounts
from kvsnap.runtime.engine.types import GenerationRequest, RequestState
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.persist.persister import Persister
from kvsnap.runtime.prefill.chunked import PrefillCursor
from kvsnap.snapshot.codec import (
    CaptureError,
    cache_arrays,
    cache_nbytes_of,
    check_captured_at,
    copy_cache,
    decode_cache,
    encode_cache,
    is_trimmable,
)
from kvsnap.snapshot.format import TOKENS

log = logging.getLogger("kvsnap.runtime.engine.engine")

MIN_SHARED_TOKENS_TO_COMPUTE = 32  # a shared prefix mostly cached already is not computed again
# A reply shorter than this is not persisted (it stays kept in memory): its record would write a
# header, two fsyncs and the prompt's last block again to save a restart's prefill of a few tokens
MIN_PERSISTED_REPLY = 16


@dataclass(frozen=True)
class Lookup:
    """What the lookup found for a request: its private cache (a fresh one on a miss), how many
    of its tokens that cache holds, and the entry it was copied from (None: a miss)."""

    cache: list
    n_cached: int
    match: Match | None

    @property
    def source(self) -> str:
        """Where the cache came from (an entry's source; "" on a miss)."""
        return self.match.entry.source if self.match is not None else ""


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to run: its cache, the tokens still to compute, and the lookup's match
    (the batch runner's shared head comes from it, not from a second lookup)."""

    cache: list
    suffix: list[int]
    match: Match | None


@dataclass(frozen=True)
class SharedHead:
    """The warm blocks a request's cache was copied from: its kept prefix shares them."""

    state: ComposedState
    n_tokens: int


def look_up(
    lm: LoadedModel, prefix: PrefixCache, persister: Persister | None, request: GenerationRequest
) -> Lookup:
    """The lookup: the namespace's persisted record is offered first (indexed when it holds
    more than memory does, it loads on this fetch), then the fetch gives a private copy of the
    entry that saves the most tokens, or a fresh cache on a miss."""
    tokens = request.tokens
    if persister is not None and request.capture:
        persister.offer(tokens, request.namespace)
    cache, n_cached, match = prefix.fetch(tokens, request.namespace)
    return Lookup(cache if cache is not None else lm.make_cache(), n_cached, match)


def account_for(accounts: TokenAccounts, state: RequestState, found: Lookup) -> None:
    """The accounting: the request's cached and computed tokens counted, where its cache came
    from, and the request prefix of its own it extends in full."""
    state.extends = extended_tokens(state.request, found)
    accounts.start_request(state, found.n_cached)
    state.cache_source = found.source


def extended_tokens(request: GenerationRequest, found: Lookup) -> tuple[tuple[int, ...], ...]:
    """The tokens of the request prefix (or persisted record) of the request's own namespace
    that the cache holds whole, and of a prompt + reply entry's prompt that it holds whole (its
    record was kept beside it): a persisted conversation's records for them are then superseded
    by this request's."""
    match = found.match
    if (
        match is None
        or match.entry.namespace != request.namespace
        or match.entry.source not in ("request", "persisted")
    ):
        return ()
    entry, held = match.entry, found.n_cached
    whole = (entry.tokens,) if held == len(entry.tokens) else ()
    prompt = entry.prompt_end
    return whole + ((entry.tokens[:prompt],) if 0 < prompt <= held else ())


def shared_partial_match(found: Lookup) -> bool:
    """Whether the cache is a partial match on an entry shared with others (a warm entry cut
    short, or a checkpoint inside a warm prompt): it tells how far the prompts agree."""
    match = found.match
    return (
        match is not None
        and (found.n_cached < len(match.entry.tokens) or match.entry.inner)
        and (match.entry.namespace is None or match.entry.namespace == "")
    )


def tell_shared_match(prefix: PrefixCache, state: RequestState, found: Lookup) -> None:
    """Note what ``cached_tokens`` may tell of a shared partial match
    (``accounting.reported_cached_tokens`` rounds it): never less than a whole warm prompt the
    client sent itself, nor than its own namespace's best match."""
    state.cache_shared_partial = shared_partial_match(found)
    if not state.cache_shared_partial:
        return
    tokens, namespace = state.request.tokens, state.request.namespace
    # The client sent a whole warm prompt itself: that much is never hidden from it.
    state.whole_shared_tokens = prefix.whole_shared_prefix(tokens)
    if namespace != "":
        own = prefix.lookup(tokens, namespace, shared=False)
        state.own_cached_tokens = own.n_cached if own else 0


def keeps_own_prefix_now(request: GenerationRequest, found: Lookup) -> bool:
    """Whether a tenant's request must keep its prompt prefix at admission: another namespace's
    entry left it nothing to prefill, so the usual capture would not run."""
    match = found.match
    return (
        request.namespace != ""
        and match is not None
        and match.entry.namespace != request.namespace
        and found.n_cached == len(request.tokens) - 1
    )


def reset_detokenizer(lm: LoadedModel, state: RequestState) -> None:
    """The request's text starts from nothing: the tokenizer's streaming detokenizer, reset."""
    state.detok = lm.tokenizer.detokenizer
    state.detok.reset()


class RequestCaches:
    """Every request's cache, on the engine thread: prepared at admission, its prompt prefix
    kept at the end of its prefill, prefixes shared by requests admitted together computed
    once. Built with what it works with: the model, the prefix cache, the token accounts and,
    with ``--persist-requests``, the persister (looked up first, told of every kept prefix)."""

    def __init__(
        self,
        lm: LoadedModel,
        prefix: PrefixCache,
        accounts: TokenAccounts,
        persister: Persister | None = None,
    ):
        self.lm, self.prefix, self.accounts, self.persister = lm, prefix, accounts, persister

    def prepare(self, state: RequestState) -> PreparedRequest:
        """Prepare a request's cache at admission: lookup, accounting, privacy, detokenizer."""
        found = look_up(self.lm, self.prefix, self.persister, state.request)
        account_for(self.accounts, state, found)
        self.keep_private(state, found)
        reset_detokenizer(self.lm, state)
        return PreparedRequest(found.cache, state.request.tokens[found.n_cached :], found.match)

    def keep_private(self, state: RequestState, found: Lookup) -> None:
        """The tenant privacy rule: what ``cached_tokens`` may tell of a shared match, and a
        tenant's own prefix kept at once when another namespace's entry left nothing to
        prefill."""
        tell_shared_match(self.prefix, state, found)
        if keeps_own_prefix_now(state.request, found):
            # Whether a tenant's own entry exists must not depend on how far a shared one
            # matched (its existence would spell out the shared match length).
            self.capture(state, found.cache)

    def capture(
        self,
        state: RequestState,
        cache: list,
        head: SharedHead | None = None,
        views: bool = False,
    ) -> None:
        """Keep the prompt minus its last token for multi-turn reuse (captured before any
        decode) and, with ``--persist-requests``, hand it to the persister.

        ``views``: ``cache`` holds views of the batch's buffer (``batch_cache``). What is kept
        is then copied now (views left would hold the buffer, and the next decode step would
        copy it whole), and of a ``head``'s tokens nothing is copied: the kept prefix shares
        its blocks.
        """
        state.capture = False
        if not state.request.capture:
            return
        tokens = tuple(state.request.tokens[:-1])
        try:
            check_captured_at(cache, len(tokens))
        except CaptureError as exc:
            log.debug("[kvsnap] not capturing request %d: %s", state.id, exc)
            return
        entry = kept_entry(state, cache, tokens, head, views)
        self.prefix.add(entry)
        if self.persister is not None:
            computed = len(entry.tokens) - state.cached_tokens
            seconds = time.perf_counter() - state.t_submit
            self.persister.captured(entry, state.extends, computed, seconds)

    def capture_reply(
        self,
        state: RequestState,
        cache: list,
        held: Sequence[int],
        head: SharedHead | None = None,
        views: bool = True,
    ) -> None:
        """Keep prompt + reply at a request's normal finish ("stop" or "length", a stop string
        included; a cancelled or failed request keeps nothing new) and, with
        ``--persist-requests``, hand it to the persister.

        ``cache``: the row's cache, views of the batch's buffer, taken before its slot is freed;
        ``held``: the tokens mlx-lm fed into it after the cached head (the suffix, then every
        generated token: mlx-lm feeds each one as it returns it), so the entry's key is exactly
        what it holds; of a ``head``'s tokens nothing is copied (as ``capture``). ``views``:
        False for a request's own cache (one request at a time: ``sequential``), which feeds
        every generated token but the last.
        A trimmable entry supersedes the request's prompt entry and the entry its prompt
        extended in full (it serves every prefix they did); an untrimmable one (a hybrid's
        checkpoint at the end of the reply) is kept beside them, since the next turn's
        rendering of the reply may differ (a stripped think block) and only a strict prefix
        serves it.
        """
        request = state.request
        if not request.capture or state.finish_reason not in ("stop", "length"):
            return
        tokens = tuple(request.tokens[: state.cached_tokens]) + tuple(held)
        if len(tokens) <= len(request.tokens) or tokens[: len(request.tokens)] != tuple(
            request.tokens
        ):
            log.debug("[kvsnap] request %d: no reply held to keep", state.id)
            return
        try:
            check_captured_at(cache, len(tokens))
        except CaptureError as exc:
            log.debug("[kvsnap] not keeping the reply of request %d: %s", state.id, exc)
            return
        entry = kept_entry(state, cache, tokens, head, views)
        prompt = tuple(request.tokens[:-1])
        entry.prompt_end = len(prompt)
        if not self.prefix.add(entry):
            return  # over the budget alone: the prompt entry stays as it was
        if entry.trimmable:
            for older in {prompt, *state.extends}:
                self.prefix.supersede(entry, older)
        if self.persister is not None and len(tokens) - len(prompt) > MIN_PERSISTED_REPLY:
            # Supersedes no record: after a restart only a strict prefix is found, and where
            # the next turn re-renders the reply otherwise (a stripped think block) the
            # prompt's record serves it. The next turn's record supersedes both.
            self.persister.captured(entry, ())

    def prefill_shared_prefixes(self, batch: list[RequestState]) -> tuple[int, list[Entry]]:
        """Requests admitted together that share an uncached prefix: compute it once, as a
        prefix entry of their namespace that each of them then hits.

        Returns how many were computed, and the entries to discard once the batch is admitted
        (those of requests that keep no prefixes).
        """
        computed = 0
        discard: list[Entry] = []
        if len(batch) < 2:
            return computed, discard
        for group in shared_groups(
            [s.request.tokens for s in batch], [s.request.namespace for s in batch]
        ):
            first = batch[group.members[0]].request
            entry = self._prefill_shared(first, group.length, len(group.members))
            if entry is None:
                continue
            computed += 1
            self.prefix.add(entry)
            if not first.capture:
                discard.append(entry)  # serves this batch only: request prefixes are off
        return computed, discard

    def _prefill_shared(self, first: GenerationRequest, length: int, members: int) -> Entry | None:
        """The first ``length`` tokens of ``first`` computed from the best cached entry, as an
        entry of its namespace; None when the cache holds (nearly) all of them already or the
        prefill failed (the ``members`` requests then prefill on their own)."""
        shared = tuple(first.tokens[:length])
        match = self.prefix.lookup(first.tokens[: length + 1], first.namespace)
        start = match.n_cached if match else 0
        if length - start < MIN_SHARED_TOKENS_TO_COMPUTE:
            return None  # the cache already holds (nearly) all of it
        try:
            cache, start, _ = self.prefix.fetch(
                first.tokens[: length + 1], first.namespace, count=False
            )
            cursor = PrefillCursor(
                self.lm, shared, done_tokens=start, cache=cache or self.lm.make_cache()
            )
            while cursor.step():
                pass
            check_captured_at(cursor.cache, length)
        # the members then prefill on their own
        except (CaptureError, ValueError, RuntimeError) as exc:
            log.warning("[kvsnap] shared prefix of %d requests not computed: %s", members, exc)
            return None
        self.accounts.ran(length - start)
        return Entry(
            tokens=shared,
            state=cursor.cache,
            nbytes=cache_nbytes_of(cursor.cache),
            trimmable=is_trimmable(cursor.cache),
            pinned=False,
            source="shared",
            namespace=first.namespace,
        )

    def discard(self, entries: list[Entry]) -> None:
        """Forget entries that served one batch only (``prefill_shared_prefixes``)."""
        for entry in entries:
            self.prefix.discard(entry)


def kept_entry(
    state: RequestState,
    cache: list,
    tokens: tuple[int, ...],
    head: SharedHead | None,
    views: bool,
) -> Entry:
    """The request prefix entry kept of ``cache`` (its first ``tokens``), computed now."""
    if views:
        own, computed = _kept_from_views(cache, tokens, head)
    else:
        own = copy_cache(cache)
        computed = [a for c in own for a in cache_arrays(c)]
    mx.eval(computed)
    return Entry(
        tokens=tokens,
        state=own,
        nbytes=cache_nbytes_of(own),
        trimmable=is_trimmable(own),
        pinned=False,
        source="request",
        namespace=state.request.namespace,
    )


def _kept_from_views(
    cache: list, tokens: tuple[int, ...], head: SharedHead | None
) -> tuple[list, list]:
    """The kept prefix from views of a batch's buffer, and the arrays to compute now: the
    request's own tokens copied, a shared head's tokens as its blocks (their concatenation is
    computed by the first request that reads the prefix, or by persisting it), or a fetched
    record's buffers extended by the request's own tokens (nothing else copied)."""
    arrays, layers = encode_cache(cache, tokens)
    del arrays[TOKENS]
    n = head.n_tokens if head is not None else 0
    buffers = head.state.buffers if head is not None else None
    if head is not None and buffers is not None:
        # views of the buffers, as a local hit's kept prefix is one buffer: the own tokens
        # written into their room (a fetched record's 32 blocks copied into fresh memory
        # took 4.7-5.2 s at 8k fp32 tokens on 2 cores; a local hit's copy 0.8-1.1 s)
        rows = _own_tokens(cache, n)
        tails = {name: rows[name] if name in rows else a[..., n:, :] for name, a in arrays.items()}
        views = buffers.extend(tokens[n:], tails) if n == buffers.n else None
        if views is not None:
            return decode_cache(views, layers), list(views.values())
        head, n = None, 0  # the room is another request's: copied whole, as a record's head
    shared = head.state.head(n) if head is not None and head.state.checkpoint is None else {}
    own = _own_tokens(cache, n)
    kept: dict = {}
    computed: list = []
    for name, a in arrays.items():
        pieces = shared.get(name)
        if pieces and 0 < n < a.shape[-2] and _same_form(pieces, a, n):
            tail = mx.contiguous(own[name] if name in own else a[..., n:, :])
            kept[name] = mx.concatenate([*pieces, tail], axis=-2)
            computed.append(tail)
        else:
            kept[name] = mx.contiguous(a)
            computed.append(kept[name])
    return decode_cache(kept, layers), computed


def _own_tokens(cache: list, n: int) -> dict:
    """By tensor name, the tokens after ``n`` of each layer that read a batch's shared prefix
    (``batch_cache``'s ``extract`` gives them apart), sliced from the row's own tokens: slicing
    the prefix's concatenation would compute all of it."""
    out: dict = {}
    for i, c in enumerate(cache):
        start = getattr(c, "shared_tokens", None)
        if start is None or n < start:
            continue
        keys, values = c.own
        out[f"{i}.keys"], out[f"{i}.values"] = (
            keys[..., n - start :, :],
            values[..., n - start :, :],
        )
    return out


def _same_form(pieces: list, a: mx.array, n: int) -> bool:
    """Whether ``pieces`` are ``a``'s first ``n`` tokens in its form (dtype, heads, width)."""
    return sum(p.shape[-2] for p in pieces) == n and all(
        p.dtype == a.dtype and p.shape[:-2] == a.shape[:-2] and p.shape[-1] == a.shape[-1]
        for p in pieces
    )
