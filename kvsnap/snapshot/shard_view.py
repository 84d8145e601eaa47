"""Which part of a logical (whole-model) snapshot one rank of a sharded model holds. No mlx here.

A store holds one logical cache per block, whatever topology serves it. Under **tensor
parallelism** (mlx-lm's ``model.shard``) rank r of N holds KV heads ``[r*H/N, (r+1)*H/N)`` of
every attention layer: rows of the per-token tensors (``kvsnap.snapshot.rows``). Under
**pipeline parallelism** (``model.model.pipeline``) it holds global layers ``[start, end)``
whole, renumbered from 0 as its local cache list is. ``ShardView.cut`` says, for one file's
tensors, which to read and which rows; what a rank cannot take is a ``ShardError`` naming
the layer or tensor and both topologies' numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvsnap.errors import UsageError
from kvsnap.snapshot.cache_classes import cache_class, member_path
from kvsnap.snapshot.rows import row_count

TENSOR: Literal["tensor"] = "tensor"
PIPELINE: Literal["pipeline"] = "pipeline"


class ShardError(UsageError):
    """A snapshot this rank's slice of the model cannot take (the topology, not the file, is at
    fault: every snapshot of this model would fail alike); the message names both sides."""


@dataclass(frozen=True)
class Cut:
    """One tensor as a rank reads it: its local name, and its rows ``[lo, hi)`` (None: whole)."""

    local_name: str
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class ShardView:
    mode: Literal["tensor", "pipeline"]
    rank: int
    size: int
    # pipeline: the global layers this rank runs, [layer_start, layer_end)
    layer_start: int = 0
    layer_end: int = 0

    def describe(self) -> str:
        if self.mode == PIPELINE:
            return (
                f"rank {self.rank} of {self.size} (pipeline, layers "
                f"{self.layer_start}-{self.layer_end - 1})"
            )
        return f"rank {self.rank} of {self.size} (tensor parallel)"

    def local_layers(self, layers: list) -> list:
        """This rank's entries of a logical layer list."""
        if self.mode == PIPELINE:
            if self.layer_end > len(layers):
                raise ShardError(
                    f"the snapshot holds {len(layers)} layers, but {self.describe()} runs layers "
                    f"up to {self.layer_end - 1}: it was built for another model"
                )
            return layers[self.layer_start : self.layer_end]
        return list(layers)

    def cut(
        self,
        layers: list,
        shapes: dict[str, tuple[int, ...]],
        local: dict[str, tuple] | None = None,
    ) -> dict[str, Cut]:
        """For the tensors of one file (``shapes``: name -> logical shape) of a state whose logical
        layer list is ``layers``: what this rank reads of each. Tensors of other layers are left
        out (pipeline). ``local``: this rank's own cache shapes by name (token axis None), when
        known: a tensor parallel rank then takes a tensor whole where its model keeps it whole
        (a cache mlx-lm replicates, as DeepSeek's latent KV) and its share of the heads where
        it splits them. ShardError when this rank's slice cannot be cut from them."""
        owner = _owners(layers)
        out: dict[str, Cut] = {}
        for name, shape in shapes.items():
            where = owner.get(name)
            if where is None:
                continue  # tokens: not a cache tensor
            layer, per_token = where
            if self.mode == PIPELINE:
                if self.layer_start <= layer < self.layer_end:
                    out[name] = Cut(_renumber(name, layer, layer - self.layer_start))
                continue
            want = (local or {}).get(name)
            if want is not None:
                out[name] = self._against_local(name, shape, tuple(want), per_token)
                continue
            out[name] = Cut(name, self._head_rows(name, shape, layers[layer], per_token))
        return out

    def _against_local(self, name: str, shape: tuple, want: tuple, per_token: bool) -> Cut:
        """Whole where this rank's model keeps the tensor whole (a replicated cache), its share
        of the heads where it splits them by ``size``; else ShardError naming both shapes."""

        def same(a: tuple, b: tuple) -> bool:
            return len(a) == len(b) and all(x is None or x == y for x, y in zip(a, b))

        if same(want, shape):
            return Cut(name)
        split = per_token and len(shape) >= 3 and want[1] is not None
        if split and want[1] * self.size == shape[1] and same(want[2:], shape[2:]):
            return Cut(name, (self.rank * want[1], (self.rank + 1) * want[1]))
        show = ", ".join("T" if d is None else str(d) for d in want)
        raise ShardError(
            f"tensor {name} is {list(shape)} in the snapshot, but {self.describe()} holds "
            f"[{show}] of it: neither the whole tensor nor 1/{self.size} of its heads (a "
            "tensor-parallel rank cannot take this state; serve this model with --pipeline)"
        )

    def _head_rows(self, name: str, shape: tuple, meta: dict, per_token: bool) -> tuple[int, int]:
        if not per_token:
            raise ShardError(
                f"tensor {name} is a {meta.get('class')} layer's whole state, which a tensor-"
                f"parallel rank cannot take a slice of; serve this model with --pipeline"
            )
        heads = row_count(shape)
        if heads % self.size or (heads == 1 and self.size > 1):
            raise ShardError(
                f"tensor {name} holds {heads} KV heads, which {self.size} tensor-parallel ranks "
                f"cannot split evenly; run a number of ranks that divides {heads} "
                f"({', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)}), or "
                "--pipeline"
            )
        per_rank = heads // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank


def _renumber(name: str, layer: int, local: int) -> str:
    head, _, rest = name.partition(".")
    assert head == str(layer), (name, layer)
    return f"{local}.{rest}"


def _owners(layers: list) -> dict[str, tuple[int, bool]]:
    """tensor name -> (its global layer, whether it is per-token: heads on axis 1)."""
    out: dict[str, tuple[int, bool]] = {}

    def walk(metas: list, parent: str | None, top: int | None) -> None:
        for i, meta in enumerate(metas):
            path = str(i) if parent is None else member_path(parent, i)
            layer = i if top is None else top
            spec = cache_class(meta.get("class"))
            if spec.members_field:
                walk(spec.members(meta), path, layer)
                continue
            per_token = "offset" in spec.filled_fields
            for name in spec.tensor_names(meta, path):
                out[name] = (layer, per_token)

    walk(layers, None, None)
    return out
