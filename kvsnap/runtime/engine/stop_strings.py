"""Stop strings over streamed text: what may be sent now, what must be held back. No mlx here.

Text arrives in detokenizer segments, and a stop string can straddle two of them, so the
tail that could still grow into a stop string is held until the next segment decides.

Semantics (OpenAI's "stop generating further tokens"): generation stops as soon as any stop
string is complete, and the output ends right before it; when several complete at the same
character (one is a suffix of another), the longest is cut. On the whole text: among the
stop strings it contains, the one whose first occurrence ends first (ties: starts first).
That point does not depend on where the text was cut into segments, so streaming sends
exactly what a non-streaming request returns. (The earliest *start* in the
segment at hand is not that: 'DcD' as 'Dc' + 'D' with stops 'c' and 'DcD' stopped at 'c'
while one segment 'DcD' cut at 'DcD'.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopScan:
    send: str  # text that may go to the client now
    held: str  # the tail held back: it could still become a stop string
    stopped: bool  # a stop string was found; ``send`` ends right before it
    matched: str | None = None  # which one (Anthropic's ``stop_sequence`` names it)


def scan_stop_strings(held: str, segment: str, stops: Sequence[str], final: bool) -> StopScan:
    """Add ``segment`` to the ``held`` tail and cut before the first stop string to complete.

    ``final``: no more text follows, so nothing is held back. Empty stop strings are ignored.
    """
    text = held + segment
    stops = [s for s in stops if s]
    if not stops:
        return StopScan(text, "", False)
    # (end, start) of each stop string's first occurrence: the first to complete wins
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if hits:
        _, start, matched = min(hits)
        return StopScan(text[:start], "", True, matched)
    keep = 0 if final else min(max(len(s) - 1 for s in stops), len(text))
    return StopScan(text[: len(text) - keep], text[len(text) - keep :], False)
