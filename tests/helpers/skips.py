"""tests/allowed_skips.txt: which skips CI accepts (tests/conftest.py fails every other one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ALLOWED_SKIPS = Path(__file__).resolve().parents[1] / "allowed_skips.txt"


def in_ci(environ=os.environ) -> bool:
    return environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def read_allowed_skips(path: Path = ALLOWED_SKIPS) -> list[tuple[str, str]]:
    """(node id, reason fragment) pairs from lines ``NODE_ID | REASON FRAGMENT``; ``#`` starts a
    comment."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        node, sep, reason = (part.strip() for part in line.partition(" | "))
        if not (sep and node and reason):
            raise pytest.UsageError(
                f"{path}:{number}: {line!r} is not 'NODE_ID | REASON FRAGMENT'; fix the line"
            )
        entries.append((node, reason))
    return entries


def skip_allowed(nodeid: str, reason: str, entries: list[tuple[str, str]]) -> bool:
    """A node id matches itself and its parametrized variants; the reason must contain the
    fragment."""
    return any(
        (nodeid == node or nodeid.startswith(node + "[")) and fragment in reason
        for node, fragment in entries
    )
