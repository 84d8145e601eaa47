#!/usr/bin/env python
"""The shared tier's fetch alone (docs/benchmarks.md "A warm fleet", the fetch at this
machine's floor): a persisted conversation's record and blocks written behind to a real
redis-server on 127.0.0.1 by one replica's SharedTier, then fetched by fresh processes, each a
replica B with an empty store (``SharedTier.fetch``, the path a request takes before it is
queued; no engine, no HTTP). Per fetch: wall seconds, B's CPU seconds over it, redis-server's
CPU seconds over it, whether the record landed in one buffer per tensor (``contiguous``).

The store is any kvsnap store holding conversation records (``--persist-requests``), e.g.
the A replica's of ``scripts/bench_fleet.py`` (WORKDIR/failover/store-A, ~8k fp32 tokens of
the Qwen3-0.6B shape); the largest record is fetched. ``--code DIR`` runs B (and the push)
on another checkout's kvsnap/ (a worktree of an older commit), for before/after:

    python scripts/bench_tier_fetch.py --store .kvsnap-bench/fleet/failover/store-A \\
        --model .kvsnap-bench/fleet/demo-qwen3-0.6b-text --reps 3 [--code /tmp/old]

Prints one JSON line per fetch and a summary line (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-fleet-secret-" + "x" * 16


def replica(code: Path, url: str, model: Path, store: Path):
    """A replica's SharedTier over ``store`` (every namespace's conversations under one
    digest, no tenant: what tests/helpers/shared_tier.py opens)."""
    sys.path.insert(0, str(code))
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.runtime.persist.options import TierOptions
    from kvsnap.runtime.persist.shared_tier import SharedTier
    from kvsnap.store.tier_backends import open_backend

    identity = load_model(model, lazy=True).identity()
    return SharedTier(
        open_backend(url, 10.0),
        TierOptions(url, budget_s=120.0),
        identity,
        store,
        local_conv_digest=lambda ns: "d" * 32,
        local_tenant=lambda ns: "",
        on_fetched=lambda: None,
    )


def push(code: Path, url: str, model: Path, store_root: Path, tokens_out: Path) -> None:
    sys.path.insert(0, str(code))
    from kvsnap.key import tokens_digest
    from kvsnap.runtime.persist.shared_tier import TierPush
    from kvsnap.store.conversations import read_parts
    from kvsnap.store.local import Store

    store = Store.open(store_root)
    infos = [store.inspect(p) for p in (store_root / "conversations").glob("*.safetensors")]
    if not infos:
        sys.exit(f"--store {store_root}: no conversation records (conversations/*.safetensors)")
    info = max(infos, key=lambda i: i.n_tokens)
    a = replica(code, url, model, store_root)
    a.push(
        TierPush("", info.path.stem, info.n_tokens, tokens_digest(info.tokens), read_parts(info), 1)
    )
    end = time.monotonic() + 300
    while a.as_dict()["queue_depth"] or not (a.stats.writes or a.stats.errors):
        if time.monotonic() > end:
            sys.exit(f"the push did not finish: {a.as_dict()}")
        time.sleep(0.05)
    if a.stats.errors:
        sys.exit(f"the push failed: {a.as_dict()}")
    tokens_out.write_text(json.dumps(list(info.tokens)))
    a.close(5.0)


def fetch(code: Path, url: str, model: Path, tokens_file: Path) -> None:
    tokens = json.loads(tokens_file.read_text())
    with tempfile.TemporaryDirectory(prefix="kvsnap-fetch-") as d:
        b = replica(code, url, model, Path(d))
        import mlx.core as mx

        mx.eval(mx.zeros((4,)))  # mlx started before the clock
        cpu, wall = time.process_time(), time.monotonic()
        n = b.fetch([*tokens, 5, 6], "")
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        st = b.as_dict()
        row = {"tokens": n, "wall_s": round(wall, 3), "cpu_s": round(cpu, 2)}
        row.update({k: st[k] for k in ("bytes_in", "contiguous", "bad_values", "errors")})
        print(json.dumps(row), flush=True)
        b.take_fresh([*tokens, 5, 6], "", 0)
        b.close(2.0)  # the keeper stores the record first (B's disk, after the clock)


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, required=True, help="a store with conversation records")
    p.add_argument("--model", type=Path, required=True, help="the model those records are of")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--code", type=Path, default=ROOT, help="the checkout whose kvsnap/ runs")
    p.add_argument("--role", choices=("push", "fetch"), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--tokens-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("KVSNAP_SHARED_TIER_SECRET", SECRET)
    code, model = args.code.resolve(), args.model.resolve()
    if args.role == "push":
        return push(code, args.url, model, args.store.resolve(), args.tokens_file)
    if args.role == "fetch":
        return fetch(code, args.url, model, args.tokens_file)

    sys.path.insert(0, str(ROOT))
    from kvsnap.tools.serverproc import free_port

    work = Path(tempfile.mkdtemp(prefix="kvsnap-bench-fetch-"))
    port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", work],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    me = [sys.executable, __file__, "--store", str(args.store), "--model", str(model)]
    me += ["--code", str(code), "--url", url, "--tokens-file", str(work / "tokens.json")]
    try:
        time.sleep(0.5)
        started = time.monotonic()
        subprocess.run([*me, "--role", "push"], check=True)
        print(f"# pushed in {time.monotonic() - started:.1f} s ({code})", flush=True)
        rows = []
        for _ in range(args.reps):
            before = proc_cpu_s(redis.pid)
            out = subprocess.run([*me, "--role", "fetch"], check=True, capture_output=True)
            row = json.loads(out.stdout.decode().strip().splitlines()[-1])
            row["redis_cpu_s"] = round(proc_cpu_s(redis.pid) - before, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        summary = {
            k: statistics.median(r[k] for r in rows) for k in ("wall_s", "cpu_s", "redis_cpu_s")
        }
        print(json.dumps({"median": summary, "reps": len(rows), "code": str(code)}), flush=True)
    finally:
        redis.send_signal(signal.SIGTERM)
        redis.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
