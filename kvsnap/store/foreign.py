"""Which model a stored record belongs to: records of another model or KV setting are named
as such, field by field, and kept apart from this model's (never used, never "bad")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsnap.errors import SnapshotError
from kvsnap.key import ModelIdentity
from kvsnap.snapshot.header import SnapshotInfo


@dataclass
class Problem:
    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def identity_mismatch(expected: ModelIdentity, found: dict) -> str:
    """Which identity fields differ, in words, for 'built for another model' messages."""
    mine = expected.as_dict()
    fields = [k for k in sorted(set(mine) | set(found)) if mine.get(k) != found.get(k)]
    return ", ".join(fields) or "nothing"


FOREIGN_FIX = "rebuild it for this model, or run `kvsnap gc` to drop it"


def foreign_reason(expected: ModelIdentity | None, info: SnapshotInfo) -> str | None:
    """None if the snapshot was built for ``expected`` (or nothing is expected); else why not,
    field by field."""
    if expected is None or info.model_digest == expected.digest:
        return None
    return (
        f"built for another model or KV setting (differs in: "
        f"{identity_mismatch(expected, info.model)})"
    )


def require_model(info: SnapshotInfo, expected: ModelIdentity | None) -> None:
    """SnapshotError (the file, the differing fields, the fix) unless the snapshot is
    ``expected``'s."""
    reason = foreign_reason(expected, info)
    if reason:
        raise SnapshotError(str(info.path), reason, FOREIGN_FIX)


def classify(
    infos: list[SnapshotInfo], expected: ModelIdentity | None
) -> tuple[list[SnapshotInfo], list[Problem]]:
    """Split indexed snapshots into this model's and foreign ones (problems), when ``expected`` is
    given."""
    if expected is None:
        return list(infos), []
    good, foreign = [], []
    for info in infos:
        reason = foreign_reason(expected, info)
        if reason:
            foreign.append(Problem(info.path, reason))
        else:
            good.append(info)
    return good, foreign
