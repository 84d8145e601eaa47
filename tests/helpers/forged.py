"""Stores forged on purpose: blocks rewritten with another head dim, records claiming more
tokens than a model's context (the checks that must refuse them are under test)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvsnap.key import ModelIdentity
from kvsnap.snapshot.file import CHECKSUM_KEY, OutTensor, read_header, write_snapshot
from kvsnap.snapshot.format import snapshot_filename
from kvsnap.snapshot.header import key_of, tokens_digest_of_bytes
from kvsnap.store.local import Store
from kvsnap.store.paths import chain_relpaths

SYSTEMS = {
    "alpha": "You are the alpha agent. Review the code, check every test, then answer briefly and "
    "exactly.",
    "beta": "You are the beta agent. Plan the work in short steps and name the tools you would "
    "call.",
    "gamma": "You are the gamma agent. Summarise the logs you are given, line by line, with dates.",
}


def _agents(names) -> list[dict]:
    return [{"name": n, "messages": [{"role": "system", "content": SYSTEMS[n]}]} for n in names]


def forge_head_dim(path: Path) -> None:
    """Rewrite a block with every 4-d tensor cut to half its head dim, checksum recomputed: its
    key (model, span, prefix digest) does not change, so the record still names it."""
    header = read_header(path)
    data = path.read_bytes()
    tensors = []
    for t in header.tensors.values():
        raw = data[header.data_start + t.start : header.data_start + t.end]
        if len(t.shape) == 4:
            assert t.dtype == "F32", t.dtype
            arr = np.ascontiguousarray(
                np.frombuffer(raw, dtype=np.float32).reshape(t.shape)[..., : t.shape[-1] // 2]
            )
            tensors.append(OutTensor(t.name, t.dtype, tuple(arr.shape), memoryview(arr.tobytes())))
        else:
            tensors.append(OutTensor(t.name, t.dtype, tuple(t.shape), memoryview(raw)))
    meta = {k: v for k, v in header.metadata.items() if k != CHECKSUM_KEY}
    with open(path, "wb") as f:
        write_snapshot(f, tensors, meta)


def forge_agent(root: Path, name: str) -> list[Path]:
    """Forge the blocks only ``name``'s record reaches (a block shared with another agent stays)."""
    store = Store.open(root)
    infos = [store.inspect(p) for p in store.snapshot_files()]
    mine = {
        rel
        for i in infos
        if i.name == name
        for rel in chain_relpaths(i)
        if rel.startswith("blocks/")
    }
    others = {rel for i in infos if i.name != name for rel in chain_relpaths(i)}
    forged = [root / rel for rel in sorted(mine - others)]
    assert forged, "the agent has no block of its own"
    for path in forged:
        forge_head_dim(path)
    return forged


def forge_long_record(root: Path, n_tokens: int) -> Path:
    """A whole-file (format 2) snapshot of ``n_tokens`` zero tokens and empty layers, built from a
    real record's identity: every digest, the key, the file name and the checksum are right."""
    real = read_header(Store.open(root).snapshot_files()[0]).metadata
    raw = bytes(4 * n_tokens)
    tokens_digest = tokens_digest_of_bytes(raw)
    key = key_of(
        ModelIdentity.from_dict(json.loads(real["kvsnap.model"])),
        real["kvsnap.prompt_digest"],
        tokens_digest,
        n_tokens,
    )
    layers = [{"class": "KVCache", "empty": True}]
    keep = ("kvsnap.model", "kvsnap.model_digest", "kvsnap.prompt_digest", "kvsnap.name")
    meta = {k: real[k] for k in keep} | {
        "kvsnap.format": "2",
        "kvsnap.key": key,
        "kvsnap.tokens_digest": tokens_digest,
        "kvsnap.n_tokens": str(n_tokens),
        "kvsnap.layers": json.dumps(layers),
    }
    meta.update(
        {k: v for k, v in real.items() if k not in meta and k not in (CHECKSUM_KEY, "kvsnap.chain")}
    )
    path = root / "snapshots" / snapshot_filename(key)
    with open(path, "wb") as f:
        write_snapshot(f, [OutTensor("tokens", "I32", (n_tokens,), memoryview(raw))], meta)
    return path


def widened_block(path: Path, widen: int) -> bytes:
    """The block file at ``path`` with its tensors ``widen`` times as many leading rows (its
    fields, so its key and name, kept; no checksum): what anyone who can write to a shared
    tier, without the fleet's secret, can plant under the block's name. Its data is zeros."""
    import math
    import struct

    header = read_header(path)
    doc: dict = {"__metadata__": {k: v for k, v in header.metadata.items() if k != CHECKSUM_KEY}}
    at = 0
    for e in sorted(header.tensors.values(), key=lambda e: e.start):
        shape = list(e.shape)
        if len(shape) >= 3:
            shape[-3] *= widen
        n = e.nbytes // max(1, math.prod(e.shape)) * math.prod(shape)
        doc[e.name] = {"dtype": e.dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(doc).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(at)
