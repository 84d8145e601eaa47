#!/usr/bin/env python
"""Conversations across a restart (docs/benchmarks.md "Conversations across a
restart"): N conversations x T turns, a restart after turn R done three ways (none, SIGTERM,
kill -9), for each server:

  kvsnap-persist  kvsnap serve M --continuous-batching --kv-snapshots S --warm-prompts A
                  --persist-requests
  kvsnap          the same without --persist-requests
  vllm-mlx        vllm-mlx serve M --continuous-batching --warm-prompts A (its own prefix-cache
                  save at a graceful shutdown; one HOME across the restart)
  vllm-route      kvsnap vllm-mlx serve M --continuous-batching --kv-snapshots S --warm-prompts A
                  --persist-requests (in vllm-mlx's venv, this checkout on PYTHONPATH)

Every conversation shares one agent's system prompt (~1,500 tokens); user turns are 100-400
tokens and the assistant replies in the history 100-400-token texts the client writes (the
server generates --max-tokens tokens per turn, timed: the history is the client's, as with
any agent framework that edits or summarises replies). All conversations of a turn are sent
at once. Per turn: TTFT p50/p95, TPOT, cached tokens (kvsnap: usage; vllm-mlx: /v1/status).

    python scripts/bench_restart.py --size qwen3-0.6b --conversations 16 --turns 6
    python scripts/plot_restart.py .kvsnap-bench/restart/results.json docs/bench/restart.png

Results: WORKDIR/restart/results.json (one row per server x way x turn x conversation).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from kvsnap.blas import find_openblas, preload_openblas  # noqa: E402

preload_openblas()
from bench_table import StatusPoller  # noqa: E402

from kvsnap.tools.bench_startup import build_store, system_prompt_of  # noqa: E402
from kvsnap.tools.client import stream_chat  # noqa: E402
from kvsnap.tools.demo import DemoSpec, make_demo_model  # noqa: E402
from kvsnap.tools.serverproc import (  # noqa: E402
    ServerProcess,
    free_port,
    start_server,
    under_hard_limit,
)

SERVERS = ("kvsnap-persist", "kvsnap", "vllm-mlx", "vllm-route")
WAYS = ("none", "sigterm", "kill9")
WORDS = (
    "config parser request handler cache block token index file path error test retry budget "
    "latency server client thread queue write read lock shard store model layer prompt"
).split()


def text_of(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """Distinct text of about ``n_tokens`` tokens."""
    words = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < n_tokens:
        words += [rng.choice(WORDS) for _ in range(16)]
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids).strip()


def conversations(tokenizer, n: int, turns: int, seed: int) -> list[list[tuple[str, str]]]:
    """Per conversation, per turn: (user text, the assistant reply the client keeps)."""
    rng = random.Random(seed)
    return [
        [
            (
                text_of(tokenizer, rng.randint(100, 400), rng),
                text_of(tokenizer, rng.randint(100, 300), rng),
            )
            for _ in range(turns)
        ]
        for _ in range(n)
    ]


def launch(server: str, model: Path, store: Path, agents: Path, home: Path, log: Path, vllm_python):
    env = {
        "HOME": str(home),
        "KVSNAP_CACHE_DIR": str(home / "kvsnap-cache"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if server.startswith("kvsnap"):
        args = [
            "--continuous-batching",
            "--kv-snapshots",
            str(store),
            "--warm-prompts",
            str(agents),
        ]
        if server == "kvsnap-persist":
            args.append("--persist-requests")
        return start_server(model, args, log, env=env, limit_s=7200)
    port = free_port()
    if server == "vllm-route":
        cmd = [str(vllm_python), "-m", "kvsnap", "vllm-mlx", "serve", str(model)]
        cmd += ["--continuous-batching", "--kv-snapshots", str(store), "--persist-requests"]
    else:
        cmd = [str(vllm_python), "-m", "vllm_mlx.cli", "serve", str(model)]
        cmd += ["--continuous-batching"]
    cmd += ["--warm-prompts", str(agents), "--host", "127.0.0.1", "--port", str(port)]
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    full_env.update(env, PYTHONUNBUFFERED="1")
    if server == "vllm-route":
        full_env["PYTHONPATH"] = str(ROOT)
    blas = find_openblas()
    if blas:
        full_env["LD_PRELOAD"] = blas
    with open(log, "ab") as out:
        launched = time.perf_counter()
        proc = subprocess.Popen(
            under_hard_limit(cmd, 7200), stdout=out, stderr=subprocess.STDOUT, env=full_env
        )
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log, launched)


def restart(proc: ServerProcess, way: str, relaunch) -> tuple[ServerProcess, float]:
    """Stop ``proc`` the given way and start a new one; (server, seconds until ready)."""
    if way == "none":
        return proc, 0.0
    pid = proc.proc.pid
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    targets = [int(p) for p in children.split()] or [pid]  # the server under `timeout`
    for target in targets:
        os.kill(target, signal.SIGKILL if way == "kill9" else signal.SIGTERM)
    proc.proc.wait(120)
    new = relaunch()
    return new, new.wait_ready(1800)


def one_turn(url: str, model_id: str, histories: list[list], max_tokens: int, poll: bool) -> list:
    def send(messages):
        with httpx.Client(timeout=httpx.Timeout(3600, connect=10)) as client:
            r = stream_chat(client, url, model_id, messages, max_tokens=max_tokens)
        completion = int(r.usage.get("completion_tokens") or r.chunks)
        return {
            "ttft_s": r.ttft_s,
            "tpot_s": (r.total_s - r.ttft_s) / (completion - 1) if completion > 1 else None,
            "prompt_tokens": r.usage.get("prompt_tokens"),
            "cached_tokens": r.cached_tokens if r.usage else None,
        }

    if poll:  # vllm-mlx 0.6 reports cached tokens in /v1/status, not in usage
        with StatusPoller(url) as poller, ThreadPoolExecutor(len(histories)) as pool:
            rows = list(pool.map(send, histories))
        seen = sorted(poller.seen.values(), key=lambda s: s.get("prompt_tokens") or 0)
        by_len = {s.get("prompt_tokens"): s.get("cached_tokens") for s in seen}
        for row in rows:
            row["cached_tokens"] = by_len.get(row["prompt_tokens"], row["cached_tokens"])
        return rows
    with ThreadPoolExecutor(len(histories)) as pool:
        return list(pool.map(send, histories))


def conversation_bytes(store: Path) -> dict:
    """What the conversations hold on disk against their unique KV: the tokens of each record
    past the agent's, at the bytes per token of a full block."""
    from kvsnap.snapshot.file import read_header
    from kvsnap.store.conversation_space import conversation_stats
    from kvsnap.store.conversations import conversation_files
    from kvsnap.store.local import Store

    st = Store.open(store, readonly=True)
    s = conversation_stats(st)
    shared_tokens = max((i.n_tokens for i in st.scan()[0]), default=0)
    infos = [st.inspect(p) for p in conversation_files(store)]
    chain = infos[0].chain if infos else None
    if chain is None:
        return {"count": s.count, "bytes": s.nbytes}
    key, start, end = next(b for b in chain.blocks if b[2] - b[1] == chain.block_tokens)
    block = store / "blocks" / f"{key}.safetensors"
    per_token = (block.stat().st_size - read_header(block).data_start) / (end - start)
    # a conversation's turns kept up to their whole blocks are prefixes of its latest record
    leaves = [
        i
        for i in infos
        if not any(o.n_tokens > i.n_tokens and o.tokens[: i.n_tokens] == i.tokens for o in infos)
    ]
    unique = sum(max(0, i.n_tokens - shared_tokens) for i in leaves) * per_token
    return {
        "count": s.count,
        "conversations": len(leaves),
        "bytes": s.nbytes,
        "unique_kv_bytes": int(unique),
        "ratio": s.nbytes / unique if unique else None,
    }


def run(args, server: str, way: str, model: Path, agents: Path, store0: Path, system: str, convs):
    tag = f"{server}-{way}"
    work = Path(args.workdir).resolve() / "restart" / tag
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store = work / "snaps"
    shutil.copytree(store0, store)
    home = work / "home"
    home.mkdir()
    relaunch = lambda: launch(  # noqa: E731
        server, model, store, agents, home, work / "serve.log", args.vllm_python
    )
    proc = relaunch()
    rows, extra = [], {"server": server, "way": way}
    try:
        extra["ready_s"] = proc.wait_ready(1800)
        model_id = httpx.get(f"{proc.url}/v1/models", timeout=30).json()["data"][0]["id"]
        histories = [[{"role": "system", "content": system}] for _ in convs]
        for turn in range(args.turns):
            if turn == args.restart_after:
                proc, extra["restart_ready_s"] = restart(proc, way, relaunch)
            for h, conv in zip(histories, convs):
                h.append({"role": "user", "content": conv[turn][0]})
            results = one_turn(
                proc.url, model_id, histories, args.max_tokens, poll=server.startswith("vllm")
            )
            for i, (h, conv, r) in enumerate(zip(histories, convs, results)):
                rows.append({**extra, "turn": turn + 1, "conversation": i, **r})
                h.append({"role": "assistant", "content": conv[turn][1]})
            print(f"{tag} turn {turn + 1}: {summary(results)}", flush=True)
    finally:
        proc.stop(60)
    if server == "kvsnap-persist":
        extra_bytes = conversation_bytes(store)
        for r in rows:
            r["store_conversations"] = extra_bytes
    return rows


def summary(results: list) -> str:
    ttft = sorted(r["ttft_s"] for r in results)
    cached = sum(r["cached_tokens"] or 0 for r in results)
    prompt = sum(r["prompt_tokens"] or 0 for r in results)
    return (
        f"TTFT p50 {statistics.median(ttft):.2f}s p95 {ttft[int(0.95 * (len(ttft) - 1))]:.2f}s, "
        f"cached {cached}/{prompt}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="qwen3-0.6b", choices=("tiny", "small", "qwen3-0.6b"))
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--restart-after", type=int, default=3, help="restart before this turn+1")
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--report-bytes", metavar="STORE", help="only print a store's conversation bytes"
    )
    ap.add_argument("--workdir", default=".kvsnap-bench")
    ap.add_argument(
        "--vllm-python",
        default=str(Path.home() / ".cache/kvsnap-tests/vllm-mlx-venv/bin/python"),
        help="vllm-mlx's venv python (the tests' cached one by default)",
    )
    args = ap.parse_args()
    if args.report_bytes:
        print(json.dumps(conversation_bytes(Path(args.report_bytes))))
        return 0
    from transformers import AutoTokenizer

    work = Path(args.workdir).resolve()
    model = make_demo_model(work / f"demo-{args.size}", DemoSpec(size=args.size))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    system = system_prompt_of(tokenizer, args.system_tokens, salt="Agent restart.")
    agents = work / "restart-agents.json"
    agents.write_text(
        json.dumps([{"name": "agent", "messages": [{"role": "system", "content": system}]}])
    )
    store0 = work / "restart-snaps"
    if not store0.exists():
        build_store(model, agents, store0, {"KVSNAP_CACHE_DIR": str(work / "cache")})
    convs = conversations(tokenizer, args.conversations, args.turns, args.seed)
    out = work / "restart" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(out.read_text()) if out.exists() else []
    for server in args.servers.split(","):
        for way in args.ways.split(","):
            if server.startswith("vllm") and not Path(args.vllm_python).exists():
                print(f"skip {server}: no {args.vllm_python}", flush=True)
                continue
            rows = [r for r in rows if (r["server"], r["way"]) != (server, way)]
            rows += run(args, server, way, model, agents, store0, system, convs)
            out.write_text(json.dumps(rows, indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
