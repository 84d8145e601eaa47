"""Which slice of a model this rank runs.

mlx-lm shards a model in place: ``model.shard(group)`` splits every attention layer's heads
(tensor parallel), ``model.model.pipeline(group)`` keeps a run of layers (pipeline parallel,
rank 0 the last ones). A rank's own cache then describes only its slice; the logical model's
layout, which keys are taken from, is loaded by ``runtime.model.sharded``.
"""

from __future__ import annotations

from typing import Any

from kvsnap.runtime.sharding.ranks import RankGroup
from kvsnap.snapshot.shard_view import PIPELINE, TENSOR, ShardView


def pipeline_stage(model: Any) -> Any | None:
    """The module mlx-lm's ``pipeline`` split (it has ``start_idx``/``end_idx``), or None."""
    for _, module in model.named_modules():
        if getattr(module, "pipeline_size", 1) > 1 and hasattr(module, "start_idx"):
            return module
    return None


def shard_view_of(model: Any, ranks: RankGroup) -> ShardView | None:
    """This rank's slice of ``model`` as mlx-lm sharded it; None on one process."""
    if not ranks.sharded:
        return None
    stage = pipeline_stage(model)
    if stage is not None:
        return ShardView(PIPELINE, ranks.rank, ranks.size, stage.start_idx, stage.end_idx)
    return ShardView(TENSOR, ranks.rank, ranks.size)
