"""Loading an mlx-lm model (a local folder or a resolved hub id) and describing the cache it
builds."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvsnap.blas import preload_openblas
from kvsnap.errors import ModelError
from kvsnap.key import DigestCache, KVSettings, ModelIdentity, model_identity, read_config
from kvsnap.runtime.model.source import (
    ResolvedModel,
    check_model_dir,
    hub_snapshot_origin,
    resolve_model,
)

__all__ = [
    "LoadedModel",
    "ResolvedModel",
    "check_model_dir",
    "load_model",
    "resolve_model",
    "default_digest_cache",
]


@dataclass
class LoadedModel:
    path: Path
    model: Any
    tokenizer: Any
    config: dict
    settings: KVSettings
    # A rank of a sharded model: the whole model's layout, which its own cache only covers a
    # slice of (``runtime.model.sharded``); keys never depend on the topology.
    logical_layout: tuple[str, ...] | None = None

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model, max_kv_size=self.settings.max_kv_size)

    @property
    def layout(self) -> tuple[str, ...]:
        if self.logical_layout is not None:
            return self.logical_layout
        return tuple(type(c).__name__ for c in self.make_cache())

    @property
    def kv_dtype(self) -> str:
        """The dtype activations (and so the KV) take: the commonest floating parameter dtype."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        counts: Counter[str] = Counter()
        # typed as a list or a dict: without ``destination`` it is a list of (name, array)
        params = cast(list[tuple[str, Any]], tree_flatten(self.model.parameters()))
        for _, v in params:
            if mx.issubdtype(v.dtype, mx.floating):
                counts[str(v.dtype).replace("mlx.core.", "")] += v.size
        return counts.most_common(1)[0][0] if counts else "float32"

    def identity(self, digests: DigestCache | None = None) -> ModelIdentity:
        return model_identity(self.path, self.kv_dtype, self.layout, self.settings, digests)

    def origin_fields(self) -> dict:
        """Hub repo id and commit when the folder is a Hugging Face cache snapshot: recorded for
        people, not keyed."""
        return ResolvedModel(self.path, *hub_snapshot_origin(self.path)).recorded_fields()


def check_kv_settings(config: dict, settings: KVSettings) -> None:
    """KV quantization groups run along the head dim: the group size must divide it."""
    if settings.kv_bits is None:
        return
    text = config.get("text_config") or config
    head_dim = text.get("head_dim") or (
        text.get("hidden_size", 0) // max(1, text.get("num_attention_heads", 1))
    )
    if head_dim and head_dim % settings.kv_group_size:
        divisors = [g for g in (32, 64, 128) if head_dim % g == 0]
        raise ModelError(
            f"--kv-group-size {settings.kv_group_size} does not divide this model's head dim "
            f"{head_dim}; "
            f"use --kv-group-size {divisors[-1] if divisors else 'a divisor of ' + str(head_dim)}"
        )


def load_model(
    model_ref: str | os.PathLike | ResolvedModel,
    settings: KVSettings = KVSettings(),
    revision: str | None = None,
    shard: str | None = None,
    lazy: bool = False,
) -> LoadedModel:
    """Load model and tokenizer from a local folder or a hub id (resolved first; see
    ``runtime.model.source``). ``shard`` ("tensor" or "pipeline"), under ``mlx.launch``: this
    rank's slice, as mlx-lm's ``sharded_load`` makes it (a collective: every rank loads).
    ``lazy``: the weights are mapped, not read (mlx-lm's ``lazy``; a file's header and sizes
    are still checked); their first evaluation reads them."""
    source = (
        model_ref if isinstance(model_ref, ResolvedModel) else resolve_model(model_ref, revision)
    )
    model_dir = source.path
    config = read_config(model_dir)
    check_kv_settings(config, settings)
    preload_openblas()
    from mlx_lm import load

    logical = None
    try:
        if shard is None:
            # A folder that exists: mlx-lm loads it as is and never asks the hub.
            model, tokenizer = load(str(model_dir), lazy=lazy)[:2]
        else:
            from kvsnap.runtime.model.sharded import load_shard, logical_layout

            model, tokenizer = load_shard(model_dir, shard)
            logical = logical_layout(model_dir, settings.max_kv_size)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise ModelError(
            f"{model_dir}: mlx-lm cannot load this model ({exc}); check that it is a complete "
            f"mlx-lm model directory"
        ) from exc
    lm = LoadedModel(
        path=model_dir,
        model=model,
        tokenizer=tokenizer,
        config=config,
        settings=settings,
        logical_layout=logical,
    )
    check_cache_classes(lm)
    check_kv_quantizable(lm)
    return lm


def check_kv_quantizable(lm: LoadedModel) -> None:
    """With ``--kv-bits``, refuse at load a cache layer mlx-lm cannot quantize (a sliding
    window's RotatingKVCache): mlx-lm converts each layer once a prompt reaches the start, and
    such a layer fails every request (and build) that gets there."""
    s = lm.settings
    if s.kv_bits is None:
        return
    for i, layer in enumerate(lm.make_cache()):
        if not hasattr(layer, "to_quantized"):
            continue  # mlx-lm leaves it as is (an SSM state, a cache list)
        try:
            layer.to_quantized(group_size=s.kv_group_size, bits=s.kv_bits)
        except NotImplementedError:
            window = " (the sliding window of --max-kv-size)" if s.max_kv_size else ""
            raise ModelError(
                f"{lm.path}: --kv-bits {s.kv_bits}: cache layer {i} is a "
                f"{type(layer).__name__}{window}, which mlx-lm cannot quantize; drop --kv-bits"
                + (" or --max-kv-size" if s.max_kv_size else "")
                + " (build and serve must agree)"
            ) from None


def check_cache_classes(lm: LoadedModel) -> None:
    """Refuse at load a model whose cache holds a class kvsnap cannot store, copy or trim,
    instead of failing on its first snapshot or request."""
    from kvsnap.snapshot.cache_classes import UnknownCacheClass, cache_class

    def walk(layers, where: str) -> None:
        for i, layer in enumerate(layers):
            cache_class(type(layer).__name__, f"{where}[{i}]", str(lm.path))
            if type(layer).__name__ == "CacheList":
                walk(layer.caches, f"{where}[{i}].caches")

    try:
        walk(lm.make_cache(), "cache layer")
    except UnknownCacheClass as exc:
        raise ModelError(f"{lm.path}: {exc.reason}; {exc.fix}") from None


def default_digest_cache() -> DigestCache:
    from kvsnap.key import default_cache_dir

    return DigestCache(default_cache_dir() / "file-digests.json")
