"""One rank's slice of a snapshot, reading only the bytes of that slice.

A rank of a sharded model holds some KV heads of every layer (tensor parallel) or some layers
(pipeline): ``ShardView.cut`` says which tensors and rows. A block written with row digests
(``kvsnap.snapshot.rows``) is read header first, then only those rows, each checked against
its digest: what is served is what was checked, and no byte of another rank's slice is read.
A file without row digests (written before them) is read and checked whole, then cut. The
bytes read are counted in a ``ReadMeter`` (the measure of "≤ 1/N of the store per rank").
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsnap.errors import SnapshotError
from kvsnap.faults import damaged_on_rank
from kvsnap.snapshot.chain import inspect_part
from kvsnap.snapshot.file import Header, parse_header, read_into
from kvsnap.snapshot.format import DTYPES
from kvsnap.snapshot.rows import RowDigests, row_count
from kvsnap.snapshot.shard_view import Cut, ShardError, ShardView
from kvsnap.store.checking import expect_part
from kvsnap.store.fileio import StoreFiles, check_regular, read_whole, unfilled_buffer
from kvsnap.store.part_readers import on_mlx_thread
from kvsnap.store.paths import part_path, part_relpath, part_relpath_of_file
from kvsnap.store.reading import part_read_errors


@dataclass
class ReadMeter:
    """Bytes a rank read from its store's files (headers included), and how many files."""

    nbytes: int = 0
    files: int = 0
    whole_files: int = 0  # read whole: no row digests (an older store)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, whole: bool = False) -> None:
        with self._lock:
            self.nbytes += nbytes
            self.files += 1
            self.whole_files += whole


@dataclass(frozen=True)
class _Range:
    name: str  # the tensor's local name
    dtype: str
    shape: tuple[int, ...]
    file_offset: int
    nbytes: int
    first_row: int
    entry: Any


def _ranges(header: Header, cuts: dict[str, Cut]) -> list[_Range]:
    out = []
    for name, cut in sorted(cuts.items()):
        entry = header.tensors[name]
        rows = row_count(entry.shape)
        row_bytes = entry.nbytes // rows
        lo, hi = cut.rows if cut.rows is not None else (0, rows)
        shape = entry.shape if cut.rows is None else (entry.shape[0], hi - lo, *entry.shape[2:])
        out.append(
            _Range(
                cut.local_name,
                entry.dtype,
                tuple(shape),
                header.data_start + entry.start + lo * row_bytes,
                (hi - lo) * row_bytes,
                lo,
                entry,
            )
        )
    return out


def read_part_slice(
    store: StoreFiles,
    kind: str,
    key: str,
    model_digest: str,
    start: int,
    end: int,
    prefix_digest: str,
    view: ShardView,
    layers: list,
    meter: ReadMeter,
    local: dict | None = None,
) -> dict:
    """This rank's tensors of one block or checkpoint (local names), read and checked; the
    header is checked as ``read_part`` checks it. ``layers``: the logical layer list at the
    chain's end. SnapshotError names the file; ShardError when the rank cannot take it. Safe on
    a pool thread of ``read_state_parts``: its mlx work runs on the thread that owns the read."""
    path = part_path(store, kind, key)
    check_regular(path, store.root)
    with part_read_errors(path, kind), open(path, "rb") as f:
        header = parse_header(f, os.fstat(f.fileno()).st_size)
        expect_part(inspect_part(path, header), kind, model_digest, start, end, prefix_digest)
        digests = RowDigests.of(header)
        if digests is None:
            return _cut_whole(path, view, layers, meter, local)
        cuts = view.cut(layers, {n: e.shape for n, e in header.tensors.items()}, local)
        ranges = _ranges(header, cuts)
        total = sum(r.nbytes for r in ranges)
        buf, whole = on_mlx_thread(unfilled_buffer, total)
        at = 0
        damaged = damaged_on_rank(view.rank, part_relpath(kind, key))
        for r in ranges:
            part = whole[at : at + r.nbytes]
            read_into(f.fileno(), part, r.file_offset)
            if damaged and r.nbytes:
                part[0] ^= 0xFF  # a fault test's damaged copy on this rank's host
            digests.check(r.entry, r.first_row, part)
            at += r.nbytes
        meter.add(header.data_start + total)
    return on_mlx_thread(_range_views, buf, ranges)


def _range_views(buf: Any, ranges: list[_Range]) -> dict:
    """Each range's tensor as a view of ``buf`` (the ranges back to back), evaluated here."""
    import mlx.core as mx

    arrays = {}
    at = 0
    for r in ranges:
        arrays[r.name] = (
            buf[at : at + r.nbytes].view(getattr(mx, DTYPES[r.dtype][0])).reshape(r.shape)
        )
        at += r.nbytes
    mx.eval(list(arrays.values()))
    return arrays


def _cut_whole(
    path: Path, view: ShardView, layers: list, meter: ReadMeter, local: dict | None
) -> dict:
    """A file without row digests: read and checksummed whole, then this rank's slice taken."""
    from kvsnap.snapshot.file import verify_checksum

    header, buf, data = read_whole(path)
    if damaged_on_rank(view.rank, part_relpath_of_file(path)) and len(data):
        data[0] ^= 0xFF  # a fault test's damaged copy on this rank's host
    verify_checksum(header, data)
    meter.add(header.file_size, whole=True)
    cuts = view.cut(layers, {n: e.shape for n, e in header.tensors.items()}, local)
    return on_mlx_thread(_cut_views, buf, header, cuts)


def _cut_views(buf: Any, header: Header, cuts: dict[str, Cut]) -> dict:
    import mlx.core as mx

    arrays = {}
    for name, cut in cuts.items():
        e = header.tensors[name]
        a = buf[e.start : e.end].view(getattr(mx, DTYPES[e.dtype][0])).reshape(e.shape)
        if cut.rows is not None:
            a = mx.contiguous(a[:, cut.rows[0] : cut.rows[1]])
        arrays[cut.local_name] = a
    mx.eval(list(arrays.values()))
    return arrays


def load_shard_state(
    store: Any,
    info: Any,
    expected: Any,
    view: ShardView,
    meter: ReadMeter,
    local: dict | None = None,
) -> tuple[dict, list]:
    """This rank's arrays (local names, tokens included) and local layer list of a snapshot,
    the record checked as ``Store.load_arrays`` checks it. SnapshotError names the bad file;
    ShardError (a UsageError) names this rank's topology and the snapshot it cannot take."""
    import mlx.core as mx

    from kvsnap.snapshot.format import TOKENS
    from kvsnap.store.paths import chain_of, end_checkpoint
    from kvsnap.store.reading import read_state_parts

    try:
        local_layers = view.local_layers(info.layers)
        if info.chain is None:  # a whole-file snapshot (v2): read whole, then cut
            arrays = store.load_arrays(info, expected)
            meter.add(info.path.stat().st_size, whole=True)
            cuts = view.cut(info.layers, {n: tuple(a.shape) for n, a in arrays.items()}, local)
            out = {TOKENS: arrays[TOKENS]}
            for name, cut in cuts.items():
                a = arrays[name]
                out[cut.local_name] = a if cut.rows is None else a[:, cut.rows[0] : cut.rows[1]]
            mx.eval(list(out.values()))
            return out, local_layers
        current = store.verify_file(info.path, expected, parts=False)
        meter.add(info.path.stat().st_size)
        if (current.key, current.layers, current.n_tokens, current.chain) != (
            info.key,
            info.layers,
            info.n_tokens,
            info.chain,
        ):
            raise SnapshotError(
                str(info.path),
                f"now holds another snapshot (key {current.key}) than the one indexed ({info.key})",
                "restart, or rebuild it with `kvsnap build`",
            )

        def fetch(kind: str, key: str, start: int, end: int, digest: str):
            arrays = read_part_slice(
                store,
                kind,
                key,
                info.model_digest,
                start,
                end,
                digest,
                view,
                info.layers,
                meter,
                local,
            )
            return arrays, local_layers

        spans = chain_of(info).spans(info.n_tokens)
        blocks, whole, _ = read_state_parts(
            store,
            str(info.path),
            info.model_digest,
            spans,
            end_checkpoint(info),
            local_layers,
            fetch,
        )
    except ShardError as exc:
        raise ShardError(
            f"{view.describe()} cannot take snapshot {info.path} of this model: {exc}"
        ) from None
    from kvsnap.snapshot.cache_classes import split_tensor_names

    sliced, kept = split_tensor_names(local_layers)
    out = {TOKENS: mx.array(list(info.tokens[: info.n_tokens]), dtype=mx.int32)}
    for name in sliced:
        pieces = [arrays[name] for arrays in blocks]
        out[name] = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-2)
    out.update({name: whole[name] for name in kept})
    mx.eval(list(out.values()))
    return out, local_layers


__all__ = ["ReadMeter", "ShardError", "load_shard_state", "read_part_slice"]
