"""One object per mlx-lm cache class: its header fields, tensor names, trimmability, encode and
decode.

Every other module asks these objects (codec, the header's layer walk, warm-up); a class no
object describes is refused with ``UnknownCacheClass``, never guessed. mlx-free at import:
``kvsnap ls/verify`` walk layer lists with it. Encode only reads attributes and slices the
arrays it is handed; decode imports mlx-lm when it runs.

The encoders read and set the cache objects' attributes (keys, values, offset, ...), which
are the same in mlx-lm 0.31 and 0.32, instead of their ``state`` tuples, whose layout
changed between those minors. The field order of each encoder's dict is the header's
bytes: keep it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from kvsnap.blas import preload_openblas
from kvsnap.errors import SnapshotError

UNKNOWN_CLASS_FIX = (
    "upgrade kvsnap, or report the class to the kvsnap project so a codec can be added"
)


class CaptureError(AssertionError):
    """A cache does not hold exactly the tokens it claims: it must never be saved."""


class UnknownCacheClass(SnapshotError):
    """A cache class no ``CacheClass`` describes: kvsnap cannot store, restore or trim it."""

    def __init__(self, name: object, where: str = "cache layer", path: str = "<cache>"):
        self.name = name
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        super().__init__(
            path,
            f"{where} is {shown}, not a cache class this kvsnap knows how to store (it knows "
            f"{', '.join(CACHE_CLASSES)})",
            UNKNOWN_CLASS_FIX,
        )


def _no_rule(meta: dict) -> str | None:
    return None


@dataclass(frozen=True)
class CacheClass:
    """Everything kvsnap knows about one mlx-lm cache class."""

    name: str
    fields: tuple[str, ...]  # header fields every layer of the class has
    filled_fields: tuple[str, ...]  # header fields only a non-empty layer has
    can_be_empty: bool
    # (cache, path, out arrays) -> header fields but "class"
    encode: Callable[[Any, str, dict], dict]
    decode: Callable[[dict, str, dict], Any]  # (header fields, path, arrays) -> a new cache object
    # the layer's own; a CacheList's members name theirs
    own_tensor_names: Callable[[dict, str], list[str]]
    trimmable: Callable[[dict], bool]  # can it drop any number of its last tokens
    members_field: str | None = None  # the field holding member layers (CacheList)
    # its tensors are per-token along axis -2: a block stores a run of them (else: checkpoints only)
    sliceable: bool = False
    # a rule between fields: the broken one, or None
    consistent: Callable[[dict], str | None] = _no_rule

    def tensor_names(self, meta: dict, path: str) -> list[str]:
        """The tensors this layer itself holds in a snapshot (none when empty)."""
        return [] if meta.get("empty") else self.own_tensor_names(meta, path)

    def members(self, meta: dict) -> list:
        return meta[self.members_field] if self.members_field else []


def member_path(path: str, j: int) -> str:
    """Where member ``j`` of the layer at ``path`` keeps its tensors."""
    return f"{path}.{j}"


def _mlx_lm_cache():
    preload_openblas()  # must precede the first mlx import; does nothing once mlx is loaded
    from mlx_lm.models import cache

    return cache


def _slice_tokens(x, n: int):
    return x[..., :n, :]


def _keys_values(meta: dict, path: str) -> list[str]:
    return [f"{path}.keys", f"{path}.values"]


def _always(meta: dict) -> bool:
    return True


def _never(meta: dict) -> bool:
    return False


# --- KVCache ------------------------------------------------------------------------------


def _kv_encode(c, path, out) -> dict:
    if c.keys is None:
        return {"empty": True}
    out[f"{path}.keys"] = _slice_tokens(c.keys, c.offset)
    out[f"{path}.values"] = _slice_tokens(c.values, c.offset)
    return {"offset": c.offset}


def _kv_decode(meta, path, arrays):
    c = _mlx_lm_cache().KVCache()
    if not meta.get("empty"):
        c.keys, c.values, c.offset = (
            arrays[f"{path}.keys"],
            arrays[f"{path}.values"],
            int(meta["offset"]),
        )
    return c


# --- RotatingKVCache (sliding window) -----------------------------------------------------


def _rotating_encode(c, path, out) -> dict:
    if c.keys is None:
        return {"empty": True, "max_size": c.max_size, "keep": c.keep}
    # Below the buffer's end the tail is unused padding; once full the whole ring is live.
    live = c.keys.shape[2] if c.offset >= c.keys.shape[2] else c.offset
    out[f"{path}.keys"] = _slice_tokens(c.keys, live)
    out[f"{path}.values"] = _slice_tokens(c.values, live)
    return {"offset": c.offset, "max_size": c.max_size, "keep": c.keep, "idx": c._idx}


def _rotating_decode(meta, path, arrays):
    c = _mlx_lm_cache().RotatingKVCache(max_size=int(meta["max_size"]), keep=int(meta["keep"]))
    if not meta.get("empty"):
        c.keys, c.values = arrays[f"{path}.keys"], arrays[f"{path}.values"]
        c.offset, c._idx = int(meta["offset"]), int(meta["idx"])
    return c


def _rotating_trimmable(meta: dict) -> bool:
    # Past its window the ring has overwritten the tokens a trim would need back.
    return int(meta.get("offset", 0)) < int(meta["max_size"])


# --- QuantizedKVCache (--kv-bits) ---------------------------------------------------------


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
    c = _mlx_lm_cache().QuantizedKVCache(group_size=int(meta["group_size"]), bits=int(meta["bits"]))
    if not meta.get("empty"):
        parts = int(meta["parts"])
        c.keys = tuple(arrays[f"{path}.keys.{j}"] for j in range(parts))
        c.values = tuple(arrays[f"{path}.values.{j}"] for j in range(parts))
        c.offset = int(meta["offset"])
    return c


def _quantized_names(meta: dict, path: str) -> list[str]:
    return [f"{path}.{kv}.{j}" for kv in ("keys", "values") for j in range(meta["parts"])]


# --- ArraysCache (SSM / gated delta-net state) --------------------------------------------


def _arrays_encode(c, path, out) -> dict:
    if getattr(c, "left_padding", None) is not None or getattr(c, "lengths", None) is not None:
        raise CaptureError(
            f"layer {path}: ArraysCache still carries batch padding or lengths; capture from a "
            f"single-sequence cache"
        )
    present = []
    for j, a in enumerate(c.cache):
        if a is not None:
            out[f"{path}.state.{j}"] = a
            present.append(j)
    return {"size": len(c.cache), "present": present}


def _arrays_decode(meta, path, arrays):
    c = _mlx_lm_cache().ArraysCache(int(meta["size"]))
    for j in meta["present"]:
        c.cache[j] = arrays[f"{path}.state.{j}"]
    return c


def _arrays_names(meta: dict, path: str) -> list[str]:
    return [f"{path}.state.{j}" for j in meta["present"]]


# --- ChunkedKVCache (llama4) --------------------------------------------------------------


def _chunked_encode(c, path, out) -> dict:
    meta = {"chunk_size": c.chunk_size}
    if c.keys is None:
        return {"empty": True, **meta}
    live = c.offset - c.start_position
    out[f"{path}.keys"] = _slice_tokens(c.keys, live)
    out[f"{path}.values"] = _slice_tokens(c.values, live)
    return {"offset": c.offset, "start_position": c.start_position, **meta}


def _chunked_decode(meta, path, arrays):
    c = _mlx_lm_cache().ChunkedKVCache(int(meta["chunk_size"]))
    if not meta.get("empty"):
        c.keys, c.values = arrays[f"{path}.keys"], arrays[f"{path}.values"]
        c.offset, c.start_position = int(meta["offset"]), int(meta["start_position"])
    return c


def _chunked_trimmable(meta: dict) -> bool:
    # Once its front is dropped, mlx-lm's trim cannot cut below start_position and quietly
    # cuts fewer tokens than asked (its is_trimmable still says yes): a shorter entry serves.
    return int(meta.get("start_position", 0)) == 0


def _chunked_consistent(meta: dict) -> str | None:
    if not meta.get("empty") and meta["start_position"] > meta["offset"]:
        return f"start_position is {meta['start_position']}, past offset {meta['offset']}"
    return None


# --- CacheList (falcon_h1: members of other classes) ---------------------------------------


def _list_encode(c, path, out) -> dict:
    return {
        "caches": [encode_layer(sub, member_path(path, j), out) for j, sub in enumerate(c.caches)]
    }


def _list_decode(meta, path, arrays):
    return _mlx_lm_cache().CacheList(
        *(decode_layer(sub, member_path(path, j), arrays) for j, sub in enumerate(meta["caches"]))
    )


def _list_trimmable(meta: dict) -> bool:
    return layers_trimmable(meta["caches"])


def _no_tensors(meta: dict, path: str) -> list[str]:
    return []


_ALL = (
    CacheClass(
        "KVCache",
        (),
        ("offset",),
        True,
        _kv_encode,
        _kv_decode,
        _keys_values,
        _always,
        sliceable=True,
    ),
    CacheClass(
        "RotatingKVCache",
        ("max_size", "keep"),
        ("offset", "idx"),
        True,
        _rotating_encode,
        _rotating_decode,
        _keys_values,
        _rotating_trimmable,
    ),
    CacheClass(
        "QuantizedKVCache",
        ("group_size", "bits"),
        ("offset", "parts"),
        True,
        _quantized_encode,
        _quantized_decode,
        _quantized_names,
        _always,
        sliceable=True,
    ),
    CacheClass(
        "ArraysCache",
        ("size", "present"),
        (),
        False,
        _arrays_encode,
        _arrays_decode,
        _arrays_names,
        _never,
    ),
    CacheClass(
        "ChunkedKVCache",
        ("chunk_size",),
        ("offset", "start_position"),
        True,
        _chunked_encode,
        _chunked_decode,
        _keys_values,
        _chunked_trimmable,
        consistent=_chunked_consistent,
    ),
    CacheClass(
        "CacheList",
        ("caches",),
        (),
        False,
        _list_encode,
        _list_decode,
        _no_tensors,
        _list_trimmable,
        members_field="caches",
    ),
)

# The explicit registry, read-only: a class not named here is refused everywhere.
CACHE_CLASSES: Mapping[str, CacheClass] = MappingProxyType({c.name: c for c in _ALL})


def cache_class(name: object, where: str = "cache layer", path: str = "<cache>") -> CacheClass:
    """The object for a class name; ``UnknownCacheClass`` (naming ``where`` and the fix) for any
    other."""
    found = CACHE_CLASSES.get(name) if isinstance(name, str) else None
    if found is None:
        raise UnknownCacheClass(name, where, path)
    return found


def encode_layer(cache: Any, path: str, out: dict) -> dict:
    """A layer's header fields; its arrays go into ``out`` under names starting with ``path``."""
    name = type(cache).__name__
    return {"class": name, **cache_class(name, f"cache layer {path}").encode(cache, path, out)}


def decode_layer(meta: dict, path: str, arrays: dict) -> Any:
    return cache_class(meta.get("class"), f"cache layer {path}").decode(meta, path, arrays)


def layers_trimmable(layers: Sequence[dict], path: str = "<cache>") -> bool:
    """Whether every layer of a (checked) layer list can drop its last tokens.

    ``path``: the snapshot the list came from, named by ``UnknownCacheClass``."""
    return all(
        cache_class(meta.get("class"), f"layer {i} class", path).trimmable(meta)
        for i, meta in enumerate(layers)
    )


def split_tensor_names(
    layers: Sequence[dict], parent: str | None = None
) -> tuple[list[str], list[str]]:
    """(sliced, checkpointed): the tensors a block stores a run of tokens of, and those only a
    checkpoint stores whole (SSM state, rotating windows, chunked attention)."""
    sliced: list[str] = []
    whole: list[str] = []
    for i, meta in enumerate(layers):
        path = str(i) if parent is None else member_path(parent, i)
        spec = cache_class(meta.get("class"), f"cache layer {path}")
        if spec.members_field:
            s, w = split_tensor_names(spec.members(meta), path)
            sliced += s
            whole += w
        else:
            (sliced if spec.sliceable else whole).extend(spec.tensor_names(meta, path))
    return sliced, whole


def needs_checkpoints(layers: Sequence[dict]) -> bool:
    """Whether any layer is one only a checkpoint can restore (a hybrid, a sliding window)."""

    def walk(metas: Sequence[dict]) -> bool:
        for meta in metas:
            spec = cache_class(meta.get("class"))
            if spec.members_field:
                if walk(spec.members(meta)):
                    return True
            elif not spec.sliceable:
                return True
        return False

    return walk(layers)


def layers_at(layers: Sequence[dict], n_tokens: int) -> list[dict]:
    """The sliceable layers' header fields as they read at ``n_tokens`` (their offset); others
    unchanged."""
    out = []
    for meta in layers:
        spec = cache_class(meta.get("class"))
        if spec.members_field:
            out.append({**meta, spec.members_field: layers_at(spec.members(meta), n_tokens)})
        elif spec.sliceable and not meta.get("empty"):
            out.append({**meta, "offset": n_tokens})
        else:
            out.append(dict(meta))
    return out
