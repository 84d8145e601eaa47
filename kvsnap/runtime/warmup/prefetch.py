"""Read and checksum the snapshots a start will pin while the model loads.

Runs on the engine thread (its own mlx stream) while the caller's thread loads the model:
the two are independent until the warm-up, which then takes the arrays from here instead
of reading the files. What needs the loaded model (its KV dtype and cache layout, so the
full identity) is checked by the warm-up as before; nothing is served until it has. Files
that turn out foreign or unpinned are simply dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from kvsnap.errors import ModelError, SnapshotError, StoreError
from kvsnap.key import KVSettings, canonical_json, hexdigest, read_config, tokenizer_digest
from kvsnap.snapshot.header import MAX_TOKENS
from kvsnap.store.foreign import Problem, classify
from kvsnap.store.local import SnapshotInfo, Store


@dataclass
class Prefetched:
    root: Path
    # the one header pass, reused by the warm-up
    infos: list[SnapshotInfo] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    # read and checksummed: arrays, or (ComposedState, bytes added) for a record
    arrays: dict[Path, object] = field(default_factory=dict)
    errors: dict[Path, SnapshotError] = field(default_factory=dict)
    seconds: float = 0.0

    def scan(self, expected) -> tuple[list[SnapshotInfo], list[Problem]]:
        """``Store.scan(expected)`` from the headers already read."""
        good, foreign = classify(self.infos, expected)
        return good, self.problems + foreign

    def take(self, info: SnapshotInfo) -> object | None:
        """The arrays read for ``info`` (once), or None to read the file now; a read that failed
        raises its error."""
        if info.path in self.errors:
            raise self.errors.pop(info.path)
        return self.arrays.pop(info.path, None)


CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "seq_length",
    "n_positions",
    "max_seq_len",
)
NESTED_CONFIGS = ("text_config", "language_config", "llm_config")


def context_tokens(model_dir: Path) -> int:
    """The most tokens a record may hold for this model: its context from config.json (or a
    nested text config), within kvsnap's ``MAX_TOKENS``. A longer prefix could never be served,
    so the start scan refuses it before reading its tokens."""
    try:
        config = read_config(Path(model_dir))
    except ModelError:
        return MAX_TOKENS
    for part in (config, *(config.get(k) for k in NESTED_CONFIGS)):
        if not isinstance(part, dict):
            continue
        for key in CONTEXT_KEYS:
            value = part.get(key)
            if type(value) is int and value > 0:
                return min(value, MAX_TOKENS)
    return MAX_TOKENS


def knowable_identity(model_dir: Path, settings: KVSettings) -> dict:
    """Identity fields knowable before the model loads: config, tokenizer files, KV settings."""
    quantized_kv = settings.kv_bits is not None
    return {
        "config": hexdigest(canonical_json(read_config(model_dir)).encode()),
        "tokenizer": tokenizer_digest(model_dir),
        "kv_bits": settings.kv_bits,
        "kv_group_size": settings.kv_group_size if quantized_kv else None,
        "quantized_kv_start": settings.quantized_kv_start if quantized_kv else None,
        "max_kv_size": settings.max_kv_size,
    }


def prefetch(
    store_path: str,
    model_dir: Path,
    settings: KVSettings,
    budget_bytes: int,
    prefer: Iterable[str] = (),
    pool=None,
) -> Prefetched | None:
    """Read the snapshots a start would pin (warm-prompt names first) up to the budget; None if
    there is no store."""
    t0 = time.perf_counter()
    root = Path(store_path).expanduser()
    if not Store(root=root).snapshots_dir.is_dir():
        return None
    try:
        store = Store.open(root, readonly=True)
        infos, problems = store.scan(max_tokens=context_tokens(model_dir))
    except (StoreError, OSError):
        return None  # the warm-up opens it again and reports why
    out = Prefetched(root=store.root, infos=infos, problems=problems)
    # The warm-up pins in warm-prompt file order until the budget is full: read in that order.
    rank = {name: i for i, name in reversed(list(enumerate(prefer)))}
    want = knowable_identity(model_dir, settings)
    used = 0
    for info in sorted(infos, key=lambda i: (rank.get(i.name, len(rank)), i.name, i.key)):
        if used + info.nbytes > budget_bytes or any(
            info.model.get(k) != v for k, v in want.items()
        ):
            continue
        try:
            # a record: its blocks, each read once however many records share it
            if info.chain is not None and pool is not None:
                from kvsnap.runtime.cache.composed import load_composed

                out.arrays[info.path] = composed = load_composed(store, info, pool)
                used += composed[1]
                continue
            out.arrays[info.path] = store.load_arrays(info)
            used += info.nbytes
        except SnapshotError as exc:
            out.errors[info.path] = exc
    out.seconds = time.perf_counter() - t0
    return out
