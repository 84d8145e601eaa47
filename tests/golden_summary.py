"""A store's bytes, summarised without importing kvsnap: so the code that wrote the baseline
and any later code are measured the same way (tests/test_golden.py).

The baseline (fixtures/golden/summary.json) moves only with a deliberate format change; it
was written at the start of issue 16 (format 2) and again for issue 17 (format 3: records
and blocks) with ``python tests/golden_summary.py --write``.
"""

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
    """key -> header fields (minus the volatile ones) and per-tensor dtype, shape and sha256;
    blocks and checkpoints as ``blocks/<key>`` and ``checkpoints/<key>``."""
    out = {p.stem: file_summary(p) for p in sorted((store / "snapshots").glob("*.safetensors"))}
    for folder in ("blocks", "checkpoints"):
        out.update({f"{folder}/{p.stem}": file_summary(p) for p in sorted((store / folder).glob("*.safetensors"))})
    return out


def write_baseline(commit: str) -> None:
    """Build the golden agents for every case (test_golden.CASES) and write summary.json."""
    import subprocess
    import sys
    import tempfile
    from importlib.metadata import version

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import DemoModels
    from test_golden import CASES, FIXTURES

    with tempfile.TemporaryDirectory() as tmp:
        models = DemoModels(Path(tmp) / "models")
        stores = {}
        for case, (model, flags) in sorted(CASES.items()):
            out = Path(tmp) / case
            subprocess.run([sys.executable, "-m", "kvsnap", "build", str(FIXTURES / "agents.json"), "--model", str(models.path(model)), "--out", str(out), *flags], check=True, capture_output=True, env={**__import__("os").environ, "KVSNAP_CACHE_DIR": str(Path(tmp) / "cache")})
            stores[case] = store_summary(out)
    doc = {"made_by": f"kvsnap at {commit}, tests/golden_summary.py --write", "mlx": version("mlx"), "mlx_lm": version("mlx-lm"), "stores": stores}
    (FIXTURES / "summary.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["--write"]:
        raise SystemExit("usage: python tests/golden_summary.py --write [COMMIT]   (rewrites fixtures/golden/summary.json)")
    write_baseline(sys.argv[2] if len(sys.argv) > 2 else "HEAD")
