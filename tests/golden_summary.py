"""A store's bytes, summarised without importing kvsnap: so the code at the start of issue 16
and any later code are measured the same way (tests/test_golden.py)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

# Fields that may differ between two builds of the same state: the recorded (not keyed)
# provenance (versions, creation time) and the checksum, which covers the header and so it.
VOLATILE = {"kvsnap.recorded", "kvsnap.xxh3_128"}


def file_summary(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n :]
    tensors = {
        name: {"dtype": t["dtype"], "shape": t["shape"], "sha256": hashlib.sha256(body[t["data_offsets"][0] : t["data_offsets"][1]]).hexdigest()}
        for name, t in sorted(header.items())
    }
    return {"meta": {k: v for k, v in sorted(meta.items()) if k not in VOLATILE}, "tensors": tensors}


def store_summary(store: Path) -> dict:
    """key -> header fields (minus the volatile ones) and per-tensor dtype, shape and sha256."""
    return {p.stem: file_summary(p) for p in sorted((store / "snapshots").glob("*.safetensors"))}
