"""The logical (whole-model) state of a prefix from every rank's slice of it, on every rank.

A sharded prefill leaves each rank with its slice: its KV heads (tensor parallel) or its
layers (pipeline). A store holds one logical cache per block, so before a write the slices
are gathered: heads concatenated in rank order (the order ``shard_linear`` split them in),
layers placed at their global numbers. The result is what one process would have computed,
within float tolerance, and encodes to the same tensors and keys.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from kvsnap.runtime.sharding.ranks import RankGroup, mx
from kvsnap.snapshot.codec import encode_cache
from kvsnap.snapshot.format import TOKENS
from kvsnap.snapshot.shard_view import PIPELINE, ShardView


def gather_state(
    cache: Sequence[Any], tokens: Sequence[int], view: ShardView, ranks: RankGroup
) -> tuple[dict[str, mx.array], list[dict]]:
    """(arrays, layer list) of the logical state after ``tokens``; a collective."""
    arrays, layers = encode_cache(cache, tokens)
    if view.mode == PIPELINE:
        return _gather_layers(arrays, layers, view, ranks)
    out = {TOKENS: arrays.pop(TOKENS)}
    for name, a in arrays.items():
        # [1, heads, T, D]: heads to axis 0, where all_gather stacks the ranks' slices
        stacked = ranks.all_gather(mx.contiguous(a.swapaxes(0, 1)))
        out[name] = stacked.swapaxes(0, 1)
    return out, layers


def _gather_layers(
    arrays: dict[str, mx.array], layers: list[dict], view: ShardView, ranks: RankGroup
) -> tuple[dict[str, mx.array], list[dict]]:
    tokens = arrays.pop(TOKENS)
    names = sorted(arrays)
    flat = [mx.contiguous(arrays[n]).reshape(-1).view(mx.uint8) for n in names]
    sizes = [int(f.size) for f in flat]
    meta = {
        "start": view.layer_start,
        "layers": layers,
        "tensors": [
            [
                _global_name(n, view.layer_start),
                str(arrays[n].dtype).removeprefix("mlx.core."),
                list(arrays[n].shape),
                size,
            ]
            for n, size in zip(names, sizes)
        ],
    }
    metas = [json.loads(m) for m in ranks.gather_bytes(json.dumps(meta).encode())]
    width = max(sum(m_size for *_, m_size in m["tensors"]) for m in metas) or 1
    mine = mx.concatenate(flat) if flat else mx.zeros((0,), dtype=mx.uint8)
    padded = mx.concatenate([mine, mx.zeros((width - int(mine.size),), dtype=mx.uint8)])
    rows = ranks.all_gather(padded[None])
    n_layers = max(m["start"] + len(m["layers"]) for m in metas)
    full_layers: list = [None] * n_layers
    out = {TOKENS: tokens}
    for rank, m in enumerate(metas):
        full_layers[m["start"] : m["start"] + len(m["layers"])] = m["layers"]
        at = 0
        for name, dtype, shape, size in m["tensors"]:
            piece = rows[rank, at : at + size].view(getattr(mx, dtype)).reshape(shape)
            out[name] = piece
            at += size
    missing = [i for i, meta in enumerate(full_layers) if meta is None]
    if missing:
        raise RuntimeError(f"no rank ran layers {missing} (the pipeline split is not a tiling)")
    mx.eval(list(out.values()))
    return out, full_layers


def _global_name(name: str, start: int) -> str:
    head, _, rest = name.partition(".")
    return f"{int(head) + start}.{rest}"
