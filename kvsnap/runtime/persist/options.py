"""``--persist-requests`` and its two settings checked once, for ``kvsnap serve`` and every
upstream route (each only maps its flags onto ``persist_options``), into ``PersistOptions``.
No mlx: a route checks its flags before anything loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvsnap.errors import UsageError

DEFAULT_MAX_GB = 20.0
DEFAULT_FLUSH_TIMEOUT_S = 5.0
# Bounds that keep byte counts integral and a shutdown finite (inf would overflow or never end).
MAX_PERSIST_GB = 2.0**20
MAX_FLUSH_TIMEOUT_S = 24 * 3600.0
# A conversation of 8k tokens of fp32 KV (1.9 GB) took 6-9 s from a local Redis on 2 busy
# cores (docs/benchmarks.md); past the budget a request prefills and the rate is learnt.
DEFAULT_TIER_BUDGET_S = 10.0


@dataclass
class TierOptions:
    spec: str  # redis://… or a folder
    budget_s: float = DEFAULT_TIER_BUDGET_S  # the most a request waits on the tier
    queue_bytes: int = 1 << 30  # write-behind bound
    failures_to_open: int = 3
    cooldown_s: float = 15.0
    index_limit: int = 512  # records kept per namespace in the tier's index


@dataclass
class PersistOptions:
    max_bytes: int = int(DEFAULT_MAX_GB * 2**30)
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S
    max_queued: int = 32
    shared_tier: TierOptions | None = None  # --shared-tier


def persist_options(
    on: bool,
    max_gb: float | None,
    flush_timeout_s: float | None,
    has_store: bool,
    conflicts: Sequence[str] = (),
) -> PersistOptions | None:
    """``--persist-requests`` and its settings (``--persist-max-gb``, ``--persist-flush-timeout``)
    as ``PersistOptions``, None when off. ``conflicts``: why persisting cannot work with each
    route option that is given (naming the option). Flags that contradict each other are a
    UsageError, the same for ``kvsnap serve`` and every upstream route."""
    if not on:
        for flag, value in (
            ("--persist-max-gb", max_gb),
            ("--persist-flush-timeout", flush_timeout_s),
        ):
            if value is not None:
                raise UsageError(
                    f"{flag} {value:g} needs --persist-requests; add it or drop {flag}"
                )
        return None
    for flag, value, unit, most in (
        ("--persist-max-gb", max_gb, "GB", MAX_PERSIST_GB),
        ("--persist-flush-timeout", flush_timeout_s, "seconds", MAX_FLUSH_TIMEOUT_S),
    ):
        # Checked here, not only by a route's parser: every route maps its flags onto this.
        if value is not None and not 0 < value <= most:
            raise UsageError(
                f"{flag} {value:g} must be a number of {unit} above 0 and at most {most:.0f}; "
                f"e.g. {flag} 5"
            )
    if not has_store:
        raise UsageError("--persist-requests needs a store to write into; add --kv-snapshots DIR")
    if conflicts:
        raise UsageError(f"--persist-requests {conflicts[0]}; drop one of the two")
    return PersistOptions(
        max_bytes=int((max_gb or DEFAULT_MAX_GB) * 2**30),
        flush_timeout_s=flush_timeout_s or DEFAULT_FLUSH_TIMEOUT_S,
    )
