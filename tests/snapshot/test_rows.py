"""Per-row digests: written for every tensor of a part, checked row by row on a slice read, and a
field that does not fit the file's tensors refused by name."""

from __future__ import annotations

import io
import json

import pytest

from kvsnap.snapshot.file import FormatError, OutTensor, parse_header, write_snapshot
from kvsnap.snapshot.format import ROW_DIGESTS
from kvsnap.snapshot.rows import RowDigests, row_count, row_digests_field


def _file(tensors: list[OutTensor], field: str | None = None):
    metadata = {ROW_DIGESTS: field if field is not None else row_digests_field(tensors)}
    f = io.BytesIO()
    write_snapshot(f, tensors, metadata)
    raw = f.getvalue()
    return parse_header(io.BytesIO(raw), len(raw)), raw


def _tensor(name: str, shape: tuple, fill: int = 1) -> OutTensor:
    n = 1
    for d in shape:
        n *= d
    return OutTensor(name, "F32", shape, memoryview(bytes([fill]) * (4 * n)))


def test_rows_are_heads_of_batch_one_tensors_else_the_whole_tensor():
    assert row_count((1, 8, 256, 128)) == 8
    assert row_count((1, 3, 256)) == 3
    assert row_count((2, 8, 4, 4)) == 1
    assert row_count((16,)) == 1


def test_each_row_is_checked_and_a_flipped_byte_names_tensor_and_row():
    header, raw = _file([_tensor("0.keys", (1, 4, 2, 2)), _tensor("tokens", (3,))])
    digests = RowDigests.of(header)
    entry = header.tensors["0.keys"]
    data = bytearray(raw[header.data_start + entry.start : header.data_start + entry.end])
    row = entry.nbytes // 4
    digests.check(entry, 2, memoryview(data)[2 * row : 4 * row])  # rows 2-3: this rank's
    data[3 * row] ^= 1
    with pytest.raises(FormatError, match=r"tensor 0\.keys row 3 does not hash"):
        digests.check(entry, 2, memoryview(data)[2 * row : 4 * row])


def test_a_file_without_row_digests_is_read_whole_and_a_wrong_field_is_refused():
    f = io.BytesIO()
    write_snapshot(f, [_tensor("0.keys", (1, 2, 2, 2))], {})
    raw = f.getvalue()
    assert RowDigests.of(parse_header(io.BytesIO(raw), len(raw))) is None
    t = [_tensor("0.keys", (1, 2, 2, 2))]
    for bad in ("[]", json.dumps({"other": "0" * 32}), json.dumps({"0.keys": "0" * 31}), "{"):
        header, _ = _file(t, bad)
        with pytest.raises(FormatError, match=ROW_DIGESTS):
            RowDigests.of(header)
