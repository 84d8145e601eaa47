"""A request's cache: its private copy of the best prefix entry at the start, its prompt's
prefix kept for later requests at the end of its prefill, and prefixes shared by requests
admitted together, computed once. Runs on the engine thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx

from kvsnap.runtime.cache.composed import ComposedState
from kvsnap.runtime.cache.prefix import Entry, PrefixCache
from kvsnap.runtime.cache.shared_prefix import shared_groups
from kvsnap.runtime.engine.accounting import TokenAccounts
from kvsnap.runtime.engine.types import RequestState
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


def prepare_request(
    lm: LoadedModel,
    prefix: PrefixCache,
    accounts: TokenAccounts,
    state: RequestState,
    persister: Persister | None = None,
) -> tuple[list, list[int]]:
    """Fetch the longest cached prefix (a private copy), account for it; returns the cache
    and the suffix still to run. ``persister``: persisted conversations are looked up too."""
    tokens = state.request.tokens
    if persister is not None and state.request.capture:
        persister.offer(prefix, tokens, state.request.namespace)
    cache, n_cached, match = prefix.fetch(tokens, state.request.namespace)
    if cache is None:
        cache = lm.make_cache()
    if (
        match is not None
        and match.entry.namespace == state.request.namespace
        and match.entry.source in ("request", "persisted")
        and n_cached == len(match.entry.tokens)
    ):
        state.extends = match.entry.tokens
    accounts.start_request(state, n_cached)
    state.cache_source = match.entry.source if match is not None else ""
    # A partial match on an entry shared with others tells how far the prompts agree.
    state.cache_shared_partial = (
        match is not None
        and (n_cached < len(match.entry.tokens) or match.entry.inner)
        and (match.entry.namespace is None or match.entry.namespace == "")
    )
    if state.cache_shared_partial:
        # The client sent a whole warm prompt itself: that much is never hidden from it.
        state.whole_shared_tokens = prefix.whole_shared_prefix(tokens)
    private = state.request.namespace != ""
    if state.cache_shared_partial and private:
        own = prefix.lookup(tokens, state.request.namespace, shared=False)
        state.own_cached_tokens = own.n_cached if own else 0
    if (
        private
        and match
        and match.entry.namespace != state.request.namespace
        and n_cached == len(tokens) - 1
    ):
        # Nothing left to prefill, so the usual capture would not run: keep the prefix now.
        # Whether a tenant's own entry exists must not depend on how far a shared one matched
        # (its existence would spell out the shared match length).
        capture_request_prefix(prefix, state, cache)
    state.detok = lm.tokenizer.detokenizer
    state.detok.reset()
    return cache, tokens[n_cached:]


@dataclass(frozen=True)
class SharedHead:
    """The warm blocks a request's cache was copied from: its kept prefix shares them."""

    state: ComposedState
    n_tokens: int


def capture_request_prefix(
    prefix: PrefixCache,
    state: RequestState,
    cache: list,
    head: SharedHead | None = None,
    views: bool = False,
) -> None:
    """Keep the prompt minus its last token for multi-turn reuse; captured before any decode.

    ``views``: ``cache`` holds views of the batch's buffer (``batch_cache``). What is kept is
    then copied now (views left would hold the buffer, and the next decode step would copy it
    whole), and of a ``head``'s tokens nothing is copied: the kept prefix shares its blocks.
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
    if views:
        own, computed = _kept_from_views(cache, tokens, head)
    else:
        own = copy_cache(cache)
        computed = [a for c in own for a in cache_arrays(c)]
    mx.eval(computed)
    entry = Entry(
        tokens=tokens,
        state=own,
        nbytes=cache_nbytes_of(own),
        trimmable=is_trimmable(own),
        pinned=False,
        source="request",
        namespace=state.request.namespace,
    )
    prefix.add(entry)
    if prefix.on_request_prefix is not None:
        prefix.on_request_prefix(entry, state)


def _kept_from_views(
    cache: list, tokens: tuple[int, ...], head: SharedHead | None
) -> tuple[list, list]:
    """The kept prefix from views of a batch's buffer, and the arrays to compute now: the
    request's own tokens copied, a shared head's tokens as its blocks (their concatenation is
    computed by the first request that reads the prefix, or by persisting it)."""
    arrays, layers = encode_cache(cache, tokens)
    del arrays[TOKENS]
    n = head.n_tokens if head is not None else 0
    shared = head.state.head(n) if head is not None and head.state.checkpoint is None else {}
    kept: dict = {}
    computed: list = []
    for name, a in arrays.items():
        pieces = shared.get(name)
        if pieces and 0 < n < a.shape[-2] and _same_form(pieces, a, n):
            tail = mx.contiguous(a[..., n:, :])
            kept[name] = mx.concatenate([*pieces, tail], axis=-2)
            computed.append(tail)
        else:
            kept[name] = mx.contiguous(a)
            computed.append(kept[name])
    return decode_cache(kept, layers), computed


def _same_form(pieces: list, a: mx.array, n: int) -> bool:
    """Whether ``pieces`` are ``a``'s first ``n`` tokens in its form (dtype, heads, width)."""
    return sum(p.shape[-2] for p in pieces) == n and all(
        p.dtype == a.dtype and p.shape[:-2] == a.shape[:-2] and p.shape[-1] == a.shape[-1]
        for p in pieces
    )


def prefill_shared_prefixes(
    lm: LoadedModel, prefix: PrefixCache, accounts: TokenAccounts, batch: list[RequestState]
) -> tuple[int, list[Entry]]:
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
        shared = tuple(first.tokens[: group.length])
        match = prefix.lookup(first.tokens[: group.length + 1], first.namespace)
        start = match.n_cached if match else 0
        if group.length - start < MIN_SHARED_TOKENS_TO_COMPUTE:
            continue  # the cache already holds (nearly) all of it
        try:
            cache, start, _ = prefix.fetch(
                first.tokens[: group.length + 1], first.namespace, count=False
            )
            cursor = PrefillCursor(lm, shared, done_tokens=start, cache=cache or lm.make_cache())
            while cursor.step():
                pass
            check_captured_at(cursor.cache, group.length)
        # the members then prefill on their own
        except (CaptureError, ValueError, RuntimeError) as exc:
            log.warning(
                "[kvsnap] shared prefix of %d requests not computed: %s", len(group.members), exc
            )
            continue
        accounts.ran(group.length - start)
        computed += 1
        entry = Entry(
            tokens=shared,
            state=cursor.cache,
            nbytes=cache_nbytes_of(cursor.cache),
            trimmable=is_trimmable(cursor.cache),
            pinned=False,
            source="shared",
            namespace=first.namespace,
        )
        prefix.add(entry)
        if not first.capture:
            discard.append(entry)  # serves this batch only: request prefixes are off
    return computed, discard
