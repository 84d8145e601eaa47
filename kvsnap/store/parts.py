"""Blocks and checkpoints in a store: writing the ones a chain lacks, reading and checking them,
and assembling a v3 record's state from them.

A record (``snapshots/<key>.safetensors``, format 3) holds tokens and a chain; its state is
in ``blocks/`` (the attention KV of each run of tokens) and ``checkpoints/`` (the whole state of
layers that cannot be sliced, at chosen token counts). Assembly concatenates the block slices
along the token axis and adds the last checkpoint: the same named arrays a v2 file held, so
everything downstream decodes them unchanged. Only the readers import mlx.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from kvsnap.errors import SnapshotError, StoreError
from kvsnap.snapshot.blocks import ChainLink
from kvsnap.snapshot.cache_classes import split_tensor_names
from kvsnap.snapshot.chain import Chain, PartInfo, inspect_part
from kvsnap.snapshot.file import (
    FormatError,
    OutTensor,
    check_data,
    finish_checksum,
    header_of_bytes,
    read_header,
    write_snapshot,
)
from kvsnap.snapshot.format import (
    BLOCK_KIND,
    BLOCKS,
    CHECKPOINT_KIND,
    CHECKPOINTS,
    KEY_RE,
    ROW_DIGESTS,
    SUFFIX,
    TOKENS,
    block_relpath,
    checkpoint_relpath,
    part_metadata,
    snapshot_filename,
)
from kvsnap.snapshot.header import SnapshotInfo
from kvsnap.snapshot.rows import row_digests_field
from kvsnap.store.fileio import (
    StoreFiles,
    atomic_write,
    check_regular,
    read_tensors,
    store_files,
    unfilled_tensors,
)
from kvsnap.store.part_readers import on_mlx_thread, run_concurrently

FOLDER = {BLOCK_KIND: BLOCKS, CHECKPOINT_KIND: CHECKPOINTS}
FIX = "rebuild it with `kvsnap build` (the chain is prefilled from the last good block)"


def part_path(store: StoreFiles, kind: str, key: str) -> Path:
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise StoreError(f"{kind} key {key!r} is not 32 lowercase hex digits")
    return store.root / FOLDER[kind] / snapshot_filename(key)


def part_relpath(kind: str, key: str) -> str:
    return block_relpath(key) if kind == BLOCK_KIND else checkpoint_relpath(key)


def has_part(store: StoreFiles, kind: str, key: str) -> bool:
    """A regular file is there (its contents are checked when read)."""
    try:
        return stat.S_ISREG(part_path(store, kind, key).lstat().st_mode)
    except FileNotFoundError:
        return False


def part_of_path(store: StoreFiles, path: str | Path) -> tuple[str, str] | None:
    """(kind, key) of the block or checkpoint file ``path`` names in ``store``, else None
    (a record, or a file elsewhere)."""
    where = Path(path)
    for kind, folder in FOLDER.items():
        key = where.name.removesuffix(SUFFIX)
        if where.parent == store.root / folder and where.name.endswith(SUFFIX):
            return (kind, key) if KEY_RE.fullmatch(key) else None
    return None


@dataclass
class PartHealth:
    """What one server process has learned of its store's blocks and checkpoints: bad (a
    record reaching one failed to load on it) or good (written, loaded for a conversation,
    or checked here). The engine marks, the write-behind thread asks; a bad part is
    rewritten the next time a record reaching it is written, and until then no record is
    written naming it. Forgetting a good one (the bound) costs one more check."""

    max_good: int = 100_000
    _good: set = field(default_factory=set)
    _bad: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def mark_bad(self, kind: str, key: str) -> None:
        with self._lock:
            self._good.discard((kind, key))
            self._bad.add((kind, key))

    def mark_good(self, parts: Iterable[tuple[str, str]]) -> None:
        with self._lock:
            for part in parts:
                self._bad.discard(part)
                if len(self._good) >= self.max_good:
                    self._good.clear()
                self._good.add(part)

    def is_bad(self, kind: str, key: str) -> bool:
        with self._lock:
            return (kind, key) in self._bad

    def bad_parts(self) -> frozenset:
        with self._lock:
            return frozenset(self._bad)

    def sound(self, store: StoreFiles, kind: str, key: str) -> bool:
        """Whether a stored part may be named by a new record: known good, or its header and
        checksum checked now (once per process; a failure marks it bad)."""
        with self._lock:
            if (kind, key) in self._bad:
                return False
            if (kind, key) in self._good:
                return True
        try:
            check_part(store, kind, key)
        except SnapshotError:
            self.mark_bad(kind, key)
            return False
        self.mark_good([(kind, key)])
        return True


def part_files(store: StoreFiles) -> list[Path]:
    """Every block and checkpoint file (temp files excluded), sorted; StoreError when either
    folder is a symbolic link (``fileio.store_folder``)."""
    found = []
    for kind in (BLOCK_KIND, CHECKPOINT_KIND):
        found += store_files(store.root, FOLDER[kind], SUFFIX)
    return sorted(found)


def part_relpath_of_file(path: Path) -> str:
    """``blocks/<name>`` or ``checkpoints/<name>`` for a file in one of those folders."""
    return f"{path.parent.name}/{path.name}"


def chain_relpaths(info: SnapshotInfo) -> list[str]:
    """The block and checkpoint files a record reaches (none for a v2 file)."""
    if info.chain is None:
        return []
    return [block_relpath(k) for k, _, _ in info.chain.blocks] + [
        checkpoint_relpath(k) for k, _ in info.chain.checkpoints
    ]


# --- writing --------------------------------------------------------------------------------


@dataclass
class Written:
    blocks: int = 0
    checkpoints: int = 0
    nbytes: int = 0


def put_part(
    store: StoreFiles, kind: str, key: str, tensors: list[OutTensor], metadata: dict[str, str]
) -> int:
    """Write one block or checkpoint atomically (the caller holds the lock); returns its size.
    Its header carries each tensor's row digests, so a rank of a sharded model reads and checks
    only its own heads or layers (``store.shard_read``)."""
    target = part_path(store, kind, key)
    metadata = {**metadata, ROW_DIGESTS: row_digests_field(tensors)}
    try:
        atomic_write(
            target,
            lambda f: write_snapshot(f, tensors, metadata, on_progress=store.fault),
            store.fault,
            store.fsync,
        )
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            hint = "free some disk space"
        elif exc.errno == errno.EISDIR:  # no writer makes one: someone put it there
            hint = "a folder is in its place: move it out of the store"
        else:
            hint = "check the folder's permissions"
        raise StoreError(
            f"cannot write {kind} {target} ({exc.strerror or exc}); the store is unchanged; {hint}"
        ) from exc
    return target.stat().st_size


def block_metadata(link: ChainLink, model_digest: str, layers: list, dense: bool) -> dict[str, str]:
    """The header of ``link``'s block; ``layers``: the state's at the chain's end (a block
    names its layer list only when every layer is sliceable)."""
    from kvsnap.snapshot.cache_classes import layers_at

    return part_metadata(
        kind=BLOCK_KIND,
        key=link.key,
        model_digest=model_digest,
        start=link.start,
        end=link.end,
        prefix_digest=link.prefix_digest,
        layers=layers_at(layers, link.end) if dense else None,
        form=link.form,
    )


def checkpoint_metadata(link: ChainLink, model_digest: str, layers: list) -> dict[str, str]:
    """The header of the checkpoint at ``link``'s end; ``layers``: the state's there."""
    return part_metadata(
        kind=CHECKPOINT_KIND,
        key=link.checkpoint_key or "",
        model_digest=model_digest,
        start=0,
        end=link.end,
        prefix_digest=link.prefix_digest,
        layers=layers,
        form=link.form,
    )


def write_chain(
    store: StoreFiles,
    model_digest: str,
    links: Sequence[ChainLink],
    arrays: dict,
    layers: list,
    checkpoint_arrays: dict[int, tuple[dict, list]],
    dense: bool,
    replace: set | frozenset | None = frozenset(),
) -> Written:
    """Write every block and checkpoint of ``links`` the store lacks (the caller holds the lock).

    ``arrays``/``layers``: the state at the chain's end; blocks are its slices.
    ``checkpoint_arrays``:
    end -> (arrays, layers) captured there (the chain's end is taken from ``arrays``). ``replace``:
    keys written even though a file is there (found bad); None rewrites every one."""
    from kvsnap.snapshot.codec import to_out_tensors

    sliced, whole = split_tensor_names(layers)
    n = links[-1].end if links else 0
    done = Written()
    for link in links:
        if replace is None or link.key in replace or not has_part(store, BLOCK_KIND, link.key):
            part = {name: arrays[name][..., link.start : link.end, :] for name in sliced}
            meta = block_metadata(link, model_digest, layers, dense)
            done.nbytes += put_part(store, BLOCK_KIND, link.key, to_out_tensors(part), meta)
            done.blocks += 1
        if link.checkpoint_key and (
            replace is None
            or link.checkpoint_key in replace
            or not has_part(store, CHECKPOINT_KIND, link.checkpoint_key)
        ):
            # a chain names only what it has
            if link.end != n and link.end not in checkpoint_arrays:
                raise StoreError(
                    f"the checkpoint at {link.end} tokens ({link.checkpoint_key}) is neither in "
                    f"the store nor captured; the store is unchanged; run the build again"
                )
            state, state_layers = (arrays, layers) if link.end == n else checkpoint_arrays[link.end]
            part = {name: state[name] for name in whole}
            meta = checkpoint_metadata(link, model_digest, state_layers)
            done.nbytes += put_part(
                store, CHECKPOINT_KIND, link.checkpoint_key, to_out_tensors(part), meta
            )
            done.checkpoints += 1
    return done


def bad_present_parts(store: StoreFiles, model_digest: str, links: Sequence[ChainLink]) -> set:
    """Keys of the stored blocks and checkpoints of ``links`` that fail their checks (header,
    span, checksum): a write-back rewrites them rather than naming them again."""
    bad = set()
    for link in links:
        if has_part(store, BLOCK_KIND, link.key):
            try:
                check_part(
                    store,
                    BLOCK_KIND,
                    link.key,
                    model_digest,
                    link.start,
                    link.end,
                    link.prefix_digest,
                )
            except SnapshotError:
                bad.add(link.key)
        if link.checkpoint_key and has_part(store, CHECKPOINT_KIND, link.checkpoint_key):
            try:
                check_checkpoint(
                    store, link.checkpoint_key, model_digest, link.end, link.prefix_digest
                )
            except SnapshotError:
                bad.add(link.checkpoint_key)
    return bad


# --- reading --------------------------------------------------------------------------------


def _expect(
    info: PartInfo,
    kind: str,
    model_digest: str | None,
    start: int | None,
    end: int | None,
    prefix_digest: str | None,
) -> None:
    if (
        info.kind != kind
        or (model_digest and info.model_digest != model_digest)
        or (start is not None and (info.start, info.end) != (start, end))
        or (prefix_digest and info.prefix_digest != prefix_digest)
    ):
        raise FormatError(
            f"holds a {info.kind} of [{info.start}, {info.end}) for model {info.model_digest[:8]}, "
            f"not the {kind} of [{start}, {end}) the chain names"
        )


def check_part(
    store: StoreFiles,
    kind: str,
    key: str,
    model_digest: str | None = None,
    start: int | None = None,
    end: int | None = None,
    prefix_digest: str | None = None,
    path: Path | None = None,
) -> tuple[PartInfo, dict]:
    """A block's or checkpoint's header and checksum, streamed from the file (no mlx): its
    ``PartInfo`` and tensor entries. With the chain's expectations, checks it is that part."""
    path = path or part_path(store, kind, key)
    check_regular(path, store.root)
    try:
        header = read_header(path)
        info = inspect_part(path, header)
        _expect(info, kind, model_digest, start, end, prefix_digest)
        check_data(path, header)
    except FormatError as exc:
        raise SnapshotError(str(path), str(exc), FIX) from None
    except OSError as exc:
        raise SnapshotError(
            str(path), f"cannot be read ({exc.strerror or exc})", "check the file's permissions"
        ) from None
    return info, header.tensors


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
        _expect(info, kind, model_digest, start, end, prefix_digest)
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
    data: bytes | memoryview,
) -> tuple[PartInfo, dict]:
    """``read_part`` for a part held in memory (a shared tier's fetch): the header checked
    against what the chain expects, the data copied once into fresh mlx memory. ``data`` is
    immutable bytes whose checksum was checked when they arrived (``check_part_bytes``)."""
    path = part_path(store, kind, key)
    with part_read_errors(path, kind):
        header = header_of_bytes(data)
        info = inspect_part(path, header)
        _expect(info, kind, model_digest, start, end, prefix_digest)
        view, arrays = on_mlx_thread(unfilled_tensors, header)
        view[:] = memoryview(data)[header.data_start : header.data_start + header.data_len]
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


def chain_of(info: SnapshotInfo) -> Chain:
    """A v3 record's chain; these readers are only called on records that have one."""
    if info.chain is None:
        raise SnapshotError(
            str(info.path), "holds its own state, not a chain of blocks", "read it as a whole file"
        )
    return info.chain


def end_checkpoint(info: SnapshotInfo) -> str | None:
    """The key of a record's checkpoint at its end (hybrids), or None."""
    chain = chain_of(info)
    last = chain.checkpoints[-1] if chain.checkpoints else None
    return last[0] if last is not None and last[1] == info.n_tokens else None


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


def verify_chain(store: StoreFiles, info: SnapshotInfo) -> int:
    """Check every block and checkpoint a record reaches, streamed (no mlx): header, key, span,
    checksum, and tensors against the record's layer list. Returns their bytes."""
    sliced, whole = split_tensor_names(info.layers)
    chain, total = chain_of(info), 0
    for key, start, end, digest in chain.spans(info.n_tokens):
        part, tensors = check_part(store, BLOCK_KIND, key, info.model_digest, start, end, digest)
        _check_tensors(store, part, tensors, set(sliced), end - start)
        total += part_path(store, BLOCK_KIND, key).stat().st_size
    for key, end in chain.checkpoints:
        check_checkpoint(store, key, info.model_digest, end, chain.digest_at(end))
        total += part_path(store, CHECKPOINT_KIND, key).stat().st_size
    return total


def check_checkpoint(
    store: StoreFiles, key: str, model_digest: str, end: int, prefix_digest: str
) -> None:
    """A checkpoint's header, span, checksum and tensors (its layer list's whole layers),
    streamed (no mlx); SnapshotError names it."""
    part, tensors = check_part(store, CHECKPOINT_KIND, key, model_digest, 0, end, prefix_digest)
    _check_tensors(store, part, tensors, set(split_tensor_names(part.layers or [])[1]), None)


def _check_tensors(
    store: StoreFiles, part: PartInfo, tensors: dict, names: set, tokens: int | None
) -> None:
    path = str(part_path(store, part.kind, part.key))
    if set(tensors) != names:
        raise SnapshotError(
            path,
            f"holds tensors {sorted(set(tensors) - names)[:3] or sorted(names - set(tensors))[:3]} "
            f"the record's layers do not (or lacks them)",
            FIX,
        )
    if tokens is not None:
        for name, entry in tensors.items():
            if len(entry.shape) < 2 or entry.shape[-2] != tokens:
                raise SnapshotError(
                    path,
                    f"tensor {name} has shape {list(entry.shape)}, not {tokens} tokens on its "
                    f"token axis",
                    FIX,
                )


def reached_parts(infos: Iterable[SnapshotInfo]) -> set[str]:
    """Relative paths of every block and checkpoint these records reach."""
    return {rel for info in infos for rel in chain_relpaths(info)}
