#!/usr/bin/env python
"""Concurrent throughput and server CPU per generated token (issue 41, item 1).

    python scripts/bench_concurrent.py --shape mid --clients 8,16 --reps 2
    python scripts/bench_concurrent.py --shape 0.6b-4l --clients 8,16 --reps 2 \\
        --vllm-python ~/.cache/kvsnap-tests/vllm-mlx-venv/bin/python
    python scripts/bench_concurrent.py --before /tmp/before-tp   # kvsnap of another checkout too

Servers, each a real process on 127.0.0.1 with the same fp32 model folder and Debian's
OpenBLAS, launched in turn, the order reversed every other repetition. kvsnap loads OpenBLAS
itself, as it does for any user on Linux (kvsnap/blas.py, which also shortens OpenBLAS's idle
spin); the peers get it through LD_PRELOAD (DESIGN.md section 6), with OpenBLAS's defaults
unless --peer-env sets them (--peer-env OPENBLAS_THREAD_TIMEOUT=16: kvsnap's setting):

  kvsnap          python -m kvsnap serve M --continuous-batching --max-batch-size MAX(N)
  kvsnap-before   the same from the checkout given by --before (PYTHONPATH)
  kvsnap-decode-t0  kvsnap with --decode-blas-threads 0: decode steps on every OpenBLAS thread
  mlx_lm.server   python -m mlx_lm.server --model M   (its BatchGenerator: decode 32, prompt 8)
  mlx_lm.server-t16  the same with OPENBLAS_THREAD_TIMEOUT=16, kvsnap's setting (--servers)
  vllm-mlx        VENV/python -m vllm_mlx.cli serve M --continuous-batching (with --vllm-python)

Per launch: /health (or /v1/models), then one unmeasured warm-up request carrying the shared
system prompt (~2k tokens): every server caches that prefix then (kvsnap's prefix cache,
mlx_lm.server's LRU prompt cache at the end of the system segment, vllm-mlx's prefix cache),
so the measured rounds compare decoding and the per-token serving work, not who computes a
shared prefix once. Then per N: N streaming chat clients (httpx, one asyncio loop) at once,
each with its own user message, ``max_tokens`` tokens at temperature 0 (the demo models never
pick an end token: every request runs to ``max_tokens``). Measured per round: wall from the
first send to the last [DONE], completion tokens (streamed content chunks; usage where given),
tokens/s, and the server's CPU seconds (utime + stime of its process tree from /proc, before
and after the round) per generated token, and each thread's CPU per token (largest first:
mlx's stream thread, OpenBLAS's worker, the engine or generation thread, ...). The load average
is printed with every round.

Writes OUT/concurrent-SHAPE.json (every round, and medians per server and N).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvsnap.blas import find_openblas, preload_openblas  # noqa: E402

preload_openblas()  # before mlx loads (the demo model is made here)
from kvsnap.tools.serverproc import free_port  # noqa: E402

# benchmark-only shapes (kvsnap.tools.demo_families has tiny, small and qwen3-0.6b)
SHAPES = {
    "mid": dict(  # the 8-layer 512-wide qwen3 of issue 41 (scripts/bench_shared_prefix.py's)
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
    "0.6b-4l": None,  # Qwen3-0.6B's widths, 4 layers (DemoSpec layers=4)
}
WORDS = (
    "request handler parser cache eviction policy flaky test build pipeline retry loop database "
    "migration logging setup function class module error value return import file path server "
    "response token review check fix explain step plan data time week goal code thread lock queue"
).split()
TICKS = os.sysconf("SC_CLK_TCK")
STAGGER_S = 0.01
COLORS = {
    "kvsnap": "tab:blue",
    "mlx_lm.server": "tab:orange",
    "kvsnap-before": "tab:green",
    "vllm-mlx": "tab:red",
    "mlx_lm.server-t16": "tab:purple",
    "kvsnap-decode-t0": "tab:cyan",
}


def make_model(shape: str, workdir: Path) -> Path:
    from kvsnap.tools import demo, demo_families

    out = workdir / f"model-{shape}"
    if (out / "config.json").exists():
        return out
    if shape == "mid":
        demo_families._SHAPES[("dense", "mid")] = SHAPES["mid"]
        demo_families.SIZES = tuple(dict.fromkeys((*demo_families.SIZES, "mid")))
        spec = demo.DemoSpec(arch="dense", size="mid", text_outputs=True)
    else:
        spec = demo.DemoSpec(arch="dense", size="qwen3-0.6b", layers=4, text_outputs=True)
    return demo.make_demo_model(out, spec)


def system_prompt(model: Path, target: int) -> str:
    """A system prompt of about ``target`` tokens (the model's tokenizer counts)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    words = [WORDS[(i * 7 + i // 5) % len(WORDS)] for i in range(target * 2)]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose encoding stays within target
        mid = (lo + hi + 1) // 2
        if len(tok.encode(" ".join(words[:mid]))) <= target:
            lo = mid
        else:
            hi = mid - 1
    return "You are the house code reviewer. " + " ".join(words[:lo])


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its descendants, reaped children included."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is the state (field 3): utime, stime, cutime, cstime are fields 14-17
        total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS
        todo.extend(parents.get(p, []))
    return total


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid`` by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def server_cmd(name: str, model: Path, port: int, args) -> tuple[list[str], dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    blas = find_openblas()
    if name.startswith("kvsnap"):
        env.pop("OPENBLAS_THREAD_TIMEOUT", None)  # kvsnap loads OpenBLAS itself, as for a user
    elif blas:
        env["LD_PRELOAD"] = blas  # the peers cannot: preloaded, as DESIGN.md section 6 says
        env.update(kv.split("=", 1) for kv in args.peer_env)
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name.startswith("kvsnap"):
        # the checkout's own package: cwd and PYTHONPATH (``-m`` puts the cwd first)
        env["PYTHONPATH"] = str(kvsnap_tree(name, args))
        batch = str(max(args.clients))
        cmd = [sys.executable, "-m", "kvsnap", "serve", str(model), "--continuous-batching"]
        if name == "kvsnap-decode-t0":  # decoding on every OpenBLAS thread, as before 370e72d
            cmd += ["--decode-blas-threads", "0"]
        return [*cmd, "--max-batch-size", batch, *host, *args.kvsnap_arg], env
    if name == "mlx_lm.server-t16":  # with the OpenBLAS spin kvsnap sets for itself
        env["OPENBLAS_THREAD_TIMEOUT"] = "16"
    if name.startswith("mlx_lm.server"):
        return [sys.executable, "-m", "mlx_lm.server", "--model", str(model), *host], env
    if name == "vllm-mlx":
        # vllm-mlx saves its prefix cache under ~/.cache/vllm-mlx at shutdown and loads it at
        # start; an entry equal to a prompt of an earlier run is then prefilled whole (0.6.0:
        # "HIT cached=2047 remaining=0", then "tokens_to_prefill=2047"). A fresh HOME per launch
        # starts it as cold as the others.
        home = args.workdir / "vllm-home"
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir()
        env["HOME"] = str(home)
        cmd = [args.vllm_python, "-m", "vllm_mlx.cli", "serve", str(model)]
        return [*cmd, "--continuous-batching", *host], env
    raise ValueError(f"unknown server {name!r}")


def start_busy(n: int, limit_s: int = 3600) -> list[subprocess.Popen]:
    """``n`` processes spinning on a core each, the load of another tenant; each stops by
    itself after ``limit_s`` should this script die without killing it."""
    spin = f"import time\nend = time.time() + {limit_s}\nwhile time.time() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


def kvsnap_tree(name: str, args) -> Path:
    return Path(args.before).resolve() if name == "kvsnap-before" else ROOT


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 600) -> float:
    t0 = time.perf_counter()
    with httpx.Client(timeout=2.0) as c:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            for path in ("/health", "/v1/models"):
                try:
                    if c.get(url + path).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready in {timeout}s:\n{log.read_text()[-3000:]}")


async def one_client(client: httpx.AsyncClient, url: str, body: dict, delay: float) -> dict:
    # connections opened a few ms apart: mlx_lm.server's accept backlog is 5 (socketserver's
    # default), and 16 connects at once get some reset
    await asyncio.sleep(delay)
    chunks, usage, t0 = 0, None, time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    chunks += 1
                    first = first or time.perf_counter() - t0
    tokens = usage["completion_tokens"] if usage else chunks
    return {"tokens": tokens, "chunks": chunks, "ttft_s": first, "usage": usage}


async def round_of(
    url: str, system: str, n: int, max_tokens: int, tag: str, extra: dict
) -> list[dict]:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        bodies = [
            {
                "messages": [
                    {"role": "system", "content": system},
                    {
                        "role": "user",
                        "content": f"Client {i} ({tag}): please review the "
                        f"{WORDS[i % len(WORDS)]} {WORDS[(3 * i + 1) % len(WORDS)]} code.",
                    },
                ],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            }
            for i in range(n)
        ]
        return await asyncio.gather(
            *(one_client(client, url, b, STAGGER_S * i) for i, b in enumerate(bodies))
        )


def one_launch(name: str, model: Path, system: str, args, rep: int) -> list[dict]:
    port = free_port()
    cmd, env = server_cmd(name, model, port, args)
    log = args.workdir / f"{name}-{args.shape}-{rep}.log"
    url = f"http://127.0.0.1:{port}"
    cwd = kvsnap_tree(name, args) if name.startswith("kvsnap") else None
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    # vllm-mlx wants the model named; the others serve their one model without it
    extra = {"model": str(model)} if name == "vllm-mlx" else {}
    rows = []
    try:
        ready = wait_ready(proc, url, log)
        # the shared prefix cached (and the kernels compiled) before anything is measured
        t0 = time.perf_counter()
        asyncio.run(round_of(url, system, 1, args.max_tokens, f"warm{rep}", extra))
        warm_s = time.perf_counter() - t0
        for n in args.clients:
            for _ in range(args.rounds):
                load = os.getloadavg()
                th0 = thread_cpu(proc.pid)
                cpu0, t0 = tree_cpu(proc.pid), time.perf_counter()
                res = asyncio.run(round_of(url, system, n, args.max_tokens, f"r{rep}n{n}", extra))
                wall, cpu = time.perf_counter() - t0, tree_cpu(proc.pid) - cpu0
                th1 = thread_cpu(proc.pid)
                tokens = sum(r["tokens"] for r in res)
                threads = sorted(
                    (round(1000 * (v - th0.get(k, 0.0)) / tokens, 2) for k, v in th1.items()),
                    reverse=True,
                )
                row = {
                    "server": name,
                    "rep": rep,
                    "clients": n,
                    "tokens": tokens,
                    "wall_s": round(wall, 3),
                    "tokens_per_s": round(tokens / wall, 2),
                    "cpu_s": round(cpu, 3),
                    "cpu_ms_per_token": round(1000 * cpu / tokens, 3),
                    "ttft_p50_s": round(statistics.median(r["ttft_s"] or 0 for r in res), 3),
                    "load": [round(x, 2) for x in load],
                    "ready_s": round(ready, 2),
                    "warm_request_s": round(warm_s, 2),
                    "threads_ms_per_token": [x for x in threads if x >= 0.05],
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return rows


def summarize(rows: list[dict], servers: list[str], clients: list[int]) -> list[dict]:
    """Medians per server and N, with each server's ratios to the peers' medians."""
    peers = {"mlx_lm.server": "mlx_lm", "vllm-mlx": "vllm_mlx"}
    out = []
    for n in clients:
        rounds = {s: [r for r in rows if r["server"] == s and r["clients"] == n] for s in servers}
        medians = {
            s: (
                statistics.median(r["tokens_per_s"] for r in mine),
                statistics.median(r["cpu_ms_per_token"] for r in mine),
            )
            for s, mine in rounds.items()
            if mine
        }
        for s, (tokens_per_s, cpu_ms) in medians.items():
            row = {
                "server": s,
                "clients": n,
                "rounds": len(rounds[s]),
                "tokens_per_s": tokens_per_s,
                "cpu_ms_per_token": cpu_ms,
            }
            for peer, tag in peers.items():
                if peer in medians:
                    row[f"throughput_vs_{tag}"] = round(tokens_per_s / medians[peer][0], 3)
                    row[f"cpu_vs_{tag}"] = round(cpu_ms / medians[peer][1], 3)
            out.append(row)
    return out


def plot(summaries: dict[str, list[dict]], path: Path) -> bool:
    """Tokens/s and CPU ms per token, per shape, N and server (False without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, len(summaries), figsize=(5.5 * len(summaries), 7), squeeze=False)
    for col, (shape, summary) in enumerate(summaries.items()):
        servers = list(dict.fromkeys(r["server"] for r in summary))
        clients = sorted({r["clients"] for r in summary})
        width = 0.8 / len(servers)
        for row, (key, label) in enumerate(
            (
                ("tokens_per_s", "tokens/s (higher is better)"),
                ("cpu_ms_per_token", "server CPU ms per token"),
            )
        ):
            ax = axes[row][col]
            for i, server in enumerate(servers):
                values = [
                    next(
                        (r[key] for r in summary if r["server"] == server and r["clients"] == n), 0
                    )
                    for n in clients
                ]
                xs = [c + (i - (len(servers) - 1) / 2) * width for c in range(len(clients))]
                ax.bar(xs, values, width, label=server, color=COLORS.get(server))
            ax.set_xticks(range(len(clients)), [f"{n} clients" for n in clients])
            ax.set_ylabel(label)
            ax.set_title(f"{shape}: {label.split(' (')[0]}")
            if row == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="mid", choices=sorted(SHAPES))
    ap.add_argument("--clients", default="8,16", help="concurrent clients per round, e.g. 8,16")
    ap.add_argument("--reps", type=int, default=2, help="launches per server (orders alternate)")
    ap.add_argument("--rounds", type=int, default=1, help="measured rounds per N per launch")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--servers", default="kvsnap,mlx_lm.server")
    ap.add_argument("--before", type=Path, help="a kvsnap checkout served as kvsnap-before")
    ap.add_argument("--vllm-python", help="python of an environment holding vllm-mlx")
    ap.add_argument(
        "--peer-env",
        action="append",
        default=[],
        help="KEY=VALUE for the peers' environment, e.g. OPENBLAS_THREAD_TIMEOUT=16 (kvsnap's)",
    )
    ap.add_argument(
        "--busy",
        type=int,
        default=0,
        help="N busy-loop processes beside the servers for the whole run (a loaded machine)",
    )
    ap.add_argument("--kvsnap-arg", action="append", default=[], help="extra kvsnap serve arg")
    ap.add_argument("--plot", type=Path, help="write the picture here (PNG)")
    ap.add_argument(
        "--plot-from", action="append", default=[], help="SHAPE=JSON of an earlier run: plot only"
    )
    ap.add_argument("--workdir", type=Path, default=Path(".kvsnap-bench/concurrent"))
    ap.add_argument("--out", type=Path, default=Path(".kvsnap-bench/concurrent"))
    args = ap.parse_args(argv)
    args.clients = [int(x) for x in args.clients.split(",")]
    servers = args.servers.split(",")
    if args.before:
        servers.append("kvsnap-before")
    if args.vllm_python and "vllm-mlx" not in servers:
        servers.append("vllm-mlx")
    if args.plot_from:  # one picture from earlier runs' JSON files (SHAPE=FILE each)
        summaries = {}
        for item in args.plot_from:
            shape, file = item.split("=", 1)
            summaries[shape] = json.loads(Path(file).read_text())["summary"]
        print(f"wrote {args.plot}" if plot(summaries, args.plot) else "matplotlib is missing")
        return 0
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model = make_model(args.shape, args.workdir)
    system = system_prompt(model, args.prefix_tokens)
    print(f"model {model} ({args.shape}), servers {servers}, clients {args.clients}", flush=True)
    rows: list[dict] = []
    busy = start_busy(args.busy)
    try:
        for rep in range(args.reps):
            order = servers if rep % 2 == 0 else servers[::-1]
            for name in order:
                rows.extend(one_launch(name, model, system, args, rep))
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    summary = summarize(rows, servers, args.clients)
    for s in summary:
        print(json.dumps(s), flush=True)
    print(f"load average at the end: {os.getloadavg()}")
    path = args.out / f"concurrent-{args.shape}.json"
    path.write_text(json.dumps({"rows": rows, "summary": summary, "argv": sys.argv}, indent=1))
    print(f"wrote {path}")
    if args.plot and plot({args.shape: summary}, args.plot):
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
