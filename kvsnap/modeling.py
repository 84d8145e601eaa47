"""Loading an mlx-lm model offline and describing the cache it builds."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .blas import preload_openblas
from .errors import ModelError
from .key import DigestCache, KVSettings, ModelIdentity, model_identity, read_config


def check_model_dir(path: str | os.PathLike) -> Path:
    """A local model directory; mlx-lm would take a missing path for a hub repo id and download it."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model directory {str(path)!r} does not exist; give a local mlx-lm model directory (make one with `kvsnap demo-model DIR`)")
    if not p.is_dir():
        raise ModelError(f"model {str(path)!r} is a file, not a directory; give the folder holding config.json and *.safetensors")
    if not (p / "config.json").is_file():
        raise ModelError(f"{p}: no config.json; give an mlx-lm model directory (make one with `kvsnap demo-model DIR`)")
    return p.resolve()


@dataclass
class LoadedModel:
    path: Path
    model: Any
    tokenizer: Any
    config: dict
    settings: KVSettings

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model, max_kv_size=self.settings.max_kv_size)

    @property
    def layout(self) -> tuple[str, ...]:
        return tuple(type(c).__name__ for c in self.make_cache())

    @property
    def kv_dtype(self) -> str:
        """The dtype activations (and so the KV) take: the commonest floating parameter dtype."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        counts: Counter = Counter()
        for _, v in tree_flatten(self.model.parameters()):
            if mx.issubdtype(v.dtype, mx.floating):
                counts[str(v.dtype).replace("mlx.core.", "")] += v.size
        return counts.most_common(1)[0][0] if counts else "float32"

    def identity(self, digests: DigestCache | None = None) -> ModelIdentity:
        return model_identity(self.path, self.kv_dtype, self.layout, self.settings, digests)


def check_kv_settings(config: dict, settings: KVSettings) -> None:
    """KV quantization groups run along the head dim: the group size must divide it."""
    if settings.kv_bits is None:
        return
    text = config.get("text_config") or config
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // max(1, text.get("num_attention_heads", 1)))
    if head_dim and head_dim % settings.kv_group_size:
        divisors = [g for g in (32, 64, 128) if head_dim % g == 0]
        raise ModelError(
            f"--kv-group-size {settings.kv_group_size} does not divide this model's head dim {head_dim}; "
            f"use --kv-group-size {divisors[-1] if divisors else 'a divisor of ' + str(head_dim)}"
        )


def load_model(path: str | os.PathLike, settings: KVSettings = KVSettings()) -> LoadedModel:
    """Load model and tokenizer from a local directory, never from a hub."""
    model_dir = check_model_dir(path)
    config = read_config(model_dir)
    check_kv_settings(config, settings)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    preload_openblas()
    from mlx_lm import load

    try:
        model, tokenizer = load(str(model_dir))
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise ModelError(f"{model_dir}: mlx-lm cannot load this model ({exc}); check that it is a complete mlx-lm model directory") from exc
    return LoadedModel(path=model_dir, model=model, tokenizer=tokenizer, config=config, settings=settings)


def default_digest_cache() -> DigestCache:
    from .key import default_cache_dir

    return DigestCache(default_cache_dir() / "file-digests.json")
