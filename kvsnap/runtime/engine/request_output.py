"""A request's output: tokens to text through its detokenizer, stop strings, the end events.

No engine state here, only the request's own (``RequestState``), so the engine's batched
and sequential paths deliver text the same way and tests drive it without a model.
"""

from __future__ import annotations

import time

from kvsnap.runtime.engine.stop_strings import scan_stop_strings
from kvsnap.runtime.engine.types import RequestState, TokenLogprob


def deliver_token(
    state: RequestState,
    token: int,
    finish_reason: str | None,
    logprob: TokenLogprob | None = None,
) -> None:
    """One generated token: its text (up to a stop string) goes out; the request ends on
    ``finish_reason`` ("stop": an end-of-sequence token, whose text is not sent). Its
    ``logprob``, when asked for, is kept before the text goes out, so a streamed chunk finds
    its tokens' entries."""
    if state.t_first_token is None:
        state.t_first_token = time.perf_counter()
    state.completion_tokens += 1
    if logprob is not None and state.finish_reason is None:
        state.logprobs.append(logprob)
    if finish_reason == "stop":
        state.detok.finalize()
        emit_text(state, state.detok.last_segment, final=True)
        finish_request(state, "stop")
        return
    state.detok.add_token(token)
    emit_text(state, state.detok.last_segment, final=False)
    if state.finish_reason is None and finish_reason is not None:
        state.detok.finalize()
        emit_text(state, state.detok.last_segment, final=True)
        finish_request(state, finish_reason)


def emit_text(state: RequestState, segment: str, final: bool) -> None:
    """Send text, holding back a tail that could still become a stop string."""
    if state.finish_reason is not None:
        return
    if not state.request.stop and not state.held_text:  # no stop strings: nothing to scan
        _send(state, segment)
        return
    scan = scan_stop_strings(state.held_text, segment, state.request.stop, final)
    state.held_text = scan.held
    _send(state, scan.send)
    if scan.stopped:
        state.stop_sequence = scan.matched
        finish_request(state, "stop")


def finish_request(state: RequestState, reason: str, error: str | None = None) -> None:
    """End the request once (an error may still follow a finish); held text goes out first."""
    if state.finish_reason is not None and reason != "error":
        return
    if state.held_text and reason != "error":
        _send(state, state.held_text)
        state.held_text = ""
    state.finish_reason = reason
    state.t_done = time.perf_counter()
    state.on_event(state, "error" if reason == "error" else "done", error)
    state.done.set()


def _send(state: RequestState, text: str) -> None:
    if text:
        state.text += text
        state.on_event(state, "token", text)
