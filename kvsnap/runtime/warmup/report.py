"""What a warm-up did, as data and as its log line: the snapshot counts of ``/v1/status``
(``snapshots``) and the warm-up report (``warmup``), shared by ``kvsnap serve``, the vllm-mlx
route and the quickstart. No mlx, no store: only counting and wording."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

# The warm-up's own logger name, so a rejection is logged under the same source as before the split.
log = logging.getLogger("kvsnap.runtime.warmup.run")


@dataclass
class SnapshotCounts:
    indexed: int = 0
    loaded: int = 0
    prefilled: int = 0
    written: int = 0
    rejected: list[dict] = field(default_factory=list)
    write_back: bool = False
    write_back_note: str = ""

    def reject(self, path: str, reason: str) -> None:
        item = {"file": path, "reason": reason}
        if item in self.rejected:
            return
        self.rejected.append(item)
        log.warning("[kvsnap] rejected snapshot %s: %s; falling back to prefill", path, reason)

    def begin_warmup(self) -> None:
        """loaded / prefilled / written add up over re-warms (a re-warm shows as a rise in
        ``loaded``); ``indexed`` is the latest warm-up's; a rejection is listed once."""
        self.indexed = 0

    def as_dict(self) -> dict:
        return {
            "indexed": self.indexed,
            "loaded": self.loaded,
            "prefilled": self.prefilled,
            "written": self.written,
            "rejected": len(self.rejected),
            "rejected_reasons": list(self.rejected),
            "write_back": self.write_back,
            "write_back_note": self.write_back_note,
        }


def warmup_line(report) -> str:
    """The warm-up's log line, in the original warm-prompts wording (kvsnap serve and the
    vllm-mlx route)."""
    return (
        f"[lifespan] Warm-up done (strict-prefix): {report.completed} completed, "
        f"{report.skipped} skipped, {report.prompt_tokens} prompt tokens in {report.seconds:.2f}s "
        f"({report.from_snapshots} from snapshots, {report.prefilled} prefilled)"
    )


@dataclass
class WarmupReport:
    completed: int = 0
    skipped: int = 0
    from_snapshots: int = 0
    prefilled: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    prefill_concurrency: int = 1  # the configured bound
    max_inflight_prefills: int = 0  # the most warm prompts actually prefilled at once
    over_budget: int = 0  # prefilled but not kept in memory: the cache budget was full
    # warm prompts whose prefix tokens came from their snapshot's recorded recipe
    recipes_reused: int = 0
    prefetch_seconds: float = 0.0  # reading the pinned snapshots, overlapped with the model load
    problems: list[str] = field(default_factory=list)

    def summary(self, counts: SnapshotCounts) -> str:
        why = ""
        if counts.rejected:
            named = (f"{Path(r['file']).name}: {r['reason']}" for r in counts.rejected[:3])
            why = f"; {len(counts.rejected)} snapshot(s) rejected ({'; '.join(named)})"
        if self.problems:
            why += f"; {len(self.problems)} warm prompt(s) invalid"
        if self.over_budget and counts.write_back:
            why += f"; {self.over_budget} over the cache budget (indexed, load on first hit)"
        elif self.over_budget:
            why += f"; {self.over_budget} over the cache budget and not kept"
        return warmup_line(self) + why
