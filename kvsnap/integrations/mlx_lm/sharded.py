"""mlx_lm.server sharded over several processes (``mlx.launch``), warm from one store.

Every rank runs the same generation loop on its slice of the model, so every rank must hold
the same warm entries: a hit on one rank and a miss on another is a collective that never
completes, or a wrong answer. So each rank reads only its slice of each snapshot
(``store.shard_read``), the ranks then agree entry by entry (an entry any rank cannot use is
skipped on every rank, and rank 0 says which rank and file, once), and a state prefilled
here is gathered from all ranks into the logical state and written once per store folder (one
writer per file: the lowest rank that sees the folder). Keys never depend on the topology.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvsnap.errors import UsageError
from kvsnap.integrations.common.warm_plan import StateSource, check_shapes
from kvsnap.runtime.sharding.ranks import RankGroup
from kvsnap.snapshot.shard_view import ShardView
from kvsnap.store.shard_read import ReadMeter, load_shard_state

if TYPE_CHECKING:
    from kvsnap.key import ModelIdentity
    from kvsnap.runtime.cache.shapes import ModelShapes
    from kvsnap.store.local import SnapshotInfo, Store

log = logging.getLogger("kvsnap.mlx_lm")


@dataclass
class ShardedSource(StateSource):
    """A rank's ``StateSource``: its slice read, every entry agreed, the logical state written by
    one rank per store folder."""

    ranks: RankGroup
    view: ShardView
    meter: ReadMeter = field(default_factory=ReadMeter)
    # set by ``elect_writers``: whether this rank writes prefilled entries to its folder
    writes: bool = False
    # every agreement's refusals: (rank, file, reason), rank 0's log says each once
    refused: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def quiet(self) -> bool:
        return self.ranks.rank != 0

    def begin(self, keys: list[str]) -> None:
        everyone = self.ranks.gather_json(keys)
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise UsageError(
                    f"rank {rank} would warm other entries than rank 0 ({len(theirs)} keys "
                    f"against {len(everyone[0])}, first difference at "
                    f"{_first_difference(theirs, everyone[0])}): give every host the same "
                    "--warm-prompts file, model folder and mlx-lm"
                )

    def candidates(self, keys: list[str]) -> list[str]:
        # Rank 0's store decides; a key another host lacks is then refused there, by name.
        return self.ranks.from_rank0(keys)

    def load(
        self, store: Store, info: SnapshotInfo, identity: ModelIdentity, shapes: ModelShapes
    ) -> list:
        from kvsnap.snapshot.codec import decode_cache

        # Under tensor parallelism the rank's own shapes say which tensors it splits or keeps.
        local = {n: shape for n, (shape, _) in shapes.expected().items()}
        arrays, layers = load_shard_state(store, info, identity, self.view, self.meter, local)
        check_shapes(arrays, shapes, str(info.path))
        return decode_cache(arrays, layers)

    def agree(self, loaded: list[SnapshotInfo | None], reasons: list[str | None]) -> list[bool]:
        mine = [
            None if reason is None and info is not None else [_where(info), reason or "missing"]
            for info, reason in zip(loaded, reasons)
        ]
        everyone = self.ranks.gather_json(mine)
        verdict = []
        for i in range(len(loaded)):
            refusals = [(rank, *theirs[i]) for rank, theirs in enumerate(everyone) if theirs[i]]
            usable_somewhere = any(theirs[i] is None for theirs in everyone)
            if refusals and usable_somewhere:
                # Some ranks could use it: skipped everywhere, said once, by rank 0.
                for rank, where, reason in refusals:
                    self.refused.append((rank, where, reason))
                    if self.ranks.rank == 0:
                        log.warning(
                            "[kvsnap] rank %d cannot use snapshot %s (%s): skipped on every rank",
                            rank,
                            where,
                            reason,
                        )
            verdict.append(not refusals)
        return verdict

    def logical(self, state: list, tokens: tuple) -> list:
        from kvsnap.runtime.sharding.gather import gather_state
        from kvsnap.snapshot.codec import decode_cache

        arrays, layers = gather_state(state, tokens, self.view, self.ranks)
        return decode_cache(arrays, layers)


def _where(info: SnapshotInfo | None) -> str:
    return str(info.path) if info is not None else "(none on this host)"


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {i}: {x} against {y}"
    return f"entry {min(len(a), len(b))}"


__all__ = ["ShardedSource"]
