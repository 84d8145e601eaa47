#!/usr/bin/env python
"""Restore of a chained (v3 block) store against the disk: from a cold page cache against an
O_DIRECT sequential read of the same files, and from a warm one against a plain read, side by
side in one run, for one or more checkouts.

    python scripts/bench_restore_disk.py --store /tmp/kvsnap-disk --mb 1000 --blocks 129 \\
        --reps 3 [--trees /work/main,/tmp/before]

The store is synthesized with the store's own writers (``write_chain``'s ``put_part``):
Qwen3-0.6B-shaped fp32 KV (28 layers, 8 KV heads, head dim 128: 224 KiB per token), random
values, ``--blocks`` blocks. A restore is ``store.reading.read_state_parts`` (every block read,
checked against the chain and checksummed, the tensors viewed in mlx memory) in a fresh
process of each tree (``PYTHONPATH`` is the tree), so its memory is fresh as a server's is.
Cold means every file dropped from the page cache with ``posix_fadvise(DONTNEED)`` (checked
with ``mincore``: the script says how much was still cached); no ``drop_caches``.

``measure(...)`` is the reusable part (scripts/bench_long.py calls it): it returns the medians
and ratios as a dict. Prints a markdown table; ``--json FILE`` writes the dict.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS, KV_HEADS, HEAD_DIM = 28, 8, 128  # Qwen3-0.6B
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # fp32 keys and values
MODEL_DIGEST = "ab" * 16
DIRECT_CHUNK = 8 << 20
LIBC = ctypes.CDLL(None, use_errno=True)
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- the store ------------------------------------------------------------------------------


def make_store(root: Path, mb: float, blocks: int, seed: int = 0) -> dict:
    """A store of one chain of ``blocks`` blocks holding ``mb`` MB of fp32 KV in all, written by
    the store's own writers; returns what ``restore`` needs (``plan.json`` in ``root`` too)."""
    sys.path.insert(0, str(ROOT))
    import mlx.core as mx

    from kvsnap.snapshot.blocks import Cut, chain_of
    from kvsnap.snapshot.codec import to_out_tensors
    from kvsnap.snapshot.format import BLOCK_KIND
    from kvsnap.store.local import Store
    from kvsnap.store.paths import part_path
    from kvsnap.store.writing import block_metadata, put_part

    n = max(blocks, round(mb * 1e6 / TOKEN_BYTES))
    ends = [n * (i + 1) // blocks for i in range(blocks)]
    cuts = [Cut(start, end, False) for start, end in zip([0] + ends[:-1], ends)]
    tokens = random.Random(seed).choices(range(1000, 30000), k=n)
    links = chain_of(MODEL_DIGEST, tokens, cuts, False)
    layers = [{"class": "KVCache", "offset": n} for _ in range(LAYERS)]
    store = Store.open(root, create=True)
    mx.random.seed(seed)
    for link in links:
        if part_path(store, BLOCK_KIND, link.key).exists():
            continue
        shape = (1, KV_HEADS, link.end - link.start, HEAD_DIM)
        part = {
            f"{i}.{kind}": mx.random.normal(shape, dtype=mx.float32)
            for i in range(LAYERS)
            for kind in ("keys", "values")
        }
        mx.eval(list(part.values()))
        meta = block_metadata(link, MODEL_DIGEST, layers, True)
        put_part(store, BLOCK_KIND, link.key, to_out_tensors(part), meta)
    plan = {
        "root": str(root),
        "spans": [[lk.key, lk.start, lk.end, lk.prefix_digest] for lk in links],
        "layers": layers,
        "files": [str(part_path(store, BLOCK_KIND, lk.key)) for lk in links],
    }
    (root / "plan.json").write_text(json.dumps(plan))
    return plan


# --- page cache and plain reads ---------------------------------------------------------------


def drop_cached(files: list[str]) -> None:
    """Evict each file from the page cache (its pages are clean: the writer fsynced them)."""
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(files: list[str]) -> float:
    """The share of the files' pages in the page cache (mincore over a private mapping, which
    reads nothing)."""
    cached = total = 0
    for name in files:
        size = os.path.getsize(name)
        if not size:
            continue
        pages = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        with open(name, "rb") as f:
            m = mmap.mmap(
                f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        try:
            first = ctypes.c_char.from_buffer(m)
            rc = LIBC.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(size), vec)
            del first
            if rc != 0:
                raise OSError(ctypes.get_errno(), f"mincore {name}")
        finally:
            m.close()
        cached += sum(v & 1 for v in vec)
        total += pages
    return cached / total if total else 0.0


def direct_read(files: list[str]) -> float:
    """Seconds to read every file once, in chain order, with O_DIRECT (no page cache) in
    DIRECT_CHUNK requests into one aligned buffer: the disk's sequential rate."""
    buf = mmap.mmap(-1, DIRECT_CHUNK)  # page-aligned, as O_DIRECT needs
    t0 = time.perf_counter()
    for name in files:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECT)
        try:
            offset = 0
            while n := os.preadv(fd, [buf], offset):
                offset += n
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def plain_read(files: list[str]) -> float:
    """Seconds to read every file once, in chain order, into fresh memory that is kept, as a
    restore keeps what it read (one thread; freeing each buffer would let the next file reuse
    pages already touched)."""
    kept = []
    t0 = time.perf_counter()
    for name in files:
        with open(name, "rb", buffering=0) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)  # fresh pages, first touched here
            f.readinto(buf)
            kept.append(buf)
    return time.perf_counter() - t0


# --- the restore, in a fresh process of a tree -----------------------------------------------


def restore_here(plan: dict) -> float:
    """Seconds for ``read_state_parts`` over the plan's chain, in this process."""
    from kvsnap.blas import preload_openblas

    preload_openblas()
    import mlx.core as mx

    from kvsnap.store.local import Store
    from kvsnap.store.reading import read_state_parts

    store = Store.open(Path(plan["root"]), readonly=True)
    spans = [tuple(s) for s in plan["spans"]]
    t0 = time.perf_counter()
    blocks, _, _ = read_state_parts(store, "bench", MODEL_DIGEST, spans, None, plan["layers"])
    mx.eval([a for arrays in blocks for a in arrays.values()])
    return time.perf_counter() - t0


def in_child(what: str, plan_file: Path, tree: Path = ROOT) -> tuple[float, float]:
    """Seconds ``what`` ("restore", "plain", "direct") takes in a fresh process of ``tree``
    (fresh memory for each, as a starting server has), and the CPU seconds it used."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", what, str(plan_file)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    wall, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


# --- the measurement -----------------------------------------------------------------------------


def measure(plan_file: Path, trees: list[Path], reps: int = 3) -> dict:
    """Medians of ``reps`` interleaved rounds: O_DIRECT read, and per tree a cold restore; then
    a plain read and per tree a warm restore, each in a fresh process. Returns seconds, MB/s
    and ratios to the reads."""
    plan = json.loads(plan_file.read_text())
    files = plan["files"]
    size = sum(os.path.getsize(f) for f in files)
    runs: dict[str, list[float]] = {"direct": [], "cold plain": [], "plain": []}
    cpu: dict[str, list[float]] = {"direct": [], "cold plain": [], "plain": []}
    still_cached: list[float] = []
    for tree in trees:
        for name in (f"cold {tree}", f"warm {tree}"):
            runs[name], cpu[name] = [], []

    def record(name: str, what: str, tree: Path = ROOT) -> None:
        wall, used = in_child(what, plan_file, tree)
        runs[name].append(wall)
        cpu[name].append(used)

    for rep in range(reps):
        drop_cached(files)
        record("direct", "direct")
        order = trees if rep % 2 == 0 else trees[::-1]  # both orders
        cold = [("cold plain", "plain", ROOT)] + [(f"cold {t}", "restore", t) for t in order]
        for name, what, tree in cold if rep % 2 == 0 else cold[::-1]:
            drop_cached(files)
            still_cached.append(cached_fraction(files))
            record(name, what, tree)
        in_child("plain", plan_file)  # into the page cache
        warm = [("plain", "plain", ROOT)] + [(f"warm {t}", "restore", t) for t in order]
        for name, what, tree in warm if rep % 2 == 0 else warm[::-1]:
            record(name, what, tree)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out: dict = {
        "bytes": size,
        "blocks": len(files),
        "reps": reps,
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "most_still_cached_when_cold": max(still_cached) if still_cached else 0.0,
        "seconds": med,
        "cpu_seconds": {k: statistics.median(v) for k, v in cpu.items()},
        "raw": runs,
        "raw_cpu": cpu,
        "mb_per_s": {k: size / v / 1e6 for k, v in med.items()},
        "ratios": {},
    }
    cpu_med = out["cpu_seconds"]
    out["cpu_ratios"] = {}
    for tree in trees:
        out["ratios"][f"cold {tree} / direct"] = med["direct"] / med[f"cold {tree}"]
        out["ratios"][f"warm {tree} / plain"] = med["plain"] / med[f"warm {tree}"]
        # issue 41 item 4: a restore's CPU against a plain read's of the same bytes, as cold
        out["cpu_ratios"][f"cold {tree} / cold plain"] = (
            cpu_med[f"cold {tree}"] / cpu_med["cold plain"]
        )
        out["cpu_ratios"][f"cold {tree} / warm plain"] = cpu_med[f"cold {tree}"] / cpu_med["plain"]
        out["cpu_ratios"][f"warm {tree} / warm plain"] = cpu_med[f"warm {tree}"] / cpu_med["plain"]
    return out


def table(result: dict) -> str:
    lines = [
        f"{result['bytes'] / 1e6:.0f} MB in {result['blocks']} blocks, medians of "
        f"{result['reps']}, {result['cpu_count']} CPUs, load {result['load_avg'][0]:.2f}; "
        f"at most {result['most_still_cached_when_cold']:.1%} cached when cold",
        "",
        "| what | seconds | MB/s | rate ratio to its limit | CPU seconds | CPU ratio to a plain "
        "read (cold / warm) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    ratios = result["ratios"]
    cpu_ratios = result.get("cpu_ratios", {})
    for name, seconds in result["seconds"].items():
        limit = ""
        for key, value in ratios.items():
            if key.startswith(name + " /"):
                limit = f"{value:.2f}"
        to_plain = [
            f"{v:.2f}" for k, v in cpu_ratios.items() if k.startswith(name + " /") and "cold" in k
        ] or [f"{v:.2f}" for k, v in cpu_ratios.items() if k.startswith(name + " /")]
        lines.append(
            f"| {name} | {seconds:.3f} | {result['mb_per_s'][name]:.0f} | {limit} "
            f"| {result['cpu_seconds'][name]:.2f} | {' / '.join(to_plain)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=Path("/tmp/kvsnap-restore-disk"))
    ap.add_argument("--mb", type=float, default=1000)
    ap.add_argument("--blocks", type=int, default=129)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trees", default=str(ROOT), help="comma-separated checkouts to compare")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        what, plan = args.child[0], json.loads(Path(args.child[1]).read_text())
        reads = {"plain": plain_read, "direct": direct_read}
        if what == "restore":  # imported before the clocks start, as a server has them
            import mlx.core  # noqa: F401

            import kvsnap.store.reading  # noqa: F401
        cpu = time.process_time()
        wall = restore_here(plan) if what == "restore" else reads[what](plan["files"])
        # CPU time of every thread of the process over the measured part: the work done,
        # whatever share of the machine it got
        print(wall, time.process_time() - cpu)
        return 0
    plan_file = args.store / "plan.json"
    if not plan_file.exists():
        make_store(args.store, args.mb, args.blocks)
    result = measure(plan_file, [Path(t) for t in args.trees.split(",")], args.reps)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
