"""Stop strings over streamed text: what may be sent now, what must be held back. No mlx here.

Text arrives in detokenizer segments, and a stop string can straddle two of them, so the
tail that could still grow into a stop string is held until the next segment decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StopScan:
    send: str  # text that may go to the client now
    held: str  # the tail held back: it could still become a stop string
    stopped: bool  # a stop string was found; ``send`` ends right before it


def scan_stop_strings(held: str, segment: str, stops: Sequence[str], final: bool) -> StopScan:
    """Add ``segment`` to the ``held`` tail and cut at the earliest stop string.

    ``final``: no more text follows, so nothing is held back. Empty stop strings are ignored.
    """
    text = held + segment
    stops = [s for s in stops if s]
    if not stops:
        return StopScan(text, "", False)
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        return StopScan(text[: min(hits)], "", True)
    keep = 0 if final else min(max(len(s) - 1 for s in stops), len(text))
    return StopScan(text[: len(text) - keep], text[len(text) - keep :], False)
