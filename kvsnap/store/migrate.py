"""`kvsnap migrate`: turn a store's v2 whole-file snapshots into v3 records and shared blocks.

No model and no prefill: a v2 file holds the state at its end, so its attention KV is sliced
into blocks, and the layers only a checkpoint restores (hybrids, sliding windows) get one
checkpoint, at the end -- the only point a v2 file has. Branch points are computed over all
the files of each model, so prompts sharing a preamble share its blocks from then on. Each
record keeps its v2 file's key, name, prompt digest and recorded fields and replaces it
atomically (same name); its blocks land first. A file that fails its checks is left as it is
and reported. Files the vllm-mlx route wrote back are v2 files like any other.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kvsnap.errors import SnapshotError
from kvsnap.key import ModelIdentity
from kvsnap.snapshot.blocks import (
    BlockSettings,
    branch_points,
    chain_field,
    chain_of,
    kv_form,
    plan_cuts,
    without_checkpoint,
)
from kvsnap.snapshot.cache_classes import needs_checkpoints
from kvsnap.snapshot.file import read_header
from kvsnap.snapshot.format import (
    CHAIN,
    CHECKSUM_KEY,
    FORMAT_VERSION,
    TOKENS,
    WHOLE_FILE_FORMAT,
    encode_chain,
)
from kvsnap.snapshot.header import SnapshotInfo
from kvsnap.store.foreign import Problem
from kvsnap.store.local import Store
from kvsnap.store.writing import write_chain


@dataclass
class MigrateReport:
    migrated: list[Path] = field(default_factory=list)
    already: int = 0  # v3 records left as they were
    problems: list[Problem] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0


def migrate_store(
    root: str | Path, settings: BlockSettings = BlockSettings(), dry_run: bool = False
) -> MigrateReport:
    """Rewrite every v2 file of the store as a v3 record plus blocks; under the store lock."""
    store = Store.open(root).require_store()
    report = MigrateReport()
    infos, report.problems = store.scan()
    old = [i for i in infos if i.chain is None]
    report.already = len(infos) - len(old)
    if dry_run or not old:
        report.migrated = [i.path for i in old] if dry_run else []
        return report
    by_model: dict[str, list[SnapshotInfo]] = defaultdict(list)
    for info in old:
        by_model[info.model_digest].append(info)
    with store.lock():
        for infos_of_model in by_model.values():
            for info, branches in zip(
                infos_of_model, branch_points([i.tokens for i in infos_of_model])
            ):
                try:
                    report.bytes_before += info.nbytes
                    report.bytes_after += _migrate_one(store, info, branches, settings)
                    report.migrated.append(info.path)
                except SnapshotError as exc:
                    report.problems.append(Problem(info.path, exc.reason))
    return report


def _migrate_one(
    store: Store, info: SnapshotInfo, branches: set[int], settings: BlockSettings
) -> int:
    """One v2 file -> its blocks, its end checkpoint and a record under the same key; returns the
    bytes written."""
    from kvsnap.snapshot.codec import to_out_tensors

    arrays = store.load_arrays(info)  # the full v2 checks: checksum, offsets, the file as indexed
    hybrid = needs_checkpoints(info.layers)
    links = chain_of(
        info.model_digest,
        info.tokens,
        plan_cuts(info.n_tokens, branches, settings),
        hybrid,
        kv_form(info.layers, ModelIdentity.from_dict(info.model)),
    )
    ends_only = [link if link.end == info.n_tokens else without_checkpoint(link) for link in links]
    written = write_chain(
        store, info.model_digest, ends_only, arrays, info.layers, {}, dense=not hybrid
    )
    old = read_header(info.path).metadata
    if old["kvsnap.format"] != str(WHOLE_FILE_FORMAT):
        raise SnapshotError(
            str(info.path),
            f"changed while migrating (format {old['kvsnap.format']!r})",
            "run `kvsnap migrate` again",
        )
    meta = {k: v for k, v in old.items() if k != CHECKSUM_KEY}
    meta["kvsnap.format"] = str(FORMAT_VERSION)
    meta[CHAIN] = encode_chain(chain_field(ends_only, settings))
    path = store.put(info.key, to_out_tensors({TOKENS: arrays[TOKENS]}), meta)
    return written.nbytes + path.stat().st_size
