#!/usr/bin/env python
"""docs/mlx-lm.md's side-by-side table: three servers on one model, from a restart.

    python scripts/bench_mlx_lm.py                          # Qwen3-0.6B-shaped fp32, 3 reps
    python scripts/bench_mlx_lm.py --size tiny --reps 1     # a smoke run, seconds

Servers, each a real process on 127.0.0.1, launched in turn (order rotated every repetition):

  mlx_lm.server       python -m mlx_lm.server --model M                        (cold)
  kvsnap mlx-lm serve kvsnap mlx-lm serve --model M --kv-snapshots S1          (--for mlx-lm)
  kvsnap serve        kvsnap serve M --kv-snapshots S2 --warm-prompts A

S1 and S2 are built once beforehand (`kvsnap build A --model M --out S1 --for mlx-lm`; S2
without --for). Per launch: launch -> /health 200, then agent 1's request (streamed: TTFT to
the first content chunk, launch -> that chunk), then agent 2's; `cached_tokens` from usage;
answer texts at temperature 0. All servers get OpenBLAS through LD_PRELOAD (DESIGN.md §6).
Writes OUT/mlx_lm-TAG.json (every launch, the builds, medians) and OUT/mlx_lm-TAG.md (the
table); OUT/mlx_lm-TAG.png too when matplotlib is installed.

    python scripts/bench_mlx_lm.py --ready-only --size mid --tokens 2200 --reps 5 \
        --before /tmp/before-ready                          # issue 41 item 2

--ready-only measures launch -> /health 200 only, with the server's CPU seconds at that moment
(its process tree, /proc): mlx_lm.server, kvsnap serve with nothing to warm ("cold") and
kvsnap serve --kv-snapshots of one agent of --tokens tokens ("1 snapshot"); with --before ROOT,
the same two kvsnap launches of the checkout at ROOT too. Every rep runs the servers in a
rotated order, and every second rep reversed; the 1-minute load average is printed per launch.
Python bytecode is written to WORKDIR/pycache and one untimed launch of each server goes first,
as for an installed kvsnap (pip compiles it); --no-bytecode keeps the environment's
PYTHONDONTWRITEBYTECODE. Writes OUT/ready-TAG.json and OUT/ready-TAG.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvsnap.blas import find_openblas, preload_openblas  # noqa: E402

preload_openblas()  # before mlx loads (the demo model is made here)
from kvsnap.tools.demo import DemoSpec, make_demo_model  # noqa: E402
from kvsnap.tools.serverproc import ServerProcess, free_port, under_hard_limit  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_agents import tree_cpu_s  # noqa: E402

KVSNAP = (sys.executable, "-m", "kvsnap")
SERVERS = ("mlx_lm.server", "kvsnap mlx-lm serve", "kvsnap serve")
AGENT_HEADS = (
    "You are the house code reviewer for a python and rust server. Read the tests first. ",
    "You plan the work of a small infrastructure team, step by step, with owners and risks. ",
)
USER = ("Please review the request handler.", "Plan the database migration for next week.")
_WORDS = (
    "request handler parser cache eviction policy flaky test build pipeline retry loop database "
    "migration logging setup function class module error value return import file path server "
    "response token review check fix explain step plan data time week goal code thread lock queue"
).split()


def system_prompt(tokenizer, head: str, target: int, seed: int) -> str:
    """``head`` then seeded words, cut to the shortest text of at least ``target`` tokens."""
    rng = random.Random(seed)
    words = head.split() + [rng.choice(_WORDS) for _ in range(target * 2)]

    def count(n: int) -> int:
        return len(tokenizer.encode(" ".join(words[:n]), add_special_tokens=False).ids)

    lo, hi = 1, len(words)
    while lo < hi:  # bisect: the word count where the text first reaches target tokens
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < target else (lo, mid)
    return " ".join(words[:lo])


def make_agents(model: Path, tokens: list[int], path: Path) -> list[dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    agents = [
        {
            "name": f"agent{i + 1}",
            "messages": [
                {"role": "system", "content": system_prompt(tok, AGENT_HEADS[i], n, seed=i)}
            ],
        }
        for i, n in enumerate(tokens)
    ]
    path.write_text(json.dumps(agents, indent=1))
    return agents


def server_env(workdir: Path) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "KVSNAP_CACHE_DIR": str(workdir / "cache"),
    }
    blas = find_openblas()
    if blas:  # python -m mlx_lm.server would otherwise run on mlx-cpu's reference BLAS
        env["LD_PRELOAD"] = blas
    return env


def build(model: Path, agents: Path, out: Path, extra: list[str], env: dict) -> dict:
    cmd = [*KVSNAP, "build", str(agents), "--model", str(model), "--out", str(out), "--json"]
    cmd += extra
    t0 = time.perf_counter()
    r = subprocess.run(under_hard_limit(cmd, 1800), capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"build failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    report = json.loads(r.stdout)
    return {
        "command": " ".join(cmd[1:]),
        "seconds": round(time.perf_counter() - t0, 2),
        "entries": [
            {k: e.get(k) for k in ("name", "status", "n_tokens", "tokens_prefilled")}
            for e in report["entries"]
        ],
    }


def command(server: str, model: Path, agents: Path, stores: dict) -> list[str]:
    if server == "mlx_lm.server":
        return [sys.executable, "-m", "mlx_lm.server", "--model", str(model)]
    mlx_store, kv_store = str(stores["mlx-lm"]), str(stores["kvsnap"])
    if server == "kvsnap mlx-lm serve":
        return [*KVSNAP, "mlx-lm", "serve", "--model", str(model), "--kv-snapshots", mlx_store]
    return [*KVSNAP, "serve", str(model), "--kv-snapshots", kv_store, "--warm-prompts", str(agents)]


def launch(cmd: list[str], log: Path, env: dict, cwd: Path | None = None) -> ServerProcess:
    port = free_port()
    full = under_hard_limit([*cmd, "--host", "127.0.0.1", "--port", str(port)], 900)
    with open(log, "wb") as out:
        t0 = time.perf_counter()  # before Popen: interpreter start and imports count
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    return ServerProcess(proc=proc, url=f"http://127.0.0.1:{port}", log_path=log, launched_at=t0)


def ask(
    server: ServerProcess, body_model: str | None, system: str, user: str, max_tokens: int
) -> dict:
    """One streamed chat request; TTFT is the first chunk with content."""
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if body_model:  # kvsnap serve needs it; mlx_lm.server would load another model by that name
        body["model"] = body_model
    text, usage, ttft = "", {}, None
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code} from {server.url}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter()
                    text += piece
    if ttft is None:
        raise RuntimeError(f"no content chunk from {server.url}; usage {usage}")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": round(ttft - t0, 4),
        "first_token_from_launch_s": round(ttft - server.launched_at, 3),
        "text": text,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
    }


def warmup_report(server_name: str, server: ServerProcess) -> dict | str | None:
    """What the server says it restored or prefilled before it was ready."""
    if server_name == "kvsnap serve":
        return server.status().get("warmup")
    if server_name == "kvsnap mlx-lm serve":
        found = re.findall(r"Warm-up done[^\n]*", server.log())
        return found[-1] if found else None
    return None


def one_launch(name: str, ctx: SimpleNamespace, rep: int) -> dict:
    """One launch of ``name``: ready, then each agent's first request; the server stopped."""
    logs = ctx.workdir / "logs"
    logs.mkdir(exist_ok=True)
    log = logs / f"{name.replace(' ', '_')}-{rep}.log"
    load_before = os.getloadavg()[0]  # the 2 cores are shared: a busy machine shows here
    server = launch(command(name, ctx.model, ctx.agents_file, ctx.stores), log, ctx.env)
    try:
        ready = server.wait_ready(900)
        body_model = ctx.model.name if name == "kvsnap serve" else None
        answers = [
            ask(server, body_model, a["messages"][0]["content"], USER[i], ctx.max_tokens)
            for i, a in enumerate(ctx.agents)
        ]
        warm = warmup_report(name, server)
    finally:
        rc = server.stop()
    row = {
        "server": name,
        "rep": rep,
        "ready_s": round(ready, 3),
        "answers": answers,
        "warmup": warm,
        "exit_code": rc,
        "log": str(log),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    a1 = answers[0]
    print(
        f"rep {rep} {name:<20} ready {ready:6.2f}s  TTFT {a1['ttft_s']:7.3f}s  launch->token "
        f"{a1['first_token_from_launch_s']:6.2f}s  cached {a1['cached_tokens']}/"
        f"{a1['prompt_tokens']}  {a1['text']!r}",
        flush=True,
    )
    return row


def med(rows: list[dict], pick) -> float:
    return round(statistics.median(pick(r) for r in rows), 3)


def summarize(runs: list[dict]) -> list[dict]:
    texts = {(i, a["text"]) for r in runs for i, a in enumerate(r["answers"])}
    same = len(texts) == len({i for i, _ in texts})  # one text per agent over every launch
    out = []
    for name in SERVERS:
        rows = [r for r in runs if r["server"] == name]
        out.append(
            {
                "server": name,
                "launches": len(rows),
                "ready_s": med(rows, lambda r: r["ready_s"]),
                "ttft_agent1_s": med(rows, lambda r: r["answers"][0]["ttft_s"]),
                "first_token_from_launch_s": med(
                    rows, lambda r: r["answers"][0]["first_token_from_launch_s"]
                ),
                "ttft_agent2_s": med(rows, lambda r: r["answers"][1]["ttft_s"]),
                "cached_tokens": sorted(
                    {tuple(a["cached_tokens"] for a in r["answers"]) for r in rows}
                ),
                "prompt_tokens": sorted(
                    {tuple(a["prompt_tokens"] for a in r["answers"]) for r in rows}
                ),
                "answers_identical_across_servers": same,
            }
        )
    return out


def table(summary: list[dict]) -> str:
    lines = [
        "| server | ready | 1st agent TTFT | launch → 1st token | 2nd agent TTFT "
        "| cached / prompt tokens (agent 1, 2) | same answers |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for s in summary:
        cached = "; ".join(
            ", ".join(f"{c} / {p}" for c, p in zip(cs, ps))
            for cs, ps in zip(s["cached_tokens"], s["prompt_tokens"])
        )
        lines.append(
            f"| {s['server']} | {s['ready_s']:.2f} s | {s['ttft_agent1_s']:.2f} s "
            f"| {s['first_token_from_launch_s']:.2f} s | {s['ttft_agent2_s']:.2f} s "
            f"| {cached} | {'yes' if s['answers_identical_across_servers'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'kvsnap[bench]')")
        return False
    fig, ax = plt.subplots(figsize=(7, 3))
    names = [s["server"] for s in summary]
    ready = [s["ready_s"] for s in summary]
    rest = [s["first_token_from_launch_s"] - s["ready_s"] for s in summary]
    ax.barh(names, ready, label="launch → /health 200")
    ax.barh(names, rest, left=ready, label="→ first token of agent 1")
    ax.set_xlabel("seconds (median)")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def ready_servers(before: Path | None) -> list[tuple[str, Path | None]]:
    """(server, checkout) pairs of --ready-only: None runs this checkout's kvsnap."""
    names = ["mlx_lm.server", "kvsnap cold", "kvsnap 1 snapshot"]
    out: list[tuple[str, Path | None]] = [(n, None) for n in names]
    if before is not None:
        out += [(n, before) for n in names[1:]]
    return out


def ready_launch(name: str, root: Path | None, ctx: SimpleNamespace, rep: int) -> dict:
    """One launch -> /health 200, the server's CPU seconds then; the server stopped."""
    if name == "mlx_lm.server":
        cmd = command(name, ctx.model, ctx.agents_file, ctx.stores)
    else:
        cmd = [*KVSNAP, "serve", str(ctx.model)]
        cmd += ["--kv-snapshots", str(ctx.stores["kvsnap"])] if "snapshot" in name else []
    label = f"{name} @before" if root is not None else name
    env = {**ctx.env, "PYTHONPATH": str(root)} if root is not None else ctx.env
    log = ctx.workdir / "logs" / f"ready-{label.replace(' ', '_')}-{rep}.log"
    log.parent.mkdir(exist_ok=True)
    load = os.getloadavg()[0]
    server = launch(cmd, log, env, cwd=root or ROOT)
    try:
        ready = server.wait_ready(900)
        cpu = tree_cpu_s(server.proc.pid)
        # a one-token request sent at the first 200: what a client sees, whatever 200 means
        # (kvsnap: its API may still be importing; mlx_lm.server: its model not yet loaded)
        body = {"model": "default_model", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={**body, "max_tokens": 1, "temperature": 0},
            timeout=900,
        )
        r.raise_for_status()
        first = time.perf_counter() - server.launched_at
    finally:
        rc = server.stop()
    print(
        f"rep {rep} {label:<28} ready {ready:6.3f} s  first token {first:6.3f} s  "
        f"CPU {cpu:5.2f} s  load {load:.2f}"
    )
    return {
        "server": label,
        "rep": rep,
        "ready_s": round(ready, 3),
        "first_token_s": round(first, 3),
        "cpu_s": cpu,
        "loadavg_1m": round(load, 2),
        "exit_code": rc,
    }


def ready_table(runs: list[dict]) -> tuple[list[dict], str]:
    names = list(dict.fromkeys(r["server"] for r in runs))
    summary = []
    for name in names:
        rows = [r for r in runs if r["server"] == name]
        summary.append(
            {
                "server": name,
                "launches": len(rows),
                "ready_s": med(rows, lambda r: r["ready_s"]),
                "ready_range_s": [min(r["ready_s"] for r in rows), max(r["ready_s"] for r in rows)],
                "first_token_s": med(rows, lambda r: r["first_token_s"]),
                "cpu_s": med(rows, lambda r: r["cpu_s"]),
                "loadavg_1m": med(rows, lambda r: r["loadavg_1m"]),
            }
        )
    lines = [
        "| server | launch → /health 200, median (range) | launch → first token of a request "
        "sent at 200, median | CPU s at ready, median | load |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in summary:
        lo, hi = s["ready_range_s"]
        lines.append(
            f"| {s['server']} | {s['ready_s']:.3f} s ({lo:.2f}–{hi:.2f}) "
            f"| {s['first_token_s']:.3f} s | {s['cpu_s']:.2f} "
            f"| {s['loadavg_1m']:.2f} |"
        )
    return summary, "\n".join(lines) + "\n"


def ready_main(args, model: Path, env: dict) -> int:
    """--ready-only: launch -> /health 200 and the CPU seconds it took, servers interleaved."""
    tokens = [int(t) for t in args.tokens.split(",")][:1]
    agents_file = args.workdir / "agents-ready.json"
    make_agents(model, tokens, agents_file)
    stores = {"mlx-lm": None, "kvsnap": args.workdir / "snaps-ready"}
    if not stores["kvsnap"].exists():  # built once per workdir
        print("build:", json.dumps(build(model, agents_file, stores["kvsnap"], [], env)))
    if not args.no_bytecode:  # as installed: pip compiles every module once (see --no-bytecode)
        env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(args.workdir / "pycache")
    ctx = SimpleNamespace(
        workdir=args.workdir, model=model, env=env, agents_file=agents_file, stores=stores
    )
    servers = ready_servers(args.before.resolve() if args.before else None)
    for name, root in servers:  # untimed: writes the bytecode, warms the page cache
        ready_launch(name, root, ctx, -1)
    runs = []
    print(f"load average at start: {os.getloadavg()}")
    for rep in range(args.reps):
        k = rep % len(servers)
        order = servers[k:] + servers[:k]  # each server leads once in turn ...
        order = order[::-1] if rep % 2 else order  # ... and every second rep runs reversed
        runs += [ready_launch(n, root, ctx, rep) for n, root in order]
    summary, md = ready_table(runs)
    print(md)
    tag = args.tag or model.name
    (args.out / f"ready-{tag}.md").write_text(md)
    result = {
        "command": " ".join(sys.argv),
        "model": str(model),
        "snapshot_tokens": tokens[0],
        "bytecode": not args.no_bytecode,
        "openblas": env.get("LD_PRELOAD"),
        "summary": summary,
        "runs": runs,
    }
    (args.out / f"ready-{tag}.json").write_text(json.dumps(result, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="qwen3-0.6b", choices=("tiny", "small", "mid", "qwen3-0.6b"))
    ap.add_argument("--model", help="use this model folder instead of a demo model")
    ap.add_argument("--tokens", default="1800,1600", help="two agents' system-prompt tokens")
    ap.add_argument("--reps", type=int, default=3, help="launches per server (median reported)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=Path(".kvsnap-bench/mlx-lm"))
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--tag", default="", help="output name suffix (default: the model's name)")
    ap.add_argument("--ready-only", action="store_true", help="launch -> /health 200 only")
    ap.add_argument("--before", type=Path, help="--ready-only: also launch kvsnap from this tree")
    ap.add_argument(
        "--no-bytecode",
        action="store_true",
        help="--ready-only: keep PYTHONDONTWRITEBYTECODE from the environment (every launch "
        "compiles kvsnap's modules from source, as in a checkout run with it set)",
    )
    args = ap.parse_args()
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model).resolve()
    elif args.size == "mid":  # 8 layers, 512 wide: issue 41's shape
        from bench_shared_prefix import make_model

        model = make_model(args.workdir)
    else:
        spec = DemoSpec(arch="dense", size=args.size, text_outputs=True)
        model = make_demo_model(args.workdir / f"demo-{args.size}", spec)
    if args.ready_only:
        return ready_main(args, model, server_env(args.workdir))
    tokens = [int(t) for t in args.tokens.split(",")]
    if len(tokens) != 2:
        raise SystemExit(
            f"--tokens {args.tokens!r}: give two counts, one per agent, e.g. 1800,1600"
        )
    agents_file = args.workdir / "agents.json"
    agents = make_agents(model, tokens, agents_file)
    env = server_env(args.workdir)
    stores = {"mlx-lm": args.workdir / "snaps-mlx-lm", "kvsnap": args.workdir / "snaps-kvsnap"}
    builds = {
        "mlx-lm": build(model, agents_file, stores["mlx-lm"], ["--for", "mlx-lm"], env),
        "kvsnap": build(model, agents_file, stores["kvsnap"], [], env),
    }
    print("builds:", json.dumps(builds), flush=True)
    ctx = SimpleNamespace(
        workdir=args.workdir,
        model=model,
        agents=agents,
        env=env,
        agents_file=agents_file,
        stores=stores,
        max_tokens=args.max_tokens,
    )
    runs = []
    for rep in range(args.reps):
        order = SERVERS[rep % 3 :] + SERVERS[: rep % 3]  # interleaved: each server leads once
        runs += [one_launch(n, ctx, rep) for n in order]
    summary = summarize(runs)
    tag = args.tag or model.name
    md = table(summary)
    print(md)
    (args.out / f"mlx_lm-{tag}.md").write_text(md)
    result = {
        "command": " ".join(sys.argv),
        "model": str(model),
        "size": args.size,
        "agents": agents,
        "users": USER,
        "max_tokens": args.max_tokens,
        "openblas": env.get("LD_PRELOAD"),
        "builds": builds,
        "commands": {n: command(n, model, agents_file, stores) for n in SERVERS},
        "summary": summary,
        "runs": runs,
    }
    (args.out / f"mlx_lm-{tag}.json").write_text(json.dumps(result, indent=1))
    plot(summary, args.out / f"mlx_lm-{tag}.png", f"restart to first token, {tag}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
