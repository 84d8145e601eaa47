"""Cache objects <-> named arrays + per-layer metadata, one layer at a time through its
``CacheClass``.

What each mlx-lm cache class stores, how it decodes and whether it trims lives in
``cache_classes``; this module applies it to whole caches: the capture check, encode and
decode, the safetensors dtypes, private copies, trims and sizes.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx  # noqa: E402

from kvsnap.errors import SnapshotError
from kvsnap.snapshot.cache_classes import (  # noqa: F401  (CaptureError re-exported)
    CaptureError,
    cache_class,
    decode_layer,
    encode_layer,
    layers_at,
    layers_trimmable,
    split_tensor_names,
)
from kvsnap.snapshot.file import OutTensor
from kvsnap.snapshot.format import DTYPES, TOKENS

# format.py's one dtype table
_MX_TO_ST = {getattr(mx, mlx_name): st_name for st_name, (mlx_name, _) in DTYPES.items()}


def _offsets(meta: dict) -> list[int]:
    """Token counts a layer claims (an empty one: 0; none for SSM state, which has no offset)."""
    spec = cache_class(meta["class"])
    if spec.members_field:
        return [o for sub in spec.members(meta) for o in _offsets(sub)]
    return [int(meta.get("offset", 0))] if "offset" in spec.filled_fields else []


def _encode_layers(cache: Sequence[Any]) -> tuple[list[dict], dict[str, mx.array]]:
    """Header fields per layer and the live arrays (lazy slices, nothing computed)."""
    arrays: dict[str, mx.array] = {}
    layers = [encode_layer(c, str(i), arrays) for i, c in enumerate(cache)]
    return layers, arrays


def check_captured_at(cache: Sequence[Any], n_tokens: int) -> None:
    """Every layer must hold exactly ``n_tokens``: a generated token in the state would poison
    it."""
    for i, (layer, meta) in enumerate(zip(cache, _encode_layers(cache)[0])):
        for offset in _offsets(meta):
            if offset != n_tokens:
                raise CaptureError(
                    f"layer {i} ({type(layer).__name__}) holds {offset} tokens, expected exactly "
                    f"{n_tokens}"
                )


def encode_cache(
    cache: Sequence[Any], tokens: Sequence[int]
) -> tuple[dict[str, mx.array], list[dict]]:
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
            raise SnapshotError(
                "<cache>",
                f"tensor {name} has dtype {a.dtype}, which safetensors cannot hold",
                "use a float16/bfloat16/float32 model",
            )
        a = mx.contiguous(a)
        mx.eval(a)
        # an mlx array is a buffer; its stubs do not say so
        data = memoryview(a).cast("B")  # type: ignore[arg-type]
        out.append(OutTensor(name, _MX_TO_ST[a.dtype], tuple(a.shape), data))
    return out


def copy_cache(cache: Sequence[Any]) -> list:
    """A private copy: new cache objects holding new array objects; appends and trims never reach
    the original.

    The arrays are copy-on-write views (``x[...]``), not copies: mlx writes in place only
    into a buffer nothing else holds, so the first write to a shared buffer copies it.
    Copying eagerly cost 1.5 s per 470 MB of KV on the first token of every request.
    """
    layers, arrays = _encode_layers(cache)
    return decode_cache({k: v[...] for k, v in arrays.items()}, layers)


def copy_cache_head(cache: Sequence[Any], n: int) -> list:
    """A private copy of the first ``n`` tokens of a trimmable cache: views of the sliced
    tensors' first ``n`` tokens (a request's first write copies those, not the whole entry),
    each layer's offset at ``n``. A copy then trim would copy every token of the entry on that
    first write: a 1-token match on a 2k-token snapshot copied its 470 MB."""
    layers, arrays = _encode_layers(cache)
    sliced, whole = split_tensor_names(layers)
    if whole:  # a layer kept whole (a sliding window not yet full) trims itself
        held = max((o for meta in layers for o in _offsets(meta)), default=n)
        return trim_cache(copy_cache(cache), held - n)
    heads = {k: v[..., :n, :] for k, v in arrays.items()}
    return decode_cache(heads, layers_at(layers, n))


def is_trimmable(cache: Sequence[Any]) -> bool:
    """Whether every layer can drop its last tokens, as its ``CacheClass`` says."""
    return layers_trimmable(_encode_layers(cache)[0])


def trim_cache(cache: list, n: int) -> list:
    """Drop the last ``n`` tokens of a private copy (only for trimmable caches)."""
    for c in cache:
        c.trim(n)
    return cache


def cache_nbytes_of(cache: Sequence[Any]) -> int:
    """Bytes of the live state (sliced to the tokens held), as a snapshot would store them."""
    return sum(a.nbytes for a in _encode_layers(cache)[1].values())


def cache_arrays(cache: Any) -> list:
    """The arrays a (private, single-sequence) cache layer holds, sliced to its tokens, for
    mx.eval."""
    arrays: dict[str, mx.array] = {}
    encode_layer(cache, "0", arrays)
    return list(arrays.values())
