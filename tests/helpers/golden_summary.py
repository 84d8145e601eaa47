"""A store's bytes, summarised without importing kvsnap: so the code that wrote the baseline
and any later code are measured the same way (tests/build/test_golden.py).

What is kept, and how it is compared (``differences``):

- keys (file names) and every header field but ``kvsnap.recorded``: exactly. None of them
  derives from tensor values (keys and digests hash tokens and the model identity).
- the checksum ``kvsnap.xxh3_128`` covers the tensor bytes (and ``kvsnap.recorded``), so it is
  not compared with the baseline: it must match the file's own bytes, recomputed here. So
  must a part's per-row digests ``kvsnap.row_digests`` (they hash tensor bytes too).
- integer tensors (I32/I64: token ids): dtype, shape and sha256, exactly.
- float tensors (F32/F16/BF16): dtype and shape exactly; values through a fingerprint (L2
  norm, largest magnitude, PROJECTIONS projections on fixed +-1 directions), each within
  ``RTOL * norm`` of the baseline. OpenBLAS picks its GEMM kernels by CPU (and
  OPENBLAS_CORETYPE), and another kernel sums in another order: fp32 results move by ~1e-6
  relative (measured: <= 5e-6 in L2 between Zen/Haswell, Sandybridge and Prescott kernels).
  RTOL = 1e-4 leaves 20x room, while a real change (another position, RoPE offset, layer,
  a token's KV) moves a tensor by percents. If ``|a - b| <= RTOL * |b|`` (L2) then every
  fingerprint entry is within ``RTOL * |b|`` (Cauchy-Schwarz), so noise never fails.
- U32 tensors are quantized KV payloads: their bytes, read as numbers (one byte is one level
  at 8 bits, the golden cases' setting), are fingerprinted the same way, with room for a
  level to move by one on a rounding edge (measured: 5 of ~60k levels under Prescott) in up
  to FLIP_SHARE of the bytes.

The baseline (fixtures/golden/summary.json) moves only with a deliberate format change; it
was written for format 2, again for format 3 (records and blocks) and again when it took
fingerprints instead of tensor bytes, each time with
``python tests/helpers/golden_summary.py --write [COMMIT]``.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

import numpy as np
import xxhash

CHECKSUM_KEY = "kvsnap.xxh3_128"
CHECKSUM_MARKER = f'"{CHECKSUM_KEY}":"'.encode()
CHECKSUM_PLACEHOLDER = b"0" * 32
CHECKSUM_OK = "matches the file's bytes"
# Provenance (versions, creation time) differs between two builds of the same state.
ROW_DIGESTS = "kvsnap.row_digests"
VOLATILE = {"kvsnap.recorded", CHECKSUM_KEY, ROW_DIGESTS}
RTOL = 1e-4
PROJECTIONS = 8
FLIP_SHARE = 1e-3
FLOATS = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
EXACT = {"I32": "<i4", "I64": "<i8"}
LEVELS = {"U32": "u1"}  # quantized payload: read byte by byte


# The golden inputs and baseline: tests/fixtures/golden/ (agents.json, summary.json).
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
# golden store name -> (demo model in helpers/models.py's MODEL_SPECS, extra build flags)
CASES = {
    "dense": ("dense", []),
    "hybrid": ("hybrid", []),
    "sliding": ("sliding", []),
    "dense-q8": ("dense", ["--kv-bits", "8"]),
}


def checksum_status(data: bytes, header_len: int, recorded: str | None) -> str:
    """kvsnap's checksum, recomputed: xxh3-128 of the length prefix, the header with the
    checksum value back to its placeholder, and the data."""
    if not recorded:
        return "absent"
    header = data[8 : 8 + header_len]
    h = xxhash.xxh3_128(data[:8])
    h.update(
        header.replace(
            CHECKSUM_MARKER + recorded.encode(), CHECKSUM_MARKER + CHECKSUM_PLACEHOLDER, 1
        )
    )
    h.update(data[8 + header_len :])
    actual = h.hexdigest()
    return (
        CHECKSUM_OK if actual == recorded else f"header says {recorded}, the bytes hash to {actual}"
    )


def _directions(n: int) -> np.ndarray:
    """PROJECTIONS fixed unit vectors of +-1/sqrt(n), from SHAKE-128: the same on every machine
    and numpy version."""
    rows = []
    for j in range(PROJECTIONS):
        bits = np.unpackbits(
            np.frombuffer(
                hashlib.shake_128(f"golden-projection-{j}".encode()).digest((n + 7) // 8), np.uint8
            )
        )[:n]
        rows.append(1.0 - 2.0 * bits)
    return np.stack(rows) / math.sqrt(n)


def _values(dtype: str, raw: bytes) -> np.ndarray:
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return (
            (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        )
    return np.frombuffer(raw, FLOATS.get(dtype) or LEVELS[dtype]).astype(np.float64)


def _digits(x: float) -> float:
    return float(f"{x:.9g}")  # 1e-9 relative: far below RTOL, and a readable fixture


def tensor_summary(dtype: str, shape: list, raw: bytes) -> dict:
    out = {"dtype": dtype, "shape": shape}
    if dtype in EXACT:
        return {**out, "sha256": hashlib.sha256(raw).hexdigest()}
    if dtype not in FLOATS and dtype not in LEVELS:
        raise ValueError(
            f"tensor dtype {dtype!r} has no golden comparison: add it to FLOATS, EXACT or LEVELS"
        )
    x = _values(dtype, raw)
    if x.size == 0:
        return {**out, "norm": 0.0, "max_abs": 0.0, "proj": []}
    proj = _directions(x.size) @ x
    return {
        **out,
        "norm": _digits(np.linalg.norm(x)),
        "max_abs": _digits(np.abs(x).max()),
        "proj": [_digits(p) for p in proj],
    }


def rows_status(header: dict, body: bytes, recorded: dict) -> str:
    """CHECKSUM_OK when every tensor's rows (axis 1 of a ``[1, heads, ...]`` tensor, else the
    whole tensor) hash to the recorded xxh3-64 digests."""
    for name, t in sorted(header.items()):
        shape = t["shape"]
        rows = shape[1] if len(shape) >= 3 and shape[0] == 1 and shape[1] > 0 else 1
        data = body[slice(*t["data_offsets"])]
        size = len(data) // rows
        actual = "".join(
            xxhash.xxh3_64(data[i * size : (i + 1) * size]).hexdigest() for i in range(rows)
        )
        if recorded.get(name) != actual:
            return f"tensor {name}'s row digests do not match its bytes"
    return CHECKSUM_OK


def file_summary(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n :]
    tensors = {
        name: tensor_summary(t["dtype"], t["shape"], body[slice(*t["data_offsets"])])
        for name, t in sorted(header.items())
    }
    status = checksum_status(data, n, meta.get(CHECKSUM_KEY))
    if ROW_DIGESTS in meta and status == CHECKSUM_OK:
        status = rows_status(header, body, json.loads(meta[ROW_DIGESTS]))
    return {
        "meta": {k: v for k, v in sorted(meta.items()) if k not in VOLATILE},
        "checksum": status,
        "tensors": tensors,
    }


def store_summary(store: Path) -> dict:
    """key -> header fields (minus the volatile ones), checksum status and per-tensor dtype,
    shape and sha256 or fingerprint; blocks and checkpoints as ``blocks/<key>`` and
    ``checkpoints/<key>``."""
    out = {p.stem: file_summary(p) for p in sorted((store / "snapshots").glob("*.safetensors"))}
    for folder in ("blocks", "checkpoints"):
        out.update(
            {
                f"{folder}/{p.stem}": file_summary(p)
                for p in sorted((store / folder).glob("*.safetensors"))
            }
        )
    return out


def tolerance(want: dict) -> float:
    """How far a fingerprint entry may move: RTOL of the norm, plus one level in FLIP_SHARE
    of the bytes of a quantized payload (k levels moved by one move the norm by sqrt(k))."""
    tol = RTOL * want["norm"]
    if want["dtype"] in LEVELS:
        tol += math.sqrt(max(16, FLIP_SHARE * math.prod(want["shape"]) * 4))
    return tol


def tensor_differences(where: str, got: dict, want: dict, *, values: bool = True) -> list[str]:
    if (got["dtype"], got["shape"]) != (want["dtype"], want["shape"]):
        return [
            (
                f"{where}: {got['dtype']}{got['shape']},"
                f" the baseline has {want['dtype']}{want['shape']}"
            )
        ]
    if not values:
        return []
    if "sha256" in want:
        return (
            []
            if got.get("sha256") == want["sha256"]
            else [f"{where}: integer bytes changed (tokens?)"]
        )
    tol = tolerance(want)
    pairs = [("norm", got["norm"], want["norm"]), ("max_abs", got["max_abs"], want["max_abs"])]
    pairs += [
        (f"proj[{j}]", g, w) for j, (g, w) in enumerate(zip(got["proj"], want["proj"], strict=True))
    ]
    return [
        f"{where}: {name} {g!r} vs {w!r}, beyond float noise ({tol:.3g})"
        for name, g, w in pairs
        if abs(g - w) > tol
    ]


def differences(got: dict, want: dict, *, values: bool = True) -> list[str]:
    """Every way store summary ``got`` departs from baseline ``want``; [] when it is the same
    store up to float noise. ``values=False`` skips tensor values (another mlx)."""
    if sorted(got) != sorted(want):
        return [
            (
                f"keys changed: missing {sorted(set(want) - set(got))},"
                f" new {sorted(set(got) - set(want))}"
            )
        ]
    out = []
    for key, w in want.items():
        g = got[key]
        out += [
            f"{key}: header field {f} is {g['meta'].get(f)!r},"
            f" the baseline has {w['meta'].get(f)!r}"
            for f in sorted(set(g["meta"]) | set(w["meta"]))
            if g["meta"].get(f) != w["meta"].get(f)
        ]
        if g["checksum"] != CHECKSUM_OK:
            out.append(f"{key}: checksum {g['checksum']}")
        if sorted(g["tensors"]) != sorted(w["tensors"]):
            out.append(
                f"{key}: tensor names {sorted(g['tensors'])},"
                f" the baseline has {sorted(w['tensors'])}"
            )
            continue
        for name, t in w["tensors"].items():
            out += tensor_differences(f"{key}/{name}", g["tensors"][name], t, values=values)
    return out


def write_baseline(commit: str) -> None:
    """Build the golden agents for every case (CASES) and write summary.json."""
    import os
    import subprocess
    import sys
    import tempfile
    from importlib.metadata import version

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers.models import DemoModels

    with tempfile.TemporaryDirectory() as tmp:
        models = DemoModels(Path(tmp) / "models")
        stores = {}
        for case, (model, flags) in sorted(CASES.items()):
            out = Path(tmp) / case
            cmd = [
                sys.executable,
                "-m",
                "kvsnap",
                "build",
                str(FIXTURES / "agents.json"),
                "--model",
                str(models.path(model)),
                "--out",
                str(out),
                *flags,
            ]
            subprocess.run(
                cmd,
                check=True,
                capture_output=True,
                env={**os.environ, "KVSNAP_CACHE_DIR": str(Path(tmp) / "cache")},
            )
            stores[case] = store_summary(out)
    doc = {
        "made_by": f"kvsnap at {commit}, tests/helpers/golden_summary.py --write",
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "stores": stores,
    }
    (FIXTURES / "summary.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["--write"]:
        raise SystemExit(
            "usage: python tests/helpers/golden_summary.py --write [COMMIT]"
            "   (rewrites fixtures/golden/summary.json)"
        )
    write_baseline(sys.argv[2] if len(sys.argv) > 2 else "HEAD")
