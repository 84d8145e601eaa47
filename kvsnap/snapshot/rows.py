"""Per-row digests of a part file's tensors, so a rank of a sharded server can check exactly the
bytes of its slice without reading the rest of the file. No mlx here.

A tensor's *rows* are its entries along axis 1 when axis 0 is 1 (``[1, heads, tokens, dim]``:
one row per KV head, each a contiguous run of bytes); any other tensor is one row. Under
tensor parallelism a rank holds a contiguous range of KV heads, so its slice of a block is a
contiguous run of whole rows of each tensor. The header's ``kvsnap.row_digests`` maps each
tensor name to its rows' xxh3-64 digests (16 hex digits each, concatenated); the whole-file
checksum still covers everything, and a file without the field is read and checked whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

import xxhash

from kvsnap.snapshot.file import FormatError, Header, OutTensor, TensorEntry
from kvsnap.snapshot.format import ROW_DIGESTS
from kvsnap.snapshot.header_fields import json_field

DIGEST_CHARS = 16
# A real part has a few hundred tensors of at most a few hundred heads each.
MAX_ROW_DIGESTS_CHARS = 8 << 20


def row_count(shape: tuple[int, ...]) -> int:
    """How many rows a tensor of ``shape`` has: its heads when it is ``[1, heads, ...]`` with at
    least three axes, else one."""
    return shape[1] if len(shape) >= 3 and shape[0] == 1 and shape[1] > 0 else 1


def row_digest(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def row_digests_field(tensors: Iterable[OutTensor]) -> str:
    """The ``kvsnap.row_digests`` value for the tensors a part file is about to hold."""
    out = {}
    for t in tensors:
        rows = row_count(t.shape)
        size = t.nbytes // rows
        data = t.data.cast("B") if t.data.format != "B" else t.data
        out[t.name] = "".join(row_digest(data[i * size : (i + 1) * size]) for i in range(rows))
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class RowDigests:
    """A header's row digests, checked against its tensor entries."""

    by_name: dict[str, str]

    @classmethod
    def of(cls, header: Header) -> "RowDigests | None":
        """The header's row digests; None when it has none (an older file: read it whole);
        FormatError when the field does not fit the tensors the header lists."""
        if ROW_DIGESTS not in header.metadata:
            return None
        doc = json_field(header.metadata, ROW_DIGESTS, MAX_ROW_DIGESTS_CHARS)
        if not isinstance(doc, dict) or set(doc) != set(header.tensors):
            raise FormatError(
                f"{ROW_DIGESTS} does not name exactly the file's {len(header.tensors)} tensors"
            )
        for name, digests in doc.items():
            rows = row_count(header.tensors[name].shape)
            if not isinstance(digests, str) or len(digests) != rows * DIGEST_CHARS:
                raise FormatError(
                    f"{ROW_DIGESTS}[{name!r}] is not {rows} digests of {DIGEST_CHARS} hex digits"
                )
        return cls(doc)

    def check(self, entry: TensorEntry, first_row: int, data: memoryview) -> None:
        """Raise FormatError unless ``data`` (rows ``first_row``… of ``entry``) hashes to the
        recorded digests."""
        size = entry.nbytes // row_count(entry.shape)
        recorded = self.by_name[entry.name]
        for i in range(len(data) // size if size else 0):
            row = first_row + i
            want = recorded[row * DIGEST_CHARS : (row + 1) * DIGEST_CHARS]
            if row_digest(data[i * size : (i + 1) * size]) != want:
                raise FormatError(
                    f"tensor {entry.name} row {row} does not hash to its recorded digest: the "
                    f"file is corrupt"
                )
