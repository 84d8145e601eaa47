"""Time and memory of kvsnap's header checks on normal and hostile snapshot files (no mlx).

    python scripts/measure_header_parse.py [--repeat 5]

Writes each file into a temp store and runs ``Store.inspect`` (the header-only checks a
server's scan and ``kvsnap ls`` run) several times, printing the median time, the
``tracemalloc`` peak and the outcome; normal files also get a full ``verify_file`` (the
whole-file checksum). Hostile files are valid down to their checksum (anyone can compute
it), so every check up to the hostile field runs. Timings are measured here, not asserted
in tests (tests/snapshot/test_fuzz_files.py asserts the memory bound).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.snapshot_meta import fixed_identity, snapshot_metadata  # noqa: E402

from kvsnap.errors import SnapshotError
from kvsnap.key import pack_tokens
from kvsnap.snapshot.file import FORMAT_VERSION, OutTensor, write_snapshot
from kvsnap.store.local import Store

DTYPE_BYTES = {"BF16": 2, "U32": 4, "I32": 4, "F32": 4}


def kv_layer(
    i: int, n: int, heads: int, dim: int
) -> tuple[dict, list[tuple[str, str, tuple[int, ...]]]]:
    return {"class": "KVCache", "offset": n}, [
        (f"{i}.{kv}", "BF16", (1, heads, n, dim)) for kv in ("keys", "values")
    ]


def quantized_layer(i: int, n: int, heads: int, dim: int) -> tuple[dict, list]:
    shapes = [(1, heads, n, dim // 4), (1, heads, n, dim // 64), (1, heads, n, dim // 64)]
    tensors = [
        (f"{i}.{kv}.{j}", "U32" if j == 0 else "BF16", shape)
        for kv in ("keys", "values")
        for j, shape in enumerate(shapes)
    ]
    return {
        "class": "QuantizedKVCache",
        "offset": n,
        "parts": 3,
        "group_size": 64,
        "bits": 8,
    }, tensors


def snapshot_bytes(
    n: int, layers: list, tensors: list, layers_text: str | None = None, **meta_changes: str
) -> tuple[str, bytes]:
    tokens = list(range(n))
    layout = (m.get("class", "?") if isinstance(m, dict) else "?" for m in layers[:4096])
    if layers_text is None:
        layers_text = json.dumps(layers)
    base = snapshot_metadata(
        fixed_identity(layout, "bfloat16"), tokens, layers_text, FORMAT_VERSION
    )
    metadata = {**base, **meta_changes}
    out = [OutTensor("tokens", "I32", (n,), memoryview(pack_tokens(tokens)))]
    for name, dtype, shape in tensors:
        size = DTYPE_BYTES[dtype]
        for d in shape:
            size *= d
        out.append(OutTensor(name, dtype, shape, memoryview(bytes(size))))
    buf = io.BytesIO()
    write_snapshot(buf, out, metadata)
    return f"{base['kvsnap.key']}.safetensors", buf.getvalue()


def model(n: int, n_layers: int, heads: int, dim: int, make=kv_layer) -> tuple[list, list]:
    layers, tensors = [], []
    for i in range(n_layers):
        meta, t = make(i, n, heads, dim)
        layers.append(meta)
        tensors += t
    return layers, tensors


def cases() -> dict[str, tuple[str, bytes]]:
    out = {}
    out["normal: tiny (2 layers, 32 tokens)"] = snapshot_bytes(32, *model(32, 2, 2, 16))
    out["normal: 0.6B-shape (28 layers, 512 tokens, bf16)"] = snapshot_bytes(
        512, *model(512, 28, 8, 128)
    )
    out["normal: 128 layers, 8-bit KV, 256 tokens"] = snapshot_bytes(
        256, *model(256, 128, 8, 128, quantized_layer)
    )
    n = 32
    layers, tensors = model(n, 2, 2, 16)
    bomb = [
        dict(
            layers[0], **{"class": "QuantizedKVCache", "parts": 10**9, "group_size": 64, "bits": 8}
        ),
        layers[1],
    ]
    out["hostile: parts = 10**9"] = snapshot_bytes(n, bomb, tensors)
    out["hostile: kvsnap.layers nested 5000 deep"] = snapshot_bytes(
        n, layers, tensors, layers_text="[" * 5000 + "]" * 5000
    )
    nested = {"class": "KVCache", "offset": n}
    for _ in range(10):
        nested = {"class": "CacheList", "caches": [nested]}
    out["hostile: CacheList nested 10 deep"] = snapshot_bytes(n, [nested], tensors)
    out["hostile: 5000 empty layers"] = snapshot_bytes(
        n, [{"class": "KVCache", "empty": True}] * 5000, tensors
    )
    out["hostile: ArraysCache size 10**9"] = snapshot_bytes(
        n, [{"class": "ArraysCache", "size": 10**9, "present": []}], tensors
    )
    out["hostile: n_tokens of 5000 digits"] = snapshot_bytes(
        n, layers, tensors, **{"kvsnap.n_tokens": "9" * 5000}
    )
    out["hostile: 15 MB agent name"] = snapshot_bytes(
        n, layers, tensors, **{"kvsnap.name": "x" * (15 << 20)}
    )
    many = [(f"x.{j}", "I32", (0,)) for j in range(60000)]
    out["hostile: 60,000 empty tensors"] = snapshot_bytes(n, layers, tensors + many)
    return out


def measure(store: Store, path: Path, repeat: int, full: bool) -> tuple[str, float, int]:
    check = store.verify_file if full else store.inspect
    times = []
    outcome = "ok"
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            check(path)
        except SnapshotError as exc:
            outcome = exc.reason
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    try:
        check(path)
    except SnapshotError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return outcome, statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvsnap-measure-") as d:
        store = Store.open(d, create=True)
        rows = []
        for label, (name, data) in cases().items():
            path = store.snapshots_dir / name
            path.write_bytes(data)
            header = int.from_bytes(data[:8], "little")
            for full in (False, True) if label.startswith("normal") else (False,):
                outcome, seconds, peak = measure(store, path, args.repeat, full)
                rows.append(
                    (
                        label + (" [verify]" if full else ""),
                        len(data),
                        header,
                        seconds,
                        peak,
                        outcome,
                    )
                )
            path.unlink()
    print(f"{'file':<52} {'bytes':>11} {'header':>10} {'ms/file':>9} {'peak KiB':>9}  outcome")
    for label, size, header, seconds, peak, outcome in rows:
        print(
            f"{label:<52} {size:>11,} {header:>10,} {seconds * 1000:>9.2f} {peak / 1024:>9.0f}  "
            f"{outcome[:90]}"
        )


if __name__ == "__main__":
    main()
