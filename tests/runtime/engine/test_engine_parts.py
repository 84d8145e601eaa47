"""The engine's parts alone, without a model: stop strings, request output, token accounting,
scheduling decisions. (tests/runtime/engine/test_engine.py runs them together on real tiny
models.)"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvsnap.runtime.engine.accounting import (
    COUNTED,
    MEASURED,
    TokenAccounts,
    cache_stats,
    prompt_counter,
)
from kvsnap.runtime.engine.request_output import deliver_token, finish_request
from kvsnap.runtime.engine.scheduler import Scheduler, uses_batching
from kvsnap.runtime.engine.stop_strings import scan_stop_strings
from kvsnap.runtime.engine.types import GenerationRequest, RequestState

# --- stop strings --------------------------------------------------------------------


def feed(segments: list[str], stops: tuple[str, ...]) -> tuple[str, bool]:
    """Stream ``segments`` through the scanner as the engine does: (text sent, stopped)."""
    sent, held = "", ""
    for i, seg in enumerate(segments):
        scan = scan_stop_strings(held, seg, stops, final=i == len(segments) - 1)
        sent, held = sent + scan.send, scan.held
        if scan.stopped:
            return sent, True
    return sent + held, False


def test_a_stop_string_split_across_three_chunks_is_found_and_never_sent():
    assert feed(["Hello, wo", "rld! EN", "D and more"], ("END",)) == ("Hello, world! ", True)
    assert feed(["ab", "c", "d"], ("bcd",)) == ("a", True)


def test_the_tail_that_could_start_a_stop_string_is_held_then_released():
    scan = scan_stop_strings("", "answer: EN", ("END",), final=False)
    assert (scan.send, scan.held, scan.stopped) == ("answer: ", "EN", False)
    scan = scan_stop_strings(scan.held, "ough", ("END",), final=False)
    # no stop: all but the last len("END") - 1 characters go
    assert (scan.send, scan.held) == ("ENou", "gh")
    # nothing is held at the end
    assert scan_stop_strings("gh", "", ("END",), final=True).send == "gh"


def test_the_earliest_stop_string_wins_and_empty_ones_are_ignored():
    assert scan_stop_strings("", "xx STOP yy END", ("END", "STOP", ""), final=False).send == "xx "
    assert scan_stop_strings("", "plain", ("",), final=False) == scan_stop_strings(
        "", "plain", (), final=False
    )
    assert scan_stop_strings("", "plain", (), final=False).held == ""


def first_to_complete(text: str, stops: list[str]) -> tuple[str, bool]:
    """The oracle, on the whole text: generation stops when a stop string is complete, so the
    output ends before the stop string whose first occurrence ends first (ties: the longer)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[: min(hits)[1]], True) if hits else (text, False)


def test_a_stop_string_that_completes_first_wins_over_one_that_starts_earlier_issue_24():
    """'c' is complete at 'Dc', before 'DcD' is: streaming stops there, so must one segment."""
    assert feed(["Dc", "D"], ("c", "DcD")) == ("D", True)
    assert feed(["DcD"], ("c", "DcD")) == ("D", True)
    assert feed(["xDc", "D"], ("DcD", "c")) == feed(["xDcD"], ("DcD", "c")) == ("xD", True)
    # both complete at the last D: the longer is cut
    assert feed(["aDcD"], ("cD", "DcD")) == ("a", True)


# KVSNAP_STOP_EXAMPLES=20000 runs it harder (checked with seeds 1, 2, 3)
@settings(max_examples=int(os.environ.get("KVSNAP_STOP_EXAMPLES", "300")), deadline=None)
@given(
    text=st.text(alphabet="abcE ND", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    stops=st.lists(st.text(alphabet="abcEND", min_size=1, max_size=4), max_size=3),
)
@example(text="DcD", cuts=[2], stops=["c", "DcD"])  # failed at random before
@example(text="DcD", cuts=[], stops=["c", "DcD"])
def test_any_chunking_sends_what_one_scan_of_the_whole_text_sends(text, cuts, stops):
    """Where the detokenizer cuts the text never changes what the client receives: exactly the
    oracle's cut of the whole text (streaming and non-streaming alike)."""
    points = sorted({min(c, len(text)) for c in cuts})
    segments = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert feed(segments, tuple(stops)) == first_to_complete(text, stops)


# --- request output ----------------------------------------------------------------------


class LetterDetokenizer:
    """Token t is the letter chr(t); ``last_segment`` is the text added since it was last read."""

    def __init__(self):
        self.text, self.read = "", 0

    def add_token(self, token: int) -> None:
        self.text += chr(token)

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        seg, self.read = self.text[self.read :], len(self.text)
        return seg


def request_state(stop=()) -> tuple[RequestState, list]:
    events: list = []
    state = RequestState(
        id=1,
        request=GenerationRequest(tokens=[1, 2, 3], max_tokens=8, stop=tuple(stop)),
        on_event=lambda s, kind, payload: events.append((kind, payload)),
    )
    state.detok = LetterDetokenizer()
    return state, events


def test_tokens_stream_as_text_and_a_stop_string_ends_the_request_without_its_text():
    state, events = request_state(stop=("cd",))
    for t in "abc":
        deliver_token(state, ord(t), None)
    assert events == [("token", "a"), ("token", "b")]  # "c" is held: it may start "cd"
    deliver_token(state, ord("d"), None)
    assert events[-1] == ("done", None) and state.finish_reason == "stop" and state.text == "ab"
    deliver_token(state, ord("e"), None)  # a token after the finish sends nothing
    assert state.text == "ab" and state.completion_tokens == 5 and state.done.is_set()


def test_length_finish_releases_the_held_tail_and_eos_sends_no_text():
    state, events = request_state(stop=("xyz",))
    deliver_token(state, ord("a"), None)
    deliver_token(state, ord("x"), "length")
    assert state.text == "ax" and state.finish_reason == "length" and events[-1] == ("done", None)
    eos, eos_events = request_state()
    deliver_token(eos, ord("a"), None)
    deliver_token(eos, 0, "stop")  # the end-of-sequence token: its text is never added
    assert eos.text == "a" and eos_events == [("token", "a"), ("done", None)]


def test_a_request_finishes_once_but_an_error_still_reaches_the_client():
    state, events = request_state()
    finish_request(state, "cancelled")
    finish_request(state, "stop")
    assert state.finish_reason == "cancelled" and events == [("done", None)]
    finish_request(state, "error", "step failed")
    assert events[-1] == ("error", "step failed") and state.finish_reason == "error"


# --- accounting ----------------------------------------------------------------------------


class FakeGenerator:
    """mlx-lm 0.32's BatchGenerator as accounting sees it: a prompt token counter."""

    def __init__(self, prompt_tokens: int = 0):
        self._counters = SimpleNamespace(prompt_tokens=prompt_tokens)


def test_per_request_computed_is_prompt_minus_cached():
    accounts = TokenAccounts()
    state, _ = request_state()
    state.request.tokens = list(range(100))
    accounts.start_request(state, 60)
    assert (state.cached_tokens, state.computed_tokens) == (60, 40)
    assert (accounts.prompt, accounts.cached, accounts.started_requests) == (100, 60, 1)


def test_engine_wide_computed_adds_mlx_lm_counters_across_generators_and_the_engines_own_runs():
    accounts = TokenAccounts()
    old = FakeGenerator(prompt_tokens=5)  # counted before this engine attached it
    accounts.attach(old)
    old._counters.prompt_tokens += 39  # a 40-token suffix: all but its last token
    accounts.expect_batched(40)
    state, _ = request_state()
    accounts.first_decode(state)
    accounts.first_decode(state)  # counted once per request
    assert accounts.computed(old) == 39 + 1
    accounts.detach(old)  # dropped after a failed step: what it counted stays
    new = FakeGenerator(prompt_tokens=0)
    accounts.attach(new)
    new._counters.prompt_tokens += 10
    accounts.ran(7)  # a sequential chunk or a shared prefix
    assert accounts.computed(new) == 39 + 1 + 10 + 7 and accounts.computed(None) == 39 + 1 + 7
    assert accounts.as_dict(new)["computed_source"] == MEASURED


def test_without_mlx_lm_counter_the_engines_expectation_is_the_source():
    accounts = TokenAccounts()
    gen = object()
    assert prompt_counter(gen) is None
    accounts.attach(gen)
    accounts.expect_batched(40)
    accounts.ran(1)
    assert accounts.computed(gen) == 40 and accounts.as_dict(gen)["computed_source"] == COUNTED
    assert prompt_counter(SimpleNamespace(_prompt_tokens_counter=12)) == 12  # the older layout


def test_cache_stats_before_and_after_the_prefix_cache_exists():
    assert (
        cache_stats(None, 64.0)["entry_count"] == 0
        and cache_stats(None, 64.0)["max_memory_mb"] == 64.0
    )
    from kvsnap.runtime.cache.prefix import Entry, PrefixCache

    prefix = PrefixCache(max_bytes=10**9, copy_state=list, trim_state=lambda s, n: s)
    assert cache_stats(prefix, 1.0)["hit_rate"] == 0.0  # empty (and falsy), yet a real cache
    prefix.add(
        Entry(
            tokens=(1, 2),
            state=[1, 2],
            nbytes=2**20,
            trimmable=True,
            pinned=True,
            source="snapshot",
            resident=True,
        )
    )
    prefix.fetch([1, 2, 3])
    prefix.fetch([9])
    stats = cache_stats(prefix, 1.0)
    assert (
        stats["entry_count"],
        stats["hits"],
        stats["misses"],
        stats["hit_rate"],
        stats["tokens_saved"],
        stats["current_memory_mb"],
    ) == (1, 1, 1, 0.5, 2, 1.0)


# --- scheduling ----------------------------------------------------------------------------


def states(n: int, tenant: str = "") -> list[RequestState]:
    return [
        RequestState(
            id=i,
            request=GenerationRequest(tokens=[1] * (i + 1), max_tokens=1, tenant=tenant),
            on_event=lambda *a: None,
        )
        for i in range(1, n + 1)
    ]


def test_requests_start_in_arrival_order_up_to_the_batch_size():
    sched = Scheduler(max_batch_size=2)
    a, b, c = states(3)
    for s in (a, b, c):
        sched.submit(s)
    assert sched.next_batch() == [a, b]  # the peers whose shared prefix is computed once
    assert sched.next_to_admit() is a
    sched.activate(10, a)
    assert sched.next_to_admit() is b
    sched.activate(11, b)
    assert sched.next_to_admit() is None and sched.next_batch() == [] and sched.pending == [c]
    sched.release(10)
    assert sched.next_to_admit() is c and sched.max_batch_seen == 2


def test_sequential_requests_wait_until_nothing_runs():
    sched = Scheduler(max_batch_size=8)
    a, b = states(2)
    sched.submit(a)
    sched.submit(b)
    assert sched.next_sequential() is a
    sched.activate(-a.id, a)
    assert sched.next_sequential() is None
    sched.release(-a.id)
    assert sched.next_sequential() is b


def test_a_cancelled_request_leaves_the_queue_or_frees_its_slot():
    sched = Scheduler(max_batch_size=4)
    waiting, running, sequential = states(3)
    sched.submit(waiting)
    assert sched.withdraw(waiting) is None and sched.pending == []
    running.uid = 7
    sched.activate(7, running)
    assert sched.withdraw(running) == 7 and not sched.active
    sched.activate(-sequential.id, sequential)  # no uid: the sequential loop sees its finish
    assert sched.withdraw(sequential) is None


def test_take_all_empties_both_queues_and_rows_filter_by_tenant():
    sched = Scheduler(max_batch_size=4)
    mine, theirs = states(1, tenant="k1")[0], states(2, tenant="k2")[1]
    sched.activate(1, mine)
    sched.submit(theirs)
    assert [r["id"] for r in sched.rows("k1")] == [mine.id] and len(sched.rows()) == 2
    assert sched.busy and sched.take_all() == [mine, theirs] and not sched.busy


@pytest.mark.parametrize(
    ("continuous", "kv_bits", "batched"),
    [(True, None, True), (True, 8, False), (False, None, False)],
)
def test_quantized_kv_or_batching_off_runs_one_at_a_time(continuous, kv_bits, batched):
    assert uses_batching(continuous, kv_bits) is batched


# --- re-warm ---------------------------------------------------------------------------------


def test_a_clear_during_a_rewarm_is_coalesced_and_the_warm_set_comes_back_one_read_per_step():
    from kvsnap.runtime.cache.prefix import Entry, PrefixCache
    from kvsnap.runtime.warmup.rewarm import Rewarmer

    reads = []

    def loader(tokens):
        return lambda: (reads.append(tokens), (list(tokens), 1))[1]

    prefix = PrefixCache(max_bytes=10**6, copy_state=list, trim_state=lambda s, n: s)
    for tokens in ((1, 2), (3, 4)):
        prefix.add(
            Entry(
                tokens=tokens,
                state=list(tokens),
                nbytes=1,
                trimmable=True,
                pinned=True,
                source="snapshot",
                loader=loader(tokens),
                resident=True,
            )
        )
    prefix.add(
        Entry(
            tokens=(1, 2, 9),
            state=[1],
            nbytes=1,
            trimmable=True,
            pinned=False,
            source="request",
            namespace="",
        )
    )
    counts = SimpleNamespace(loaded=0, prefilled=0)
    rewarmer = Rewarmer()
    rewarmer.clear(prefix, lm=None, rewarm=True)  # snapshot-backed entries only: no model needed
    assert rewarmer.running and len(prefix) == 2 and not any(e.loaded for e in prefix.entries)
    prefix.add(
        Entry(
            tokens=(5, 5, 5),
            state=[5],
            nbytes=1,
            trimmable=True,
            pinned=False,
            source="request",
            namespace="",
        )
    )
    # coalesced: drops request prefixes again, no second job
    rewarmer.clear(prefix, lm=None, rewarm=True)
    assert (rewarmer.rewarms, rewarmer.coalesced, len(prefix)) == (1, 1, 2)
    rewarmer.step(prefix, counts)
    assert reads == [(1, 2)] and rewarmer.running  # one snapshot read per step
    rewarmer.step(prefix, counts)
    assert reads == [(1, 2), (3, 4)] and not rewarmer.running and counts.loaded == 2
    assert rewarmer.as_dict() == {
        "rewarms": 1,
        "rewarms_coalesced": 1,
        "rewarm_in_progress": False,
        "rewarm_error": "",
    }


def test_a_rewarm_drops_a_tenants_persisted_conversation_and_never_shares_it_issue_23():
    """A persisted conversation is backed by a file like a snapshot, but it is a request
    prefix of one namespace: a clear drops it (the DELETE removes its file too), and the
    re-warm must never put it back as a warm entry (namespace None: shared by everyone)."""
    from kvsnap.runtime.cache.prefix import Entry, PrefixCache
    from kvsnap.runtime.warmup.rewarm import Rewarmer

    prefix = PrefixCache(max_bytes=10**6, copy_state=list, trim_state=lambda s, n: s)
    prefix.add(
        Entry(
            tokens=(7, 8, 9),
            state=[7],
            nbytes=1,
            trimmable=True,
            pinned=False,
            source="persisted",
            loader=lambda: ([7], 1),
            namespace="tenant-a/",
        )
    )
    for rewarm in (True, False):
        rewarmer = Rewarmer()
        rewarmer.clear(prefix, lm=None, rewarm=rewarm)
        assert prefix.lookup((7, 8, 9, 10), "tenant-b/") is None
        assert prefix.entries == []
