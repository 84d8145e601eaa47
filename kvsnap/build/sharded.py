"""``kvsnap build`` under ``mlx.launch``: a model one machine cannot hold, prefilled across ranks.

Rank 0 runs the build as one process would (plan, keys, store, manifest) and is the store's
only writer; every other rank only follows its prefills. Each prefill is announced by rank 0
(tokens, block ends, the ends where a checkpoint is captured), run by every rank on its slice,
and gathered into the logical state (``runtime.sharding.gather``), which rank 0 writes: the
same keys and, within float tolerance, the same tensors as a single-process build.

A sharded build prefills a changed entry from its first token (a single-process build
restores the longest prefix the store holds): a restored prefix would have to be cut into
every rank's slice first, and the store lives with rank 0 only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.prefill.chunked import prefill_in_blocks
from kvsnap.runtime.sharding.gather import gather_state
from kvsnap.runtime.sharding.ranks import RankGroup
from kvsnap.snapshot.codec import decode_cache
from kvsnap.snapshot.shard_view import ShardView

log = logging.getLogger("kvsnap.build")

DONE = "done"
PREFILL = "prefill"


def logical_cache(state: list, tokens: Sequence[int], view: ShardView, ranks: RankGroup) -> list:
    """The whole-model cache after ``tokens`` from every rank's slice (a collective)."""
    arrays, layers = gather_state(state, tokens, view, ranks)
    return decode_cache(arrays, layers)


def run_prefill(
    lm: LoadedModel,
    view: ShardView,
    ranks: RankGroup,
    order: dict,
    on_end: Callable[[int, list], None] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> list:
    """One announced prefill on this rank's slice; at each gathered end and at the last token the
    logical state is gathered (``on_end`` gets it there). Returns the logical cache."""
    tokens = list(order["tokens"])
    gather_at = set(order["gather_at"])

    def at_end(end: int, state: list) -> None:
        if end in gather_at:
            full = logical_cache(state, tokens[:end], view, ranks)
            if on_end is not None:
                on_end(end, full)

    cache = prefill_in_blocks(lm, tokens, order["ends"], None, 0, at_end, on_tokens)
    return logical_cache(cache, tokens, view, ranks)


@dataclass
class ShardedPrefill:
    """Rank 0's prefill for the build pipeline: announced to the other ranks, run by all."""

    lm: LoadedModel
    view: ShardView
    ranks: RankGroup
    # A restored prefix would need cutting into every rank's slice: each entry starts at 0.
    restores = False

    def __call__(
        self,
        lm: LoadedModel,
        tokens: Sequence[int],
        ends: Sequence[int],
        cache: list | None,
        start: int,
        on_end: Callable[[int, list], None] | None,
        on_tokens: Callable[[int], None] | None,
        gather_at: frozenset = frozenset(),
    ) -> list:
        if cache is not None or start:
            raise ValueError("a sharded build prefills every entry from its first token")
        order = {"op": PREFILL, "tokens": list(tokens), "ends": list(ends)}
        order["gather_at"] = sorted(gather_at)
        self.ranks.from_rank0(order)
        return run_prefill(self.lm, self.view, self.ranks, order, on_end, on_tokens)

    def finish(self) -> None:
        """Tell the other ranks the build is over (they then exit)."""
        self.ranks.from_rank0({"op": DONE})


def follow(lm: LoadedModel, view: ShardView, ranks: RankGroup) -> int:
    """A rank other than 0: run every prefill rank 0 announces, until it says the build is done."""
    prefills = 0
    while True:
        order: Any = ranks.from_rank0(None)
        if order["op"] == DONE:
            log.info("[kvsnap] %s: %d prefills done", view.describe(), prefills)
            return 0
        run_prefill(lm, view, ranks, order)
        prefills += 1
