"""Which slice of a model this rank runs, and the logical (unsharded) model's cache layout.

mlx-lm shards a model in place: ``model.shard(group)`` splits every attention layer's heads
(tensor parallel), ``model.model.pipeline(group)`` keeps a run of layers (pipeline parallel,
rank 0 the last ones). A rank's own cache then describes only its slice, so the identity a
snapshot is keyed by is taken from the logical model (loaded lazily: no weights are read), and
keys do not depend on the topology.
"""

from __future__ import annotations

from pathlib import Path
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


def logical_layout(model_dir: Path, max_kv_size: int | None = None) -> tuple[str, ...]:
    """The cache classes of the whole model, one per layer, as one process would build them."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir), lazy=True, strict=False)
    return tuple(type(c).__name__ for c in make_prompt_cache(model, max_kv_size=max_kv_size))


def load_shard(model_dir: Path, mode: str) -> tuple[Any, Any]:
    """This rank's slice of the model and the tokenizer, as mlx-lm's ``sharded_load`` makes them
    (``mode`` "tensor" or "pipeline"; a pipeline load reads ``model.safetensors.index.json``).
    A model mlx-lm cannot shard that way raises its ValueError."""
    import mlx.core as mx
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    if mode == PIPELINE and not (Path(model_dir) / "model.safetensors.index.json").is_file():
        raise ValueError(
            "a pipeline-parallel load needs model.safetensors.index.json beside the weights "
            "(mlx_lm.convert writes it)"
        )
    model, tokenizer = sharded_load(
        str(model_dir),
        pipeline_group=group if mode == PIPELINE else None,
        tensor_group=group if mode == TENSOR else None,
    )
    return model, tokenizer
