"""Writing a store's files, each atomically (temp file, fsync, rename, fsync the folder): a
record, a block or checkpoint, and the parts a chain lacks. The caller holds the store lock.
mlx only through ``snapshot.codec``, imported where a chain is written."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvsnap.errors import StoreError
from kvsnap.snapshot.blocks import ChainLink
from kvsnap.snapshot.cache_classes import split_tensor_names
from kvsnap.snapshot.file import OutTensor, write_snapshot
from kvsnap.snapshot.format import BLOCK_KIND, CHECKPOINT_KIND, ROW_DIGESTS, part_metadata
from kvsnap.snapshot.header import MAX_NAME_CHARS
from kvsnap.snapshot.rows import row_digests_field
from kvsnap.store.checking import RemembersChecks
from kvsnap.store.fileio import StoreFiles, atomic_write
from kvsnap.store.paths import has_part, part_path, record_path


def put_record(
    store: StoreFiles, key: str, tensors: list[OutTensor], metadata: dict[str, str]
) -> Path:
    """Write one record (``snapshots/<key>``) atomically. The caller holds the lock."""
    target = record_path(store, key)
    name = metadata.get("kvsnap.name", "")
    if len(name) > MAX_NAME_CHARS:  # never write a file the reader would refuse
        raise StoreError(
            f"agent name {name[:40]!r}... is {len(name)} characters, over the {MAX_NAME_CHARS} "
            f"a snapshot may hold; give the agent a shorter name"
        )
    try:
        atomic_write(
            target,
            lambda f: write_snapshot(f, tensors, metadata, on_progress=store.fault),
            store.fault,
            store.fsync,
        )
    except OSError as exc:
        hint = (
            "free some disk space"
            if exc.errno == errno.ENOSPC
            else "check the folder's permissions"
        )
        raise StoreError(
            f"cannot write snapshot {target} ({exc.strerror or exc}); the store is unchanged; "
            f"{hint}"
        ) from exc
    store.fault("after-rename")
    return target


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
    store: RemembersChecks,
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
    keys written even though a file is there (found bad); None rewrites every one. What is
    written is known good to the store's ``checked``, when it has one."""
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
            if store.checked is not None:
                store.checked.mark_good([(BLOCK_KIND, link.key)])
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
            if store.checked is not None:
                store.checked.mark_good([(CHECKPOINT_KIND, link.checkpoint_key)])
    return done
