"""Reading a store's files: a record's header (one open, one parse), the records of a scan,
a record's tokens and its state, and the blocks and checkpoints a chain names, each checked as
it is read (header against itself and the chain, checksum over exactly the bytes returned).

A v3 record's state is assembled from its parts: the block slices concatenated along the token
axis and the last checkpoint added, the same named arrays a v2 file held, so everything
downstream decodes them unchanged. Only the readers of state import mlx. ``read_part`` is
looked up on this module when called (``runtime.cache.composed`` too), so tests count reads.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from kvsnap.errors import SnapshotError
from kvsnap.key import ModelIdentity, unpack_tokens
from kvsnap.snapshot.cache_classes import split_tensor_names
from kvsnap.snapshot.chain import PartInfo, inspect_part
from kvsnap.snapshot.file import (
    FormatError,
    finish_checksum,
    header_of_bytes,
    parse_header,
    read_header,
    tensor_bytes,
    verify_checksum,
)
from kvsnap.snapshot.format import BLOCK_KIND, CHECKPOINT_KIND, DTYPES, TOKENS
from kvsnap.snapshot.header import MAX_TOKENS, SnapshotInfo, check_token_count, inspect_header
from kvsnap.snapshot.layer_list import check_offsets
from kvsnap.store.checking import expect_part
from kvsnap.store.fileio import (
    StoreFiles,
    check_regular,
    read_tensors,
    read_whole,
    unfilled_tensors,
)
from kvsnap.store.foreign import Problem, classify, require_model
from kvsnap.store.part_readers import on_mlx_thread, run_concurrently
from kvsnap.store.paths import (
    FIX,
    chain_of,
    chain_relpaths,
    end_checkpoint,
    part_path,
    record_files,
)
from kvsnap.store.tier_values import ReceivedPart

# --- records --------------------------------------------------------------------------------


@contextlib.contextmanager
def record_read_errors(path: Path) -> Iterator[None]:
    """A record's read failures as the SnapshotError that names the file: a format error's
    reason, or that it cannot be read (every reader of a whole record reports them alike)."""
    try:
        yield
    except FormatError as exc:
        raise SnapshotError(str(path), str(exc)) from None
    except OSError as exc:
        raise SnapshotError(
            str(path), f"cannot be read ({exc.strerror or exc})", "check the file's permissions"
        ) from None


def inspect_record(store: StoreFiles, path: Path, max_tokens: int = MAX_TOKENS) -> SnapshotInfo:
    """Header checks only (cheap), tokens included, from one open and one header parse;
    raises SnapshotError naming the file and the reason. ``max_tokens`` bounds the token
    count before the tokens are read (the model's context, when the caller knows it)."""
    check_regular(path, store.root)
    with record_read_errors(path):
        with open(path, "rb") as f:
            header = parse_header(f, os.fstat(f.fileno()).st_size)
            check_token_count(header, max_tokens)
            tok = header.tensors.get(TOKENS)
            raw = None
            if tok is not None:  # its bounds were checked against the file size by parse_header
                f.seek(header.data_start + tok.start)
                raw = f.read(tok.nbytes)
        info = inspect_header(path, header, raw, max_tokens)
    # a record's size is its state's: its blocks and checkpoints (a stat each)
    if info.chain is not None:
        info = replace(
            info,
            nbytes=info.nbytes + sum(_size(store.root / rel) for rel in chain_relpaths(info)),
        )
    return info


def scan_records(
    store: StoreFiles, expected: ModelIdentity | None = None, max_tokens: int = MAX_TOKENS
) -> tuple[list[SnapshotInfo], list[Problem]]:
    """Header-only scan of every record; foreign ones are problems only when ``expected`` is
    given."""
    infos, bad = [], []
    for path in record_files(store):
        try:
            infos.append(inspect_record(store, path, max_tokens))
        except SnapshotError as exc:
            bad.append(Problem(path, exc.reason))
    good, foreign = classify(infos, expected)
    return good, bad + foreign


def read_tokens(info: SnapshotInfo) -> list[int]:
    """The token ids a snapshot holds: from the index when it has them, else from the file (no
    mlx)."""
    if info.tokens or info.n_tokens == 0:
        return list(info.tokens)
    try:
        raw = tensor_bytes(info.path, read_header(info.path), TOKENS)
    except (FormatError, KeyError) as exc:
        raise SnapshotError(str(info.path), f"tokens cannot be read ({exc})") from None
    except OSError as exc:
        raise SnapshotError(str(info.path), f"cannot be read ({exc.strerror or exc})") from None
    return unpack_tokens(raw)


def load_record(store: StoreFiles, info: SnapshotInfo, expected: ModelIdentity | None) -> dict:
    """Read the file once into mlx memory, checksum exactly those bytes, and view the tensors.

    One open file, one copy: the header is parsed and the data read through the same
    descriptor straight into an mlx buffer (nothing is memory-mapped), the checksum is
    computed over those very bytes, and the tensors are zero-copy views of the buffer.
    So what is verified is what is served, even if the file is replaced meanwhile.
    """
    import mlx.core as mx

    path = info.path
    check_regular(path, store.root)
    with record_read_errors(path):
        header, buf, view = read_whole(path)
        tok = header.tensors.get(TOKENS)
        # The tokens come from the bytes just read: one open, one parse, one read.
        current = inspect_header(
            path, header, bytes(view[tok.start : tok.end]) if tok is not None else None
        )
        verify_checksum(header, view)
        check_offsets(current.layers, current.n_tokens)
        if (
            current.key != info.key
            or current.layers != info.layers
            or current.n_tokens != info.n_tokens
            or current.chain != info.chain
        ):
            raise SnapshotError(
                str(path),
                f"now holds another snapshot (key {current.key}) than the one indexed ({info.key})",
                "restart, or rebuild it with `kvsnap build`",
            )
        require_model(current, expected)
    # a v3 record (just read and checked): its state is in blocks and checkpoints
    if current.chain is not None:
        return assemble(store, current)[0]
    arrays = {}
    for name, entry in header.tensors.items():
        arrays[name] = (
            buf[entry.start : entry.end]
            .view(getattr(mx, DTYPES[entry.dtype][0]))
            .reshape(entry.shape)
        )
    mx.eval(list(arrays.values()))
    return arrays


def _size(path: Path) -> int:
    """A file's size, 0 when it is missing (reading it later names the problem)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


# --- blocks and checkpoints -----------------------------------------------------------------


def read_part(
    store: StoreFiles,
    kind: str,
    key: str,
    model_digest: str,
    start: int,
    end: int,
    prefix_digest: str | None = None,
) -> tuple[PartInfo, dict]:
    """One open and one read into mlx memory nothing wrote before; the header checked against
    itself and against what the chain expects (model, span, prefix), the checksum over exactly
    the bytes returned. Safe on a pool thread of ``read_state_parts``: its mlx work (the buffer,
    the views) runs on the thread that owns the read."""
    path = part_path(store, kind, key)
    check_regular(path, store.root)
    with part_read_errors(path, kind):
        header, arrays, checksum = read_tensors(path)
        info = inspect_part(path, header)
        expect_part(info, kind, model_digest, start, end, prefix_digest)
        finish_checksum(header, checksum)
    return info, arrays


def part_from_bytes(
    store: StoreFiles,
    kind: str,
    key: str,
    model_digest: str,
    start: int,
    end: int,
    prefix_digest: str | None,
    data: bytes | memoryview | ReceivedPart,
) -> tuple[PartInfo, dict]:
    """``read_part`` for a part held in memory (a shared tier's fetch): the header checked
    against what the chain expects, the data copied once into fresh mlx memory. ``data`` is
    immutable bytes whose checksum was checked when they arrived (``check_part_bytes``), or
    a ``ReceivedPart`` already in mlx memory (its tensors used as they are)."""
    path = part_path(store, kind, key)
    with part_read_errors(path, kind):
        if isinstance(data, ReceivedPart):
            header, raw, held = data.header, None, data.held
        else:
            header, raw, held = header_of_bytes(data), memoryview(data), {}
        info = inspect_part(path, header)
        expect_part(info, kind, model_digest, start, end, prefix_digest)
        if raw is None:  # received into mlx memory and checked there: used as it is, no copy
            return info, held
        view, arrays = on_mlx_thread(unfilled_tensors, header)
        view[:] = raw[header.data_start : header.data_start + header.data_len]
    return info, arrays


@contextlib.contextmanager
def part_read_errors(path: Path, kind: str) -> Iterator[None]:
    """A part's read failures as the SnapshotError that names the file and the fix (every
    reader of a chain's parts, whole or a rank's slice, reports them alike)."""
    try:
        yield
    except FormatError as exc:
        raise SnapshotError(str(path), str(exc), FIX) from None
    except FileNotFoundError:
        raise SnapshotError(str(path), f"is missing (the chain names this {kind})", FIX) from None
    except OSError as exc:
        raise SnapshotError(
            str(path), f"cannot be read ({exc.strerror or exc})", "check the file's permissions"
        ) from None


Span = tuple[str, int, int, str]  # a block: (key, start, end, prefix digest at end)
# (kind, key, start, end, digest) -> (arrays, layers)
Fetch = Callable[[str, str, int, int, str], tuple[dict, "list | None"]]


def read_state_parts(
    store: StoreFiles,
    where: str,
    model_digest: str,
    spans: Sequence[Span],
    checkpoint: str | None,
    layers: list | None,
    fetch: Fetch | None = None,
) -> tuple[list[dict], dict, list]:
    """The arrays of each block of ``spans`` (tiling [0, n)) and of the ``checkpoint`` at n (its
    key, or None), and the layer list at n: ``layers`` when known (a record's end), else the
    checkpoint's, else the last block's (attention-only models). Every part is checked against
    the chain and that layer list; SnapshotError names the first bad one (in chain order, the
    checkpoint first). ``fetch`` gets a part (default: ``read_part`` from its file; the server's
    pool passes one that reuses held blocks). The parts are fetched at once, up to
    ``MAX_READERS`` on pool threads (``part_readers.run_concurrently``): a fetch must be safe
    to call from several threads, and does its mlx work through ``on_mlx_thread``."""

    def read(kind: str, key: str, start: int, end: int, digest: str) -> tuple[dict, list | None]:
        part, arrays = read_part(store, kind, key, model_digest, start, end, digest)
        return arrays, part.layers

    get = fetch or read
    n = spans[-1][2]
    wanted = [(BLOCK_KIND, key, start, end, digest) for key, start, end, digest in spans]
    if checkpoint is not None:
        wanted.insert(0, (CHECKPOINT_KIND, checkpoint, 0, n, spans[-1][3]))
    fetched = run_concurrently([functools.partial(get, *part) for part in wanted])
    whole_arrays: dict = {}
    if checkpoint is not None:
        whole_arrays, part_layers = fetched.pop(0)
        layers = layers if layers is not None else part_layers
    blocks = []
    for (_, _, end, _), (arrays, part_layers) in zip(spans, fetched):
        if layers is None and end == n:
            layers = part_layers
        blocks.append(arrays)
    if layers is None:
        raise SnapshotError(
            where, f"has no layer list at {n} tokens (a hybrid model restores only at a checkpoint)"
        )
    sliced, whole = split_tensor_names(layers)
    for (key, start, end, _), arrays in zip(spans, blocks):
        bad = [
            name
            for name in sliced
            if name not in arrays or arrays[name].ndim < 2 or arrays[name].shape[-2] != end - start
        ]
        if bad:
            raise SnapshotError(
                str(part_path(store, BLOCK_KIND, key)),
                f"tensor {bad[0]} is missing or not {end - start} tokens long",
                FIX,
            )
    missing = [name for name in whole if name not in whole_arrays]
    if missing:
        raise SnapshotError(where, f"its checkpoint at {n} lacks tensor {missing[0]}", FIX)
    return blocks, whole_arrays, layers


def assemble_state(
    store: StoreFiles,
    where: str,
    model_digest: str,
    tokens: Sequence[int],
    spans: Sequence[Span],
    checkpoint: str | None,
    layers: list | None,
) -> tuple[dict, list]:
    """The named arrays and layer list of the state after ``spans``: the attention slices
    concatenated along the token axis, the other layers whole from ``checkpoint`` (at n)."""
    import mlx.core as mx

    blocks, whole_arrays, layers = read_state_parts(
        store, where, model_digest, spans, checkpoint, layers
    )
    sliced, whole = split_tensor_names(layers)
    out = {TOKENS: mx.array(list(tokens[: spans[-1][2]]), dtype=mx.int32)}
    for name in sliced:
        pieces = [arrays[name] for arrays in blocks]
        out[name] = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-2)
    out.update({name: whole_arrays[name] for name in whole})
    mx.eval(list(out.values()))
    return out, layers


def assemble(store: StoreFiles, info: SnapshotInfo) -> tuple[dict, list]:
    """A v3 record's whole state: the arrays a v2 file of it would hold, and its layer list."""
    return assemble_state(
        store,
        str(info.path),
        info.model_digest,
        info.tokens,
        chain_of(info).spans(info.n_tokens),
        end_checkpoint(info),
        info.layers,
    )
