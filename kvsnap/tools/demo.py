"""Demo models written: deterministic random weights for a family of ``demo_families.py``, a
tokenizer of ``demo_tokenizer.py``, into one model folder (atomically).

Tests, the quickstart and the benchmarks all make their models with ``make_demo_model``;
nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

from kvsnap.errors import UsageError
from kvsnap.tools.demo_families import QWEN3_06B_VOCAB, DemoSpec, model_config
from kvsnap.tools.demo_tokenizer import non_text_ids, train_tokenizer


def _parameters(model: Any) -> list[tuple[str, Any]]:
    """The model's parameters as (dotted name, array), in order."""
    from mlx.utils import tree_flatten

    # typed as a list or a dict: without ``destination`` it is a list of (name, array)
    return cast(list[tuple[str, Any]], tree_flatten(model.parameters()))


def _mask_output_rows(model, ids: list[int], used_vocab: int) -> None:
    """Zero lm_head rows (``ids``, and those past the tokenizer's vocabulary): a zero logit never
    beats the largest of hundreds of random ones."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    ((name, weight),) = [(n, w) for n, w in _parameters(model) if n.endswith("lm_head.weight")]
    keep = mx.ones((weight.shape[0], 1))
    keep[mx.array(ids)] = 0.0
    keep[used_vocab:] = 0.0
    model.update(tree_unflatten([(name, weight * keep)]))
    mx.eval(model.parameters())


def _randomize(model, seed: int, used_vocab: int) -> None:
    """Seeded Gaussian weights, scaled so outputs depend strongly on the context."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    new = []
    for i, (name, value) in enumerate(_parameters(model)):
        key = mx.random.key(seed * 100_003 + i)
        if value.ndim < 2 or "conv1d" in name:
            if "conv1d" in name:
                value = mx.random.normal(value.shape, key=key) * 0.5
            new.append((name, value.astype(mx.float32)))
            continue
        fan_in = value.shape[-1]
        if "embed_tokens" in name:
            w = mx.random.normal(value.shape, key=key)
            if used_vocab < value.shape[0]:
                # Ids the tokenizer never produces get zero logits, so greedy never picks them.
                w = mx.concatenate(
                    [w[:used_vocab], mx.zeros((value.shape[0] - used_vocab, value.shape[1]))]
                )
        else:
            w = mx.random.normal(value.shape, key=key) * (1.5 / fan_in**0.5)
        new.append((name, w.astype(mx.float32)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def make_demo_model(out_dir: str | Path, spec: DemoSpec = DemoSpec(), force: bool = False) -> Path:
    """Write a loadable mlx-lm model directory for ``spec`` (atomically) and return its path.

    An existing directory is kept unless ``force``: the weights are deterministic anyway.
    """
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, quantize_model

    spec.check()
    out = Path(out_dir)
    if out.exists() and not force:
        if (out / "config.json").exists():
            return out
        raise UsageError(
            f"{out} exists and is not a model directory; choose another path or pass --force"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        vocab, eos_ids = train_tokenizer(tmp, spec.chat_template, seed=spec.seed)
        model_vocab = QWEN3_06B_VOCAB if spec.size == "qwen3-0.6b" else vocab
        config = model_config(spec, model_vocab, eos_ids)
        model_cls, args_cls = _get_classes(config)
        mx.random.seed(spec.seed)
        model = model_cls(args_cls.from_dict(config))
        _randomize(model, spec.seed, vocab)
        if spec.plain_text_outputs:
            _mask_output_rows(model, non_text_ids(tmp / "tokenizer.json"), vocab)
        if spec.quantize_bits:
            # As mlx_lm.convert -q does for mlx-community models: the model's own predicate
            # (a MoE router stays at 8 bits), per-layer overrides in config["quantization"].
            model, config = quantize_model(model, config, group_size=64, bits=spec.quantize_bits)
            config["quantization_config"] = config["quantization"]
        weights = dict(_parameters(model))
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        # As mlx_lm.convert writes it: mlx-lm's pipeline-parallel load reads the weight map.
        index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in weights}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config["kvsnap_demo"] = {
            "arch": spec.arch,
            "size": spec.size,
            "template": spec.chat_template,
            "seed": spec.seed,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
