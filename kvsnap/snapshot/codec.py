"""Cache objects <-> named arrays + per-layer metadata: one codec per mlx-lm cache class.

The codec reads and sets the cache objects' attributes (keys, values, offset, ...),
which are the same in mlx-lm 0.31 and 0.32, instead of their ``state`` tuples,
whose layout changed between those minors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx  # noqa: E402

from kvsnap.errors import SnapshotError
from kvsnap.snapshot.file import OutTensor
from kvsnap.snapshot.format import DTYPES

TOKENS = "tokens"

_MX_TO_ST = {getattr(mx, mlx_name): st_name for st_name, (mlx_name, _) in DTYPES.items()}  # format.py's one dtype table


class CaptureError(AssertionError):
    """A cache does not hold exactly the tokens it claims: it must never be saved."""


def _slice_tokens(x: mx.array, n: int) -> mx.array:
    return x[..., :n, :]


def _kv_encode(c, path, out) -> dict:
    if c.keys is None:
        return {"empty": True}
    out[f"{path}.keys"] = _slice_tokens(c.keys, c.offset)
    out[f"{path}.values"] = _slice_tokens(c.values, c.offset)
    return {"offset": c.offset}


def _kv_decode(meta, path, arrays):
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    if not meta.get("empty"):
        c.keys, c.values, c.offset = arrays[f"{path}.keys"], arrays[f"{path}.values"], int(meta["offset"])
    return c


def _rotating_encode(c, path, out) -> dict:
    if c.keys is None:
        return {"empty": True, "max_size": c.max_size, "keep": c.keep}
    # Below the buffer's end the tail is unused padding; once full the whole ring is live.
    live = c.keys.shape[2] if c.offset >= c.keys.shape[2] else c.offset
    out[f"{path}.keys"] = _slice_tokens(c.keys, live)
    out[f"{path}.values"] = _slice_tokens(c.values, live)
    return {"offset": c.offset, "max_size": c.max_size, "keep": c.keep, "idx": c._idx}


def _rotating_decode(meta, path, arrays):
    from mlx_lm.models.cache import RotatingKVCache

    c = RotatingKVCache(max_size=int(meta["max_size"]), keep=int(meta["keep"]))
    if not meta.get("empty"):
        c.keys, c.values = arrays[f"{path}.keys"], arrays[f"{path}.values"]
        c.offset, c._idx = int(meta["offset"]), int(meta["idx"])
    return c


def _quantized_encode(c, path, out) -> dict:
    meta = {"group_size": c.group_size, "bits": c.bits}
    if c.keys is None:
        return {"empty": True, **meta}
    for j, part in enumerate(c.keys):
        out[f"{path}.keys.{j}"] = _slice_tokens(part, c.offset)
    for j, part in enumerate(c.values):
        out[f"{path}.values.{j}"] = _slice_tokens(part, c.offset)
    return {"offset": c.offset, "parts": len(c.keys), **meta}


def _quantized_decode(meta, path, arrays):
    from mlx_lm.models.cache import QuantizedKVCache

    c = QuantizedKVCache(group_size=int(meta["group_size"]), bits=int(meta["bits"]))
    if not meta.get("empty"):
        parts = int(meta["parts"])
        c.keys = tuple(arrays[f"{path}.keys.{j}"] for j in range(parts))
        c.values = tuple(arrays[f"{path}.values.{j}"] for j in range(parts))
        c.offset = int(meta["offset"])
    return c


def _arrays_encode(c, path, out) -> dict:
    if getattr(c, "left_padding", None) is not None or getattr(c, "lengths", None) is not None:
        raise CaptureError(f"layer {path}: ArraysCache still carries batch padding or lengths; capture from a single-sequence cache")
    present = []
    for j, a in enumerate(c.cache):
        if a is not None:
            out[f"{path}.state.{j}"] = a
            present.append(j)
    return {"size": len(c.cache), "present": present}


def _arrays_decode(meta, path, arrays):
    from mlx_lm.models.cache import ArraysCache

    c = ArraysCache(int(meta["size"]))
    for j in meta["present"]:
        c.cache[j] = arrays[f"{path}.state.{j}"]
    return c


def _chunked_encode(c, path, out) -> dict:
    meta = {"chunk_size": c.chunk_size}
    if c.keys is None:
        return {"empty": True, **meta}
    live = c.offset - c.start_position
    out[f"{path}.keys"] = _slice_tokens(c.keys, live)
    out[f"{path}.values"] = _slice_tokens(c.values, live)
    return {"offset": c.offset, "start_position": c.start_position, **meta}


def _chunked_decode(meta, path, arrays):
    from mlx_lm.models.cache import ChunkedKVCache

    c = ChunkedKVCache(int(meta["chunk_size"]))
    if not meta.get("empty"):
        c.keys, c.values = arrays[f"{path}.keys"], arrays[f"{path}.values"]
        c.offset, c.start_position = int(meta["offset"]), int(meta["start_position"])
    return c


def _list_encode(c, path, out) -> dict:
    return {"caches": [encode_layer(sub, f"{path}.{j}", out) for j, sub in enumerate(c.caches)]}


def _list_decode(meta, path, arrays):
    from mlx_lm.models.cache import CacheList

    return CacheList(*(decode_layer(sub, f"{path}.{j}", arrays) for j, sub in enumerate(meta["caches"])))


@dataclass(frozen=True)
class Codec:
    encode: Callable[[Any, str, dict], dict]
    decode: Callable[[dict, str, dict], Any]


# The explicit registry: a cache class not named here is refused, never guessed.
CODECS: dict[str, Codec] = {
    "KVCache": Codec(_kv_encode, _kv_decode),
    "RotatingKVCache": Codec(_rotating_encode, _rotating_decode),
    "QuantizedKVCache": Codec(_quantized_encode, _quantized_decode),
    "ArraysCache": Codec(_arrays_encode, _arrays_decode),
    "ChunkedKVCache": Codec(_chunked_encode, _chunked_decode),
    "CacheList": Codec(_list_encode, _list_decode),
}


def _codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise SnapshotError("<cache>", f"cache class {name!r} has no kvsnap codec", f"supported classes: {', '.join(CODECS)}") from None


def encode_layer(cache: Any, path: str, out: dict) -> dict:
    name = type(cache).__name__
    return {"class": name, **_codec(name).encode(cache, path, out)}


def decode_layer(meta: dict, path: str, arrays: dict) -> Any:
    return _codec(meta["class"]).decode(meta, path, arrays)


def layer_offsets(cache: Any) -> list[int]:
    """Token counts a layer claims (none for SSM state, which has no offset)."""
    if type(cache).__name__ == "CacheList":
        return [o for sub in cache.caches for o in layer_offsets(sub)]
    offset = getattr(cache, "offset", None)
    return [] if offset is None else [int(offset)]


def check_captured_at(cache: Sequence[Any], n_tokens: int) -> None:
    """Every layer must hold exactly ``n_tokens``: a generated token in the state would poison it."""
    for i, layer in enumerate(cache):
        for offset in layer_offsets(layer):
            if offset != n_tokens:
                raise CaptureError(f"layer {i} ({type(layer).__name__}) holds {offset} tokens, expected exactly {n_tokens}")


def encode_cache(cache: Sequence[Any], tokens: Sequence[int]) -> tuple[dict[str, mx.array], list[dict]]:
    check_captured_at(cache, len(tokens))
    arrays: dict[str, mx.array] = {TOKENS: mx.array(list(tokens), dtype=mx.int32)}
    layers = [encode_layer(c, str(i), arrays) for i, c in enumerate(cache)]
    return arrays, layers


def decode_cache(arrays: dict[str, mx.array], layers: list[dict]) -> list:
    return [decode_layer(meta, str(i), arrays) for i, meta in enumerate(layers)]


def to_out_tensors(arrays: dict[str, mx.array]) -> list[OutTensor]:
    out = []
    for name, a in arrays.items():
        if a.dtype not in _MX_TO_ST:
            raise SnapshotError("<cache>", f"tensor {name} has dtype {a.dtype}, which safetensors cannot hold", "use a float16/bfloat16/float32 model")
        a = mx.contiguous(a)
        mx.eval(a)
        out.append(OutTensor(name, _MX_TO_ST[a.dtype], tuple(a.shape), memoryview(a).cast("B")))
    return out


def copy_cache(cache: Sequence[Any]) -> list:
    """A private copy: new cache objects holding new array objects; appends and trims never reach the original.

    The arrays are copy-on-write views (``x[...]``), not copies: mlx writes in place only
    into a buffer nothing else holds, so the first write to a shared buffer copies it.
    Copying eagerly cost 1.5 s per 470 MB of KV on the first token of every request.
    """
    arrays: dict[str, mx.array] = {}
    layers = [encode_layer(c, str(i), arrays) for i, c in enumerate(cache)]
    return decode_cache({k: v[...] for k, v in arrays.items()}, layers)


def cache_nbytes(arrays: dict[str, mx.array]) -> int:
    return sum(a.nbytes for a in arrays.values())


def is_trimmable(cache: Sequence[Any]) -> bool:
    return all(c.is_trimmable() for c in cache)


def trim_cache(cache: list, n: int) -> list:
    """Drop the last ``n`` tokens of a private copy (only for trimmable caches)."""
    for c in cache:
        c.trim(n)
    return cache


def cache_nbytes_of(cache: Sequence[Any]) -> int:
    """Bytes of the live state (sliced to the tokens held), as a snapshot would store them."""
    arrays: dict[str, mx.array] = {}
    for i, c in enumerate(cache):
        encode_layer(c, str(i), arrays)
    return sum(a.nbytes for a in arrays.values())


def cache_arrays(cache) -> list:
    """The arrays a (private, single-sequence) cache layer holds, for mx.eval."""
    if type(cache).__name__ == "CacheList":
        return [a for sub in cache.caches for a in cache_arrays(sub)]
    out = []
    for name in ("keys", "values"):
        v = getattr(cache, name, None)
        if isinstance(v, (tuple, list)):
            out += [a for a in v if a is not None]
        elif v is not None:
            out.append(v)
    if type(cache).__name__ == "ArraysCache":
        out += [a for a in cache.cache if a is not None]
    return out
