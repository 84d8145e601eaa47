"""A request's cache: its private copy of the best prefix entry at the start, its prompt's
prefix kept for later requests at the end of its prefill, and prefixes shared by requests
admitted together, computed once. Runs on the engine thread.
"""

from __future__ import annotations

import logging

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx

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
    is_trimmable,
)

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


def capture_request_prefix(prefix: PrefixCache, state: RequestState, cache: list) -> None:
    """Keep the prompt minus its last token for multi-turn reuse; captured before any decode.

    Its arrays are evaluated now: arrays left to compute would hold the batch's buffer, and the
    next decode step would copy that whole buffer instead of writing into it in place.
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
    own = copy_cache(cache)
    mx.eval([a for c in own for a in cache_arrays(c)])
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
