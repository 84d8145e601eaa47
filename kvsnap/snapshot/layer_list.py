"""A snapshot's layer list (``kvsnap.layers``), checked before any tensor name is built from it.

Every count is bounded *by the tensors the header really holds* before any name is generated
from it (a ``"parts": 10**9`` once built a billion names before the checksum was read); the
layer fields, tensor names and nesting are asked of ``cache_classes`` (one object per mlx-lm
cache class), and a class none describes is refused. Every failure is a FormatError naming
the field and its value. No mlx here.
"""

from __future__ import annotations

from typing import cast

from kvsnap.snapshot.cache_classes import UnknownCacheClass, cache_class, member_path
from kvsnap.snapshot.file import FormatError
from kvsnap.snapshot.header_fields import check_count, show

MAX_LAYERS = 4096  # per list; real models have under 200
MAX_LAYER_OBJECTS = 65536  # in all, CacheList members included
MAX_CACHE_NESTING = 4  # a CacheList inside a CacheList inside ...
MAX_PARTS = 8  # QuantizedKVCache: packed data, scales, biases
MAX_ARRAYS = 256  # ArraysCache slots (SSM conv + recurrent state: 2)
# a v3 record holds no layer tensors; its layer list may still name this many
RECORD_NAME_BUDGET = 2 * MAX_PARTS * MAX_LAYERS


class _LayerWalk:
    """Checks a layer list and yields its tensor names, never more than the header holds."""

    def __init__(self, budget: int):
        self.budget = budget  # tensor names the header has room for
        self.names: set[str] = set()
        self.objects = 0

    def add(self, field: str, names: list[str]) -> None:
        if len(self.names) + len(names) > self.budget:
            raise FormatError(
                f"{field} implies more tensors than the {self.budget} the header holds besides "
                f"tokens"
            )
        self.names.update(names)

    def layers(self, field: str, layers: object, parent: str | None, depth: int) -> None:
        if not isinstance(layers, list):
            raise FormatError(f"{field} is {show(layers)}, expected a JSON list of layers")
        if len(layers) > MAX_LAYERS:
            raise FormatError(f"{field} lists {len(layers)} layers, over the {MAX_LAYERS} limit")
        for i, meta in enumerate(layers):
            self.layer(
                f"{field}[{i}]", meta, str(i) if parent is None else member_path(parent, i), depth
            )

    def layer(self, field: str, meta: object, path: str, depth: int) -> None:
        self.objects += 1
        if self.objects > MAX_LAYER_OBJECTS:
            raise FormatError(f"kvsnap.layers holds over {MAX_LAYER_OBJECTS} layer objects")
        if not isinstance(meta, dict):
            raise FormatError(f"{field} is {show(meta)}, expected a JSON object")
        try:
            spec = cache_class(meta.get("class"), f"{field}.class")
        except UnknownCacheClass as exc:
            raise FormatError(f"{exc.reason}; {exc.fix}") from None
        cls = spec.name
        empty = meta.get("empty", False)
        if empty is not False and not (empty is True and spec.can_be_empty):
            raise FormatError(f"{field}.empty is {show(empty)}, not valid for a {cls} layer")
        allowed = {"class", "empty", *spec.fields, *spec.filled_fields}
        required = set(spec.fields) | (set() if empty else set(spec.filled_fields))
        unknown = sorted(set(meta) - allowed)
        missing = sorted(required - set(meta))
        if unknown or missing:
            what = (
                f"unknown field {show(unknown[0])}" if unknown else f"no field {show(missing[0])}"
            )
            raise FormatError(f"{field} ({cls}) has {what}")
        self.fields(field, meta)
        broken = spec.consistent(meta)
        if broken is not None:
            raise FormatError(f"{field}.{broken}")
        if spec.members_field:
            if depth >= MAX_CACHE_NESTING:
                raise FormatError(f"{field}: {cls} nested more than {MAX_CACHE_NESTING} deep")
            self.layers(f"{field}.{spec.members_field}", spec.members(meta), path, depth + 1)
        self.add(field, spec.tensor_names(meta, path))

    def fields(self, field: str, meta: dict) -> None:
        """Each number in range; the offset is the token count (the state was captured at its
        boundary)."""
        for name, value in meta.items():
            where = f"{field}.{name}"
            if name in ("class", "empty", "caches"):
                continue
            if name == "present":
                if not isinstance(value, list) or len(value) > MAX_ARRAYS:
                    raise FormatError(
                        f"{where} is {show(value)}, expected a list of at most {MAX_ARRAYS} slot "
                        f"numbers"
                    )
                size = check_count(f"{field}.size", meta["size"], 0, MAX_ARRAYS)
                for j in value:
                    check_count(where, j, 0, size - 1)
                if value != sorted(set(value)):
                    raise FormatError(
                        f"{where} is {show(value)}, expected increasing slot numbers without "
                        f"repeats"
                    )
            elif name == "parts":
                check_count(where, value, 1, min(MAX_PARTS, self.budget))
            elif name == "bits":
                check_count(where, value, 1, 8)
            elif name == "size":
                check_count(where, value, 0, MAX_ARRAYS)
            else:
                check_count(where, value)


def expected_tensor_names(layers: object, budget: int) -> set[str]:
    """The tensor names a layer list implies; FormatError (field and value) if any field is off or
    they outnumber ``budget``."""
    walk = _LayerWalk(budget)
    walk.layers("kvsnap.layers", layers, None, 0)
    return walk.names


def checked_layers(layers: object, budget: int) -> tuple[list, set[str]]:
    """``layers`` checked as a layer list (FormatError otherwise), and the tensor names it
    implies."""
    names = expected_tensor_names(layers, budget)
    return cast(list, layers), names  # expected_tensor_names refuses anything but a list


def check_offsets(layers: list, n_tokens: int, field: str = "kvsnap.layers") -> None:
    """Every layer's offset is the token count: a state is captured exactly at its tokens.

    Run after the checksum (a flipped digit is reported as the corruption it is); this
    catches a header that is consistent but lies. ``layers`` was checked by
    ``expected_tensor_names``.
    """
    for i, meta in enumerate(layers):
        spec = cache_class(meta["class"])
        if spec.members_field:
            check_offsets(spec.members(meta), n_tokens, f"{field}[{i}].{spec.members_field}")
        elif "offset" in meta and meta["offset"] != n_tokens:
            raise FormatError(
                f"{field}[{i}].offset is {meta['offset']}, but the snapshot holds {n_tokens} "
                f"tokens (a state is captured exactly at its tokens)"
            )
