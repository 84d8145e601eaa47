"""What ``ls``, ``verify`` and ``gc`` say and do about persisted conversations (records in
``conversations/``, written by ``kvsnap serve --persist-requests``): kept apart from the
agents, summarised rather than listed (there may be thousands, and they are users' data)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
from typing import Callable

from kvsnap.commands.common import human_bytes

# A conversation is no build's: the default "rebuild it" does not apply.
CONVERSATION_FIX = (
    "delete {record} (that conversation's next turn prefills), then `kvsnap gc {store} --yes`"
)
# Nor is a block or checkpoint no agent reaches: a conversation's next writes rewrite a block
# (any later turn reaches it); a checkpoint is its record's own end, so only deleting helps.
CONVERSATION_PART_FIX = (
    "no agent reaches it, so `kvsnap build` cannot rebuild it: {rewrite}delete {record} and the "
    "other records listed with it (their next turns prefill), then `kvsnap gc {store} --yes`"
)
BLOCK_REWRITE = (
    "a server with --persist-requests rewrites it as a conversation reaching it goes on; or "
)
DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# (line, entry): a line of text output and, when it is about one file, its --json entry
Say = Callable[..., None]


def duration(text: str) -> float:
    """``30m``, ``12h``, ``7d``, ``2w`` (or seconds: ``90s``) as seconds, for argparse."""
    m = DURATION_RE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; give a number and a unit: 90s, 30m, 12h, 7d or 2w"
        )
    return float(m.group(1)) * UNIT_S[m.group(2)]


def _when(ts: float | None) -> str | None:
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def summary(store) -> dict:
    """Count, bytes (records and the parts only they reach), oldest and newest use."""
    from kvsnap.store.conversation_space import conversation_stats

    stats = conversation_stats(store)
    return {
        "count": stats.count,
        "bytes": stats.nbytes,
        "oldest_use": _when(stats.oldest_use),
        "newest_use": _when(stats.newest_use),
    }


def summary_line(store) -> str | None:
    s = summary(store)
    if not s["count"]:
        return None
    return (
        f"conversations: {s['count']} persisted, {human_bytes(s['bytes'])} of their own, "
        f"last used {s['oldest_use']} .. {s['newest_use']}"
    )


def print_line(line: str, entry: dict | None = None) -> None:
    print(line)


def verify_conversations(
    store, expected, check_shapes, say: Say = print_line
) -> tuple[int, int, int]:
    """Every conversation record and the parts it reaches, fully checked; says the bad ones
    (and those for another model) and returns (ok, bad, other). A record gone since the
    listing was superseded or evicted by a server writing meanwhile: not bad, not counted.
    ``say(line, entry)``: a line and, for one record, what ``verify --json`` lists."""
    from kvsnap.errors import SnapshotError
    from kvsnap.store.conversations import conversation_files
    from kvsnap.store.foreign import foreign_reason

    ok = bad = other = 0
    agent_parts: set[str] | None = None
    for path in conversation_files(store.root):
        try:
            info = store.verify_file(path)
            foreign = foreign_reason(expected, info)
            if foreign:
                other += 1
                say(
                    f"other conversations/{path.name}: {foreign}",
                    {"status": "other", "file": f"conversations/{path.name}", "reason": foreign},
                )
                continue
            if check_shapes is not None:
                check_shapes(info)
            ok += 1
        except SnapshotError as exc:
            if not os.path.lexists(path):
                continue
            bad += 1
            if agent_parts is None:
                agent_parts = _agent_parts(store)
            fix = _fix(store, exc, path, agent_parts)
            say(
                f"BAD  {exc.path}: {exc.reason}; {fix}",
                {"status": "bad", "file": str(exc.path), "reason": exc.reason, "fix": fix},
            )
    if ok:
        say(f"ok   {ok} persisted conversation(s)")
    return ok, bad, other


def _agent_parts(store) -> set[str]:
    """The blocks and checkpoints the agents' sound records reach (a build rebuilds those)."""
    from kvsnap.store.paths import reached_parts

    return reached_parts(store.scan()[0])


def _fix(store, exc, record, agent_parts: set[str]) -> str:
    """What mends a conversation record ``exc`` found bad (its own file or a part of it)."""
    from kvsnap.errors import SnapshotError
    from kvsnap.snapshot.format import BLOCK_KIND
    from kvsnap.store.paths import FIX, part_of_path, part_relpath

    if exc.fix == SnapshotError("", "").fix:  # the default hint, an agent's
        return CONVERSATION_FIX.format(record=record, store=store.root)
    part = part_of_path(store, exc.path)
    if exc.fix == FIX and part is not None and part_relpath(*part) not in agent_parts:
        rewrite = BLOCK_REWRITE if part[0] == BLOCK_KIND else ""
        return CONVERSATION_PART_FIX.format(rewrite=rewrite, record=record, store=store.root)
    return exc.fix  # an agent's part too: a build rebuilds it


def gc_conversations(
    store, unused_for: float, apply: bool, say: Say = print_line
) -> tuple[int, int]:
    """Conversations unused for ``unused_for`` seconds: removed (``apply``) or listed; returns
    (records, bytes)."""
    from kvsnap.store.conversation_space import drop_unused

    paths, nbytes = drop_unused(store, unused_for, apply)
    verb = "removed" if apply else "would remove"
    for p in paths:
        say(f"{verb} {p} (conversation unused for over {unused_for:g}s)", {"file": str(p)})
    return len(paths), nbytes
