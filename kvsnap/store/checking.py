"""Checking a store's files without loading them (no mlx): a record's data checksum, layer
offsets and model; a block's or checkpoint's header, span and checksum against the chain that
names it; which stored parts a write must replace; what a process knows of its parts' health.

A part checked (or read, or written) once is remembered where a caller asks for it
(``PartHealth``), so a path that reaches one part many times checks it once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Protocol, Sequence

from kvsnap.errors import SnapshotError
from kvsnap.key import ModelIdentity
from kvsnap.snapshot.blocks import ChainLink
from kvsnap.snapshot.cache_classes import split_tensor_names
from kvsnap.snapshot.chain import PartInfo, inspect_part
from kvsnap.snapshot.file import FormatError, check_data, read_header
from kvsnap.snapshot.format import BLOCK_KIND, CHECKPOINT_KIND
from kvsnap.snapshot.header import SnapshotInfo
from kvsnap.snapshot.layer_list import check_offsets
from kvsnap.store.fileio import StoreFiles, check_regular
from kvsnap.store.foreign import require_model
from kvsnap.store.paths import FIX, chain_of, has_part, part_path


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

    def is_good(self, kind: str, key: str) -> bool:
        with self._lock:
            return (kind, key) in self._good

    def bad_parts(self) -> frozenset:
        with self._lock:
            return frozenset(self._bad)

    def good_parts(self) -> frozenset:
        with self._lock:
            return frozenset(self._good)

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


class RemembersChecks(StoreFiles, Protocol):
    """A store that may carry what was checked through it (``Store.checks_remembered``)."""

    checked: PartHealth | None


def expect_part(
    info: PartInfo,
    kind: str,
    model_digest: str | None,
    start: int | None,
    end: int | None,
    prefix_digest: str | None,
) -> None:
    """FormatError unless the part's own header is the part the chain names."""
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
        expect_part(info, kind, model_digest, start, end, prefix_digest)
        check_data(path, header)
    except FormatError as exc:
        raise SnapshotError(str(path), str(exc), FIX) from None
    except OSError as exc:
        raise SnapshotError(
            str(path), f"cannot be read ({exc.strerror or exc})", "check the file's permissions"
        ) from None
    return info, header.tensors


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


def verify_record(
    store: StoreFiles, info: SnapshotInfo, expected: ModelIdentity | None, parts: bool
) -> SnapshotInfo:
    """The rest of a full check, after the header (``reading.inspect_record`` made ``info``):
    the data checksum, offsets, the model, and (``parts``) every block and checkpoint."""
    path = info.path
    try:
        check_data(path, read_header(path))
        check_offsets(info.layers, info.n_tokens)
    except FormatError as exc:
        raise SnapshotError(str(path), str(exc)) from None
    require_model(info, expected)
    if info.chain is not None and parts:
        verify_chain(store, info)
    return info


def bad_present_parts(store: RemembersChecks, model_digest: str, links: Sequence[ChainLink]) -> set:
    """Keys of the stored blocks and checkpoints of ``links`` that fail their checks (header,
    span, checksum): a write-back rewrites them rather than naming them again. A part the
    store's ``checked`` knows is not checked again (a warm-up's shared blocks)."""
    seen = store.checked
    bad: set[str] = set()
    for link in links:
        if has_part(store, BLOCK_KIND, link.key) and not _known(seen, BLOCK_KIND, link.key, bad):
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
                _remember(seen, BLOCK_KIND, link.key, good=True)
            except SnapshotError:
                bad.add(link.key)
                _remember(seen, BLOCK_KIND, link.key, good=False)
        key = link.checkpoint_key
        if (
            key
            and has_part(store, CHECKPOINT_KIND, key)
            and not _known(seen, CHECKPOINT_KIND, key, bad)
        ):
            try:
                check_checkpoint(store, key, model_digest, link.end, link.prefix_digest)
                _remember(seen, CHECKPOINT_KIND, key, good=True)
            except SnapshotError:
                bad.add(key)
                _remember(seen, CHECKPOINT_KIND, key, good=False)
    return bad


def _known(seen: PartHealth | None, kind: str, key: str, bad: set) -> bool:
    """Whether ``seen`` already holds the verdict on this part (a bad one joins ``bad``)."""
    if seen is None:
        return False
    if seen.is_bad(kind, key):
        bad.add(key)
        return True
    return seen.is_good(kind, key)


def _remember(seen: PartHealth | None, kind: str, key: str, good: bool) -> None:
    if seen is not None:
        if good:
            seen.mark_good([(kind, key)])
        else:
            seen.mark_bad(kind, key)
