"""Start-up benchmark: cold vs --warm-prompts vs --kv-snapshots servers, launched interleaved.

Each launch is measured from the moment the process starts: time to warm-ready
(/health 200), the warm-up phase the server itself reports (model loaded -> warm, from
``/v1/status``), the first agent request's TTFT and time per output token, and the
server's resident memory.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

MODES = ("cold", "warm-prompts", "kv-snapshots")
FILLER = (
    "You are an agent that reviews code, plans tasks and calls tools. Read the request, check the "
    "data, "
    "list the steps, explain each fix briefly and never answer without checking the tests first. "
)


@dataclass
class Launch:
    mode: str
    rep: int
    prompt_tokens: int
    agents: int
    ready_s: float = 0.0
    warmup_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    first_token_from_launch_s: float = 0.0
    rss_mb: float = 0.0
    cpu_s: float = 0.0  # the server's CPU seconds (user + system, its process tree) at ready
    cached_tokens: int = 0
    completion_tokens: int = 0


def system_prompt_of(tokenizer, n_tokens: int, salt: str = "") -> str:
    """Text whose encoding is about ``n_tokens`` tokens (distinct per salt)."""
    text = salt + " "
    while len(tokenizer.encode(text, add_special_tokens=False)) < n_tokens:
        text += FILLER
    ids = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def child_rss_mb(pid: int) -> float:
    """RSS of the server: the python child under `timeout`, else the process itself."""

    def rss(p: int) -> float:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return 0.0
        return 0.0

    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return max([rss(pid)] + [rss(int(c)) for c in children])


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) so far of ``pid`` and its children (the server under
    ``timeout``), from /proc: the work done, whatever share of a busy machine it got."""
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu(p: int) -> float:
        try:
            raw = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            return 0.0
        fields = raw[raw.rindex(")") + 2 :].split()
        return sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks  # utime stime cutime cstime

    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return cpu(pid) + sum(tree_cpu_s(int(c)) for c in children)


def split_mode(mode: str) -> tuple[str, Path | None]:
    """``"kv-snapshots@/tmp/before"`` -> (``"kv-snapshots"``, the checkout to launch)."""
    name, _, root = mode.partition("@")
    return name, Path(root) if root else None


def mode_args(mode: str, agents_file: Path, store: Path) -> list[str]:
    mode = split_mode(mode)[0]
    args = ["--continuous-batching"]
    if mode == "warm-prompts":
        args += ["--warm-prompts", str(agents_file)]
    elif mode == "kv-snapshots":
        args += [
            "--warm-prompts",
            str(agents_file),
            "--kv-snapshots",
            str(store),
            "--no-write-back",
        ]
    return args


def launch_once(
    mode: str,
    rep: int,
    model: Path,
    agents_file: Path,
    store: Path,
    first_messages: list,
    prompt_tokens: int,
    n_agents: int,
    workdir: Path,
    max_tokens: int = 16,
    env: dict | None = None,
    request: bool = True,
) -> Launch:
    import httpx

    from kvsnap.tools.client import stream_chat
    from kvsnap.tools.serverproc import start_server

    row = Launch(mode=mode, rep=rep, prompt_tokens=prompt_tokens, agents=n_agents)
    root = split_mode(mode)[1]  # another checkout: `python -m kvsnap` run from its folder
    server = start_server(
        model,
        mode_args(mode, agents_file, store),
        workdir / f"{mode.replace('/', '_')}-{rep}.log",
        env=env,
        limit_s=3600,
        prefix=["env", "-C", str(root)] if root else None,
    )
    try:
        row.ready_s = server.wait_ready(timeout=3000)
        row.cpu_s = round(tree_cpu_s(server.proc.pid), 2)
        warmup = server.status()["warmup"]  # the report the warm-up log line is written from
        row.warmup_s = float(warmup["seconds"]) if warmup else 0.0
        row.rss_mb = child_rss_mb(server.proc.pid)
        # ready time only: a cold server's first request would prefill the whole prompt
        if not request:
            return row
        with httpx.Client(timeout=3000) as client:
            res = stream_chat(client, server.url, model.name, first_messages, max_tokens=max_tokens)
        row.ttft_s = res.ttft_s
        row.completion_tokens = int(res.usage.get("completion_tokens", 0))
        row.cached_tokens = res.cached_tokens
        row.tpot_s = (res.total_s - res.ttft_s) / max(1, row.completion_tokens - 1)
        row.first_token_from_launch_s = (
            time.perf_counter() - server.launched_at - (res.total_s - res.ttft_s)
        )
        row.rss_mb = max(row.rss_mb, child_rss_mb(server.proc.pid))
    finally:
        server.stop()
    return row


@dataclass
class SweepPoint:
    model: Path
    prompt_tokens: int
    agents: int
    reps: int = 5
    rows: list[Launch] = field(default_factory=list)
    modes: tuple[str, ...] = MODES
    request: bool = True


def prepare_point(point: SweepPoint, workdir: Path, env: dict) -> tuple[Path, Path, list]:
    """Write the agents file for this point and build its snapshots (timed separately)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(point.model))
    agents: list[dict[str, Any]] = [
        {
            "name": f"agent-{i}",
            "messages": [
                {
                    "role": "system",
                    "content": system_prompt_of(tok, point.prompt_tokens, salt=f"Agent {i}."),
                }
            ],
        }
        for i in range(point.agents)
    ]
    tag = f"{point.model.name}-{point.prompt_tokens}t-{point.agents}a"
    agents_file = workdir / f"agents-{tag}.json"
    agents_file.write_text(json.dumps(agents))
    store = workdir / f"snaps-{tag}"
    build_store(point.model, agents_file, store, env)
    first = agents[0]["messages"] + [
        {"role": "user", "content": "Please review the function and explain the fix."}
    ]
    return agents_file, store, first


def build_store(model: Path, agents_file: Path, store: Path, env: dict) -> None:
    """`kvsnap build` in its own process, with the servers' environment: the model it loads
    is gone before the first launch is measured."""
    cmd = [
        sys.executable,
        "-m",
        "kvsnap",
        "build",
        str(agents_file),
        "--model",
        str(model),
        "--out",
        str(store),
    ]
    rc = subprocess.run(cmd, env={**os.environ, **env}).returncode
    if rc != 0:
        raise RuntimeError(
            f"`kvsnap build {agents_file} --model {model} --out {store}` exited with {rc} (its "
            f"output is above)"
        )


def run_point(
    point: SweepPoint, workdir: Path, deadline: float, env: dict, log: Callable[[str], None] = print
) -> list[Launch]:
    agents_file, store, first = prepare_point(point, workdir, env)
    for rep in range(point.reps):
        # interleaved, so drift on a shared machine hits every mode alike; every second rep
        # in the reverse order
        for mode in point.modes if rep % 2 == 0 else point.modes[::-1]:
            if time.monotonic() > deadline:
                log(
                    f"budget reached: stopping {point.model.name} {point.prompt_tokens}t at rep "
                    f"{rep}"
                )
                return point.rows
            row = launch_once(
                mode,
                rep,
                point.model,
                agents_file,
                store,
                first,
                point.prompt_tokens,
                point.agents,
                workdir,
                env=env,
                request=point.request,
            )
            point.rows.append(row)
            log(
                f"{point.model.name} {point.prompt_tokens:>5}t x{point.agents:<3} {mode:<13} rep "
                f"{rep}: ready {row.ready_s:7.2f}s warm-up {row.warmup_s:7.2f}s TTFT "
                f"{row.ttft_s * 1000:8.1f} ms TPOT {row.tpot_s * 1000:6.1f} ms RSS "
                f"{row.rss_mb:7.0f} MB CPU {row.cpu_s:5.2f}s cached {row.cached_tokens} load "
                f"{os.getloadavg()[0]:.2f}"
            )
    return point.rows


def per_agent(med: list[dict], base: str = "cold") -> list[dict]:
    """What each agent adds to launch -> ready over ``base`` at the same point, in wall and in
    CPU milliseconds (a figure the machine's load moves far less)."""
    out = []
    for m in med:
        mode, root = split_mode(m["mode"])
        if mode == base:
            continue
        ref_name = base + (f"@{root}" if root else "")
        ref = [
            r
            for r in med
            if (r["prompt_tokens"], r["agents"], r["mode"])
            == (m["prompt_tokens"], m["agents"], ref_name)
        ]
        if not ref or not m["agents"]:
            continue
        out.append(
            {
                "mode": m["mode"],
                "agents": m["agents"],
                "prompt_tokens": m["prompt_tokens"],
                "ms_per_agent": (m["ready_s"] - ref[0]["ready_s"]) * 1000 / m["agents"],
                "cpu_ms_per_agent": (m["cpu_s"] - ref[0]["cpu_s"]) * 1000 / m["agents"],
            }
        )
    return out


def medians(rows: list[Launch]) -> list[dict]:
    out = []
    keys = sorted(
        {(r.prompt_tokens, r.agents, r.mode) for r in rows},
        key=lambda k: (k[0], k[1], MODES.index(split_mode(k[2])[0]), k[2]),
    )
    for pt, ag, mode in keys:
        sel = [r for r in rows if (r.prompt_tokens, r.agents, r.mode) == (pt, ag, mode)]
        med = {"prompt_tokens": pt, "agents": ag, "mode": mode, "launches": len(sel)}
        for f in (
            "ready_s",
            "warmup_s",
            "ttft_s",
            "tpot_s",
            "first_token_from_launch_s",
            "rss_mb",
            "cpu_s",
            "cached_tokens",
        ):
            med[f] = statistics.median(getattr(r, f) for r in sel)
        out.append(med)
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_raw(path: Path, rows: list[Launch]) -> None:
    write_csv(path, [asdict(r) for r in rows])
