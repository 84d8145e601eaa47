"""The few collectives kvsnap needs between the ranks of a sharded model, over MLX's own group.

Every rank must call each of these at the same point with the same sequence of calls (they
are collectives); each returns the same value on every rank. Small values travel as JSON, so a
rank never unpickles what another sent. On one process (size 1) each is a local no-op.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import

import mlx.core as mx  # noqa: E402


@dataclass(frozen=True)
class RankGroup:
    group: Any
    rank: int
    size: int

    @classmethod
    def world(cls) -> "RankGroup":
        """The group ``mlx.launch`` started this process in (size 1 when it did not)."""
        group = mx.distributed.init()
        return cls(group, group.rank(), group.size())

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def all_gather(self, x: mx.array) -> mx.array:
        """Every rank's ``x`` stacked along axis 0, in rank order (CPU stream: small or bulk host
        data, never on a GPU queue shared with the model)."""
        if not self.sharded:
            return x
        out = mx.distributed.all_gather(x, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order."""
        if not self.sharded:
            return [data]
        lengths = [
            int(n) for n in self._numbers(self.all_gather(mx.array([len(data)], dtype=mx.int64)))
        ]
        width = max(1, max(lengths))
        padded = mx.array(list(data) + [0] * (width - len(data)), dtype=mx.uint8)
        rows = memoryview(self.all_gather(padded[None]))  # type: ignore[arg-type]
        flat = rows.cast("B")
        return [bytes(flat[i * width : i * width + n]) for i, n in enumerate(lengths)]

    def gather_json(self, value: Any) -> list[Any]:
        """Every rank's JSON-able ``value``, in rank order."""
        return [json.loads(b) for b in self.gather_bytes(json.dumps(value).encode())]

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (the others' are ignored)."""
        return self.gather_json(value if self.rank == 0 else None)[0]

    def all_true(self, flags: list[bool]) -> list[bool]:
        """For each position: whether every rank's flag is true."""
        if not self.sharded or not flags:
            return list(flags)
        ok = self.all_gather(mx.array([1 if f else 0 for f in flags], dtype=mx.int32)[None])
        return [bool(v) for v in self._numbers(mx.min(ok, axis=0))]

    @staticmethod
    def _numbers(x: mx.array) -> list:
        """A 1-D array's values (mlx's stubs type ``tolist`` as any nesting)."""
        return cast(list, x.tolist())

    def barrier(self) -> None:
        self.all_gather(mx.array([0], dtype=mx.int32))
