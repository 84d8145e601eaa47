"""A model sharded by ``mlx.launch``, loaded: this rank's slice of it, and the logical (unsharded)
model's cache layout that keys are taken from, so keys do not depend on the topology.

Loading lives with the model; which rank holds which slice, and the collectives between ranks,
live in ``runtime.sharding``, which the model never needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsnap.snapshot.shard_view import PIPELINE, TENSOR


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
