"""Launch → first token of each agent for mlx_lm.server sharded over 2 ranks (``mlx.launch
--backend ring`` on this host), cold vs ``--kv-snapshots``, beside the same on one process; and
the bytes each rank read against the store's size.

    python scripts/bench_sharded.py --tokens 2048,8192 --out /tmp/kvsnap-sharded

One store, built once by one process (``kvsnap build --for mlx-lm``), serves every run. The
model is the Qwen3-0.6B shape in fp32 (28 layers, 8 KV heads: 4 per tensor-parallel rank),
made locally. Writes ``sharded.json`` and ``sharded.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]

from bench_mlx_lm import ask, build, make_agents, server_env  # noqa: E402
from helpers.sharded import launch_argv  # noqa: E402

from kvsnap.tools.demo import DemoSpec, make_demo_model  # noqa: E402
from kvsnap.tools.serverproc import ServerProcess, free_port, under_hard_limit  # noqa: E402

READ = re.compile(r"rank (\d+) of (\d+) \(([^)]*)\) read ([\d.]+) MiB in (\d+) files")
MODES = ("one process, cold", "one process, snapshots", "2 ranks, cold", "2 ranks, snapshots")
SHORT = dict(zip(("cold1", "warm1", "cold2", "warm2"), MODES))


def launch(mode: str, model: Path, store: Path, log: Path, env: dict) -> ServerProcess:
    port = free_port()
    if mode.startswith("2 ranks"):
        # each rank stands for a host of its own: this host's cores split between the ranks
        # (two ranks of 2 OpenBLAS threads each on 2 cores spin against each other)
        env = {**env, "OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    serve = ["mlx-lm", "serve", "--model", str(model)]
    if "snapshots" in mode:
        serve += ["--kv-snapshots", str(store)]
    serve += ["--host", "127.0.0.1", "--port", str(port)]
    if mode.startswith("2 ranks"):
        cmd = launch_argv(2, serve)
    else:
        cmd = under_hard_limit([sys.executable, "-m", "kvsnap", *serve], 1800)
    with open(log, "wb") as out:
        t0 = time.perf_counter()  # before Popen: interpreter start, imports and the ring count
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return ServerProcess(proc=proc, url=f"http://127.0.0.1:{port}", log_path=log, launched_at=t0)


def stop(server: ServerProcess) -> None:
    import signal

    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(server.proc.pid, sig)
            server.proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def one(mode: str, ctx: dict) -> dict:
    log = ctx["out"] / f"{mode.replace(' ', '-').replace(',', '')}.log"
    server = launch(mode, ctx["model"], ctx["store"], log, ctx["env"])
    try:
        ready = server.wait_ready(1800)
        answers = [
            ask(server, None, a["messages"][0]["content"], "Please review the handler.", 4)
            for a in ctx["agents"]
        ]
    finally:
        stop(server)
    reads = [
        {"rank": int(r), "view": view, "bytes": int(float(mib) * 2**20), "files": int(files)}
        for r, _, view, mib, files in READ.findall(log.read_text(errors="replace"))
    ]
    return {
        "mode": mode,
        "ready_s": round(ready, 2),
        "first_token_s": [a["first_token_from_launch_s"] for a in answers],
        # each request alone (they are sent one after the other, after ready)
        "request_s": [a["ttft_s"] for a in answers],
        "cached_tokens": [a["cached_tokens"] for a in answers],
        "prompt_tokens": [a["prompt_tokens"] for a in answers],
        "reads": sorted(reads, key=lambda r: r["rank"]),
    }


def plot(result: dict, path: Path) -> None:
    """Launch -> first token per agent and mode (log scale), and each parallelism's cold / warm
    speed-up beside the bytes each rank read against the store."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [f"agent {n:,} tok" for n in result["tokens"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.2
    for i, run in enumerate(runs):
        xs = [j + (i - 1.5) * width for j in range(len(labels))]
        a.bar(xs, run["first_token_s"], width, label=run["mode"], color=f"C{i}")
    a.set_xticks(range(len(labels)), labels)
    a.set_yscale("log")
    a.set_ylabel("launch → first token (s, log)")
    a.legend(fontsize=8)
    a.set_title("launch → first token of each agent", fontsize=9)
    for i, who in enumerate(("one process", "2 ranks")):
        xs = [j + (i - 0.5) * 0.35 for j in range(len(labels))]
        got = result[f"speedup, {who}"]
        bars = b.bar(xs, got, 0.35, label=f"{who}: cold / snapshots", color=f"C{2 * i + 1}")
        b.bar_label(bars, [f"{v:.1f}×" for v in got], fontsize=8)
    b.set_xticks(range(len(labels)), labels)
    b.set_ylabel("cold / --kv-snapshots, launch → first token")
    reads = next((r["reads"] for r in runs if r["reads"]), [])
    share = ", ".join(f"rank {r['rank']} {r['bytes'] / result['store_bytes']:.4f}" for r in reads)
    b.set_title(f"speed-up; of the store each rank read: {share}", fontsize=9)
    b.legend(fontsize=8)
    fig.suptitle(
        "Qwen3-0.6B shape, fp32, mlx.launch -n 2 --backend ring on one host (2 CPU cores, one "
        f"OpenBLAS thread per rank), load {result['load_before'][0]:.1f}–"
        f"{result['load_after'][0]:.1f}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,8192", help="one agent per size, comma-separated")
    p.add_argument("--out", type=Path, default=Path("/tmp/kvsnap-sharded"))
    p.add_argument("--size", default="qwen3-0.6b", help="demo model size (tiny for a smoke run)")
    p.add_argument(
        "--only",
        default=",".join(SHORT),
        help="modes, comma-separated: cold1, warm1 (one process), cold2, warm2 (2 ranks); a mode "
        "left out keeps its result from OUT/sharded.json",
    )
    p.add_argument("--plot", type=Path, help="only draw: a sharded.json into OUT/sharded.png")
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        plot(json.loads(args.plot.read_text()), out / "sharded.png")
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    unknown = [m for m in args.only.split(",") if m and m not in SHORT]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {', '.join(SHORT)}")
    modes = [SHORT[m] for m in args.only.split(",") if m]
    kept = {}
    if (out / "sharded.json").exists():
        kept = {r["mode"]: r for r in json.loads((out / "sharded.json").read_text())["runs"]}
    missing = [m for m in MODES if m not in modes and m not in kept]
    if missing:
        raise SystemExit(f"--only leaves out {missing} and {out}/sharded.json has no result for it")
    model = make_demo_model(out / f"model-{args.size}", DemoSpec(arch="dense", size=args.size))
    env = server_env(out)
    agents_file = out / "agents.json"
    agents = make_agents(model, tokens, agents_file)
    store = out / "store"
    built = build(model, agents_file, store, ["--for", "mlx-lm"], env)
    ctx = {"out": out, "model": model, "store": store, "agents": agents, "env": env}
    load_before = os.getloadavg()
    runs = {mode: one(mode, ctx) for mode in modes}
    result = {
        "command": " ".join(sys.argv),
        "tokens": tokens,
        "build": built,
        "store_bytes": sum(f.stat().st_size for f in store.rglob("*.safetensors")),
        "load_before": load_before,
        "runs": [runs.get(mode) or kept[mode] for mode in MODES],
        "load_after": os.getloadavg(),
    }
    by = {r["mode"]: r for r in result["runs"]}
    for who in ("one process", "2 ranks"):
        cold, warm = by[f"{who}, cold"], by[f"{who}, snapshots"]
        result[f"speedup, {who}"] = [
            round(c / w, 2) for c, w in zip(cold["first_token_s"], warm["first_token_s"])
        ]
    (out / "sharded.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "sharded.png")
    print(json.dumps({k: v for k, v in result.items() if k != "build"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
