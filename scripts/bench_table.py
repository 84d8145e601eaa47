#!/usr/bin/env python
"""The original warm-prompts table, side by side: kvsnap and vllm-mlx, cold / warm /
snapshots.

For every repetition × family × concurrency × mode (in that nesting, the mode order rotated
each repetition, so modes interleave), a **fresh server** starts in its own HOME and gets
`concurrency` requests at once, each with a user prompt no other request in the run has,
behind one system prompt (the warm prompt). Modes:

  kvsnap-cold    kvsnap serve M --continuous-batching
  kvsnap-warm    ... --warm-prompts A
  kvsnap-snap    ... --warm-prompts A --kv-snapshots S --no-write-back   (S built once beforehand)
  vllm-cold      vllm-mlx serve M --continuous-batching                 (vllm-mlx 0.6, its own venv)
  vllm-warm      ... --warm-prompts A
  vllm-kvsnap    kvsnap vllm-mlx serve M --continuous-batching --kv-snapshots S' --warm-prompts A

Per request: TTFT, decode tok/s, prompt and cached tokens (kvsnap: `usage`; vllm-mlx 0.6
reports none there, so its `/v1/status` `requests[].cached_tokens` is polled while requests
run). Per server: launch → ready, and the prompt tokens computed at start (kvsnap: the
warm-up report in `/v1/status`; vllm-mlx: its `/v1/status` `total_prompt_tokens`; the
vllm-mlx route: `/v1/kvsnap/status`), never a log line. Plus the restart case: launch → first
token of the first agent request (a ≤ 32-token user message) on the Qwen3-0.6B-shaped fp32
model, for `--warm-prompts` servers against `--kv-snapshots` ones.

    python scripts/bench_table.py --smoke                         # tiny models, short prompts, 1
    rep: minutes
    python scripts/bench_table.py --budget-minutes 120 --out DIR  # the table for docs/benchmarks.md
    python scripts/plot_bench.py --table DIR/summary.json --out DIR/plot   # plots again, from the
    summary

Writes DIR/cells/*.json (one per server run), DIR/restart/*.json, DIR/summary.json,
DIR/summary.md (the table, medians) and DIR/plot-<family>.png; logs under DIR/logs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # helpers: the vllm-mlx venv's cache and environment

from kvsnap.blas import find_openblas, preload_openblas  # noqa: E402

preload_openblas()  # before mlx loads (the demo models and the rate probe use it here)
from helpers.cli import build_args, kvsnap_argv  # noqa: E402
from helpers.vllm_mlx_route import _cache_root, _venv_env  # noqa: E402

from kvsnap.tools.client import stream_chat  # noqa: E402
from kvsnap.tools.demo import DemoSpec, make_demo_model  # noqa: E402
from kvsnap.tools.serverproc import ServerProcess, free_port, start_server, under_hard_limit


@dataclass(frozen=True)
class Family:
    label: str  # the original table's model
    spec: DemoSpec


# The original table's four families at the 2-core size (shapes and reasons: docs/benchmarks.md).
FAMILIES = {
    "qwen3-0.6b-8bit": Family(
        "Qwen3-0.6B-8bit", DemoSpec(arch="dense", size="small", quantize_bits=8)
    ),
    "llama-3.2-3b-4bit": Family(
        "Llama-3.2-3B-Instruct-4bit", DemoSpec(arch="llama", size="small", quantize_bits=4)
    ),
    "qwen3-4b-4bit": Family(
        "Qwen3-4B-4bit", DemoSpec(arch="dense", size="small", quantize_bits=4, seed=1)
    ),
    "qwen3.6-35b-a3b-4bit": Family(
        "Qwen3.6-35B-A3B-4bit (MoE hybrid)", DemoSpec(arch="moe", size="small", quantize_bits=4)
    ),
}
RESTART_FAMILY = Family(
    "Qwen3-0.6B-shaped, fp32", DemoSpec(arch="dense", size="qwen3-0.6b", text_outputs=True)
)

KVSNAP_MODES = ("kvsnap-cold", "kvsnap-warm", "kvsnap-snap")
VLLM_MODES = ("vllm-cold", "vllm-warm", "vllm-kvsnap")
MODES = KVSNAP_MODES + VLLM_MODES
RESTART_MODES = ("kvsnap-warm", "kvsnap-snap", "vllm-warm", "vllm-kvsnap")
# (server, cold mode, warm mode, snapshot mode) for the summary rows.
SERVERS = (
    ("kvsnap", "kvsnap-cold", "kvsnap-warm", "kvsnap-snap"),
    ("vllm-mlx", "vllm-cold", "vllm-warm", "vllm-kvsnap"),
)

_WORDS = (
    "request handler parser cache eviction policy flaky test build pipeline retry loop database "
    "migration "
    "logging setup function class module error value return import file path server response token "
    "review check fix explain step plan data time week goal code rust python thread lock queue "
    "budget"
).split()
SYSTEM_HEAD = (
    "You are the house code reviewer for a python and rust server. Read the tests first, "
    "then every function. "
)


# --- prompts -------------------------------------------------------------------------------


class TokenCounter:
    """Counts tokens with the family's own tokenizer.json (no special tokens: the template brings
    them)."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def __call__(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)


def text_of(count: TokenCounter, head: str, target: int, seed: int) -> str:
    """``head`` then seeded words until ``target`` tokens (within a few)."""
    rng = random.Random(seed)
    words = [head]
    # enough words, then the shortest prefix that reaches target
    while count(" ".join(words)) < target:
        words += [rng.choice(_WORDS) for _ in range(max(1, target - count(" ".join(words))))]
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(" ".join(words[:mid])) < target else (lo, mid)
    return " ".join(words[:lo])


class UserPrompts:
    """A user prompt no other request of the run has: a unique head, then seeded words."""

    def __init__(self, count: TokenCounter, target: int):
        self.count, self.target, self.n = count, target, 0
        self.lock = threading.Lock()

    def next(self) -> str:
        with self.lock:
            self.n += 1
            n = self.n
        # The first word differs from every other request's, so no two share a token past the system
        # prompt.
        return text_of(
            self.count,
            f"{_WORDS[n % len(_WORDS)]}{n} asks: review this code and list the fixes.",
            self.target,
            seed=n,
        )


# --- servers -------------------------------------------------------------------------------


@dataclass
class Env:
    work: Path
    vllm_python: Path | None
    kvsnap_cache: Path

    def venv_env(self, home: Path) -> dict:
        """vllm-mlx's venv with this checkout on PYTHONPATH (as
        tests/integrations/vllm_mlx/test_route.py runs it), this run's kvsnap cache."""
        return {**_venv_env(home), "KVSNAP_CACHE_DIR": str(self.kvsnap_cache)}

    def own_env(self, home: Path) -> dict:
        return {
            **os.environ,
            "HOME": str(home),
            "KVSNAP_CACHE_DIR": str(self.kvsnap_cache),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }


@dataclass
class Prepared:
    name: str
    family: Family
    model: Path
    agents: Path
    system: str
    system_tokens: int
    store: Path
    vllm_store: Path | None
    prefill_tokens_per_s: float
    counter: TokenCounter = field(repr=False)


def launch(env: Env, prep: Prepared, mode: str, log: Path, limit_s: int) -> ServerProcess:
    home = log.parent / (log.stem + "-home")
    # a fresh HOME: vllm-mlx reloads ~/.cache/vllm-mlx/prefix_cache otherwise
    home.mkdir(parents=True, exist_ok=True)
    if mode.startswith("kvsnap-"):
        args = ["--continuous-batching"]
        if mode in ("kvsnap-warm", "kvsnap-snap"):
            args += ["--warm-prompts", str(prep.agents)]
        if mode == "kvsnap-snap":
            args += ["--kv-snapshots", str(prep.store), "--no-write-back"]
        return start_server(prep.model, args, log, env=env.own_env(home), limit_s=limit_s)
    if env.vllm_python is None:
        raise RuntimeError(f"mode {mode} needs vllm-mlx's venv; pass --vllm-python or --no-vllm")
    extra = {}
    if mode == "vllm-kvsnap":
        cmd = [
            str(env.vllm_python),
            "-m",
            "kvsnap",
            "vllm-mlx",
            "serve",
            str(prep.model),
            "--continuous-batching",
            "--kv-snapshots",
            str(prep.vllm_store),
            "--warm-prompts",
            str(prep.agents),
        ]
    else:
        cmd = [
            str(env.vllm_python),
            "-m",
            "vllm_mlx.cli",
            "serve",
            str(prep.model),
            "--continuous-batching",
        ]
        if mode == "vllm-warm":
            cmd += ["--warm-prompts", str(prep.agents)]
        blas = find_openblas()
        # kvsnap's own launchers load it in process; plain vllm-mlx gets the same BLAS this way
        if blas:
            extra["LD_PRELOAD"] = blas
    port = free_port()
    full = under_hard_limit([*cmd, "--host", "127.0.0.1", "--port", str(port)], limit_s)
    with open(log, "wb") as out:
        launched = time.perf_counter()
        proc = subprocess.Popen(
            full, stdout=out, stderr=subprocess.STDOUT, env={**env.venv_env(home), **extra}
        )
    return ServerProcess(
        proc=proc, url=f"http://127.0.0.1:{port}", log_path=log, launched_at=launched
    )


def computed_at_start(server: ServerProcess, mode: str) -> dict:
    """Prompt tokens the server computed before it said ready, from its status objects."""
    status = httpx.get(f"{server.url}/v1/status", timeout=30).json()
    if mode.startswith("kvsnap-"):
        report = status.get("warmup") or {}
        if report.get("completed", 0) > 1:
            raise RuntimeError(
                f"{mode}: the warm-up report covers {report['completed']} warm prompts; this bench "
                f"gives one"
            )
        tokens = report.get("prompt_tokens", 0) if report.get("prefilled") else 0
        return {"computed_at_start": tokens, "source": "/v1/status warmup", "warmup": report}
    if mode == "vllm-kvsnap":
        last = httpx.get(f"{server.url}/v1/kvsnap/status", timeout=30).json().get("last") or {}
        tokens = sum(a["tokens"] for a in last.get("agents", []) if a.get("source") == "prefilled")
        return {
            "computed_at_start": tokens,
            "source": "/v1/kvsnap/status last.agents",
            "warmup": last,
        }
    return {
        "computed_at_start": int(status.get("total_prompt_tokens") or 0),
        "source": "vllm-mlx /v1/status total_prompt_tokens",
        "warmup": None,
    }


class StatusPoller:
    """Polls /v1/status while requests run: each request's prompt and cached tokens, by its id."""

    def __init__(self, url: str, interval_s: float = 0.05):
        self.url, self.interval_s = url, interval_s
        self.seen: dict[str, dict] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop_event.is_set():
                try:
                    for r in client.get(f"{self.url}/v1/status").json().get("requests", []):
                        rid = str(r.get("request_id") or r.get("id"))
                        prev = self.seen.get(rid, {})
                        self.seen[rid] = {
                            "prompt_tokens": r.get("prompt_tokens"),
                            "cached_tokens": max(
                                int(r.get("cached_tokens") or 0),
                                int(prev.get("cached_tokens") or 0),
                            ),
                        }
                except httpx.HTTPError:
                    pass  # a busy server answers the next poll
                self.stop_event.wait(self.interval_s)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join(15)


def one_request(url: str, model_id: str, system: str, user: str, max_tokens: int) -> dict:
    with httpx.Client(timeout=httpx.Timeout(3600, connect=10)) as client:
        r = stream_chat(
            client,
            url,
            model_id,
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            max_tokens=max_tokens,
        )
    completion = int(r.usage.get("completion_tokens") or r.chunks)
    decode_s = r.total_s - r.ttft_s
    return {
        "ttft_s": r.ttft_s,
        "total_s": r.total_s,
        "prompt_tokens": r.usage.get("prompt_tokens"),
        "usage_cached_tokens": r.cached_tokens if r.usage else None,
        "completion_tokens": completion,
        "decode_tok_s": (completion - 1) / decode_s if completion > 1 and decode_s > 0 else None,
        "finish_reason": r.finish_reason,
        "text_head": r.text[:60],
    }


def run_cell(
    env: Env,
    prep: Prepared,
    mode: str,
    conc: int,
    rep: int,
    users: UserPrompts,
    max_tokens: int,
    out: Path,
    limit_s: int,
) -> dict:
    tag = f"{prep.name}-{mode}-c{conc}-r{rep}"
    server = launch(env, prep, mode, env.work / "logs" / f"{tag}.log", limit_s)
    cell = {
        "family": prep.name,
        "label": prep.family.label,
        "mode": mode,
        "concurrency": conc,
        "rep": rep,
        "system_tokens": prep.system_tokens,
        "max_tokens": max_tokens,
    }
    try:
        cell["ready_s"] = server.wait_ready(limit_s)
        cell.update(computed_at_start(server, mode))
        model_id = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        prompts = [users.next() for _ in range(conc)]
        cell["user_tokens"] = [users.count(p) for p in prompts]
        with StatusPoller(server.url) as poller, ThreadPoolExecutor(conc) as pool:
            cell["requests"] = list(
                pool.map(
                    lambda p: one_request(server.url, model_id, prep.system, p, max_tokens), prompts
                )
            )
        cell["status_requests"] = poller.seen
    except Exception as exc:  # one failed cell is recorded and the run goes on
        cell["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        cell["exit_code"] = server.stop()
        cell["log"] = str(server.log_path)
    shutil.rmtree(server.log_path.parent / (server.log_path.stem + "-home"), ignore_errors=True)
    (out / f"{tag}.json").write_text(json.dumps(cell, indent=1))
    return cell


def run_restart(env: Env, prep: Prepared, mode: str, rep: int, out: Path, limit_s: int) -> dict:
    """Launch → first token of the first agent request, sent the moment the server is ready."""
    tag = f"restart-{mode}-r{rep}"
    server = launch(env, prep, mode, env.work / "logs" / f"{tag}.log", limit_s)
    row = {
        "family": prep.name,
        "label": prep.family.label,
        "mode": mode,
        "rep": rep,
        "system_tokens": prep.system_tokens,
    }
    try:
        row["ready_s"] = server.wait_ready(limit_s)
        model_id = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        # before the request: vllm-mlx's counter would include it (a few ms)
        row.update(computed_at_start(server, mode))
        user = "Please review the server's request handler."
        row["user_tokens"] = prep.counter(user)
        sent = time.perf_counter()
        r = one_request(server.url, model_id, prep.system, user, 8)
        row["first_token_from_launch_s"] = sent + r["ttft_s"] - server.launched_at
        row["ttft_s"] = r["ttft_s"]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        row["exit_code"] = server.stop()
    shutil.rmtree(server.log_path.parent / (server.log_path.stem + "-home"), ignore_errors=True)
    (out / f"{tag}.json").write_text(json.dumps(row, indent=1))
    return row


# --- preparation: models, prompts, snapshot stores ----------------------------------------


# docs/design.md's measured figure (2,048 tokens in 54 s): not probed, loading 2.4 GB here costs
# more than it tells.
QWEN3_06B_FP32_TOKENS_PER_S = 38.0


def prefill_rate(model: Path, system: str, user_tokens: int) -> float:
    """Prompt tokens/s of one full request (system + a user prompt) in this process: the budget's
    yardstick."""
    from kvsnap.chat import request_tokens
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.runtime.prefill.chunked import prefill

    lm = load_model(model)
    user = text_of(TokenCounter(model), "probe0 asks: review this code.", user_tokens, seed=-1)
    tokens = request_tokens(
        lm.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": user}]
    )
    t0 = time.perf_counter()
    prefill(lm, tokens)
    return len(tokens) / (time.perf_counter() - t0)


def prepare(
    env: Env,
    name: str,
    family: Family,
    system_tokens: int,
    system_file: Path | None,
    need_vllm: bool,
    user_tokens: int,
) -> Prepared:
    folder = env.work / "families" / name
    folder.mkdir(parents=True, exist_ok=True)
    model = make_demo_model(env.work / "models" / name, family.spec)
    counter = TokenCounter(model)
    system = (
        system_file.read_text()
        if system_file
        else text_of(counter, SYSTEM_HEAD, system_tokens, seed=0)
    )
    agents = folder / "agents.json"
    # vllm-mlx's file shape; kvsnap reads it too
    agents.write_text(json.dumps([[{"role": "system", "content": system}]]))
    store = folder / "snaps-kvsnap"
    t0 = time.perf_counter()
    run(kvsnap_argv(*build_args(agents, model, store)), env.own_env(folder))
    build_s = time.perf_counter() - t0
    tokens = json.loads((store / "manifest.json").read_text())
    n_tokens = max(e["n_tokens"] for rec in tokens["records"].values() for e in rec["entries"])
    vllm_store = None
    if need_vllm:
        vllm_store = folder / "snaps-vllm-mlx"
        run(
            [
                str(env.vllm_python),
                "-m",
                "kvsnap",
                "build",
                str(agents),
                "--model",
                str(model),
                "--out",
                str(vllm_store),
                "--for",
                "vllm-mlx",
            ],
            env.venv_env(folder),
        )
    rate = (
        prefill_rate(model, system, user_tokens)
        if family.spec.size != "qwen3-0.6b"
        else QWEN3_06B_FP32_TOKENS_PER_S
    )
    print(
        f"[prepare] {name}: {model} system prompt {n_tokens} tokens; build {build_s:.1f}s; prefill "
        f"≈ {rate:.0f} tokens/s",
        flush=True,
    )
    return Prepared(name, family, model, agents, system, n_tokens, store, vllm_store, rate, counter)


def run(cmd: list[str], env: dict) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        )


def find_vllm_python(arg: str | None) -> Path | None:
    """--vllm-python, else the venv tests/integrations/vllm_mlx/test_route.py caches
    (KVSNAP_TEST_CACHE or ~/.cache/kvsnap-tests)."""
    if arg:
        path = Path(arg)
        if not path.is_file():
            raise SystemExit(
                f"--vllm-python {arg}: no such file; give the python of a venv holding vllm-mlx "
                f"0.6.0"
            )
        return path
    cached = _cache_root() / "vllm-mlx-venv" / "bin" / "python"
    return cached if cached.is_file() else None


def build_vllm_venv() -> Path:
    """Make the cached venv the way the tests do (same spec, same lock): minutes the first time."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            str(ROOT / "tests" / "integrations" / "vllm_mlx" / "test_route.py"),
            "-k",
            "pinned_snapshots_survive",
        ],
        cwd=ROOT,
        timeout=3600,
    )
    found = find_vllm_python(None)
    if r.returncode != 0 or found is None:
        raise SystemExit(
            "could not make vllm-mlx's venv through tests/integrations/vllm_mlx/test_route.py; "
            "see its output above, "
            "or pass --no-vllm"
        )
    return found


# --- budget ---------------------------------------------------------------------------------


@dataclass
class Plan:
    families: list[str]
    concurrency: list[int]
    modes: list[str]
    reps: int
    restart_reps: int
    trimmed: list[str] = field(default_factory=list)
    estimate_s: float = 0.0


def estimate_cell_s(
    rate: float, system: int, user: int, conc: int, mode: str, max_tokens: int, start_s: float
) -> float:
    """Seconds for one server run: start, prefill at ``rate`` tokens/s (cold: vllm-mlx counted as
    computing the system prompt per request), decode."""
    tokens = conc * user
    if mode.endswith("cold"):
        tokens += system * (conc if mode.startswith("vllm") else 1)
    if mode in ("kvsnap-warm", "vllm-warm"):
        tokens += system
    return start_s + tokens / rate + max_tokens * 0.05


def plan_budget(
    plan: Plan,
    rates: dict[str, float],
    system: dict[str, int],
    user: int,
    max_tokens: int,
    start_s: float,
    restart_s: float,
    budget_s: float | None,
) -> Plan:
    def total(families, reps):
        cells = sum(
            estimate_cell_s(rates[f], system[f], user, c, m, max_tokens, start_s)
            for f in families
            for c in plan.concurrency
            for m in plan.modes
        )
        return cells * reps + restart_s * plan.restart_reps

    plan.estimate_s = total(plan.families, plan.reps)
    if budget_s is None:
        return plan
    asked = plan.reps
    while plan.estimate_s > budget_s and plan.reps > 3:
        plan.reps -= 1
        plan.estimate_s = total(plan.families, plan.reps)
    if plan.reps < asked:
        plan.trimmed.append(f"repetitions {asked} → {plan.reps}")
    while plan.estimate_s > budget_s and len(plan.families) > 1:
        dropped = plan.families.pop()
        plan.trimmed.append(
            f"family {dropped} dropped (est. {total([dropped], plan.reps) / 60:.0f} min)"
        )
        plan.estimate_s = total(plan.families, plan.reps)
    while plan.estimate_s > budget_s and plan.reps > 1:
        plan.reps -= 1
        plan.estimate_s = total(plan.families, plan.reps)
        plan.trimmed.append(f"repetitions down to {plan.reps}")
    while plan.estimate_s > budget_s and plan.restart_reps > 1:
        plan.restart_reps -= 1
        plan.estimate_s = total(plan.families, plan.reps)
        plan.trimmed.append(f"restart repetitions down to {plan.restart_reps}")
    return plan


# --- summary --------------------------------------------------------------------------------


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def cell_cached(cell: dict) -> list[int]:
    """Per request cached tokens: usage where the server reports it, else what /v1/status showed."""
    usage = [
        r["usage_cached_tokens"]
        for r in cell.get("requests", [])
        if r.get("usage_cached_tokens") is not None
    ]
    if usage and cell["mode"].startswith("kvsnap-"):
        return usage
    return [int(s["cached_tokens"]) for s in cell.get("status_requests", {}).values()]


def summarize(cells: list[dict], restarts: list[dict]) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        if "error" not in c:
            groups.setdefault((c["family"], c["mode"], c["concurrency"]), []).append(c)
    per_mode = {}
    for (family, mode, conc), runs in groups.items():
        per_mode[f"{family}|{mode}|{conc}"] = {
            "family": family,
            "label": runs[0]["label"],
            "mode": mode,
            "concurrency": conc,
            "runs": len(runs),
            "ttft_s": _median([r["ttft_s"] for c in runs for r in c["requests"]]),
            "ready_s": _median([c["ready_s"] for c in runs]),
            "computed_at_start": _median([c["computed_at_start"] for c in runs]),
            "decode_tok_s": _median([r["decode_tok_s"] for c in runs for r in c["requests"]]),
            "cached_tokens": _median([t for c in runs for t in cell_cached(c)]),
            "prompt_tokens": _median([r["prompt_tokens"] for c in runs for r in c["requests"]]),
        }
    restart = {}
    for mode in RESTART_MODES:
        runs = [r for r in restarts if r["mode"] == mode and "error" not in r]
        if runs:
            restart[mode] = {
                "runs": len(runs),
                "label": runs[0]["label"],
                "first_token_from_launch_s": _median(
                    [r["first_token_from_launch_s"] for r in runs]
                ),
                "ready_s": _median([r["ready_s"] for r in runs]),
                "computed_at_start": _median([r["computed_at_start"] for r in runs]),
                "system_tokens": runs[0]["system_tokens"],
            }
    errors = [
        {k: c[k] for k in ("family", "mode", "concurrency", "rep", "error", "log") if k in c}
        for c in [*cells, *restarts]
        if "error" in c
    ]
    return {"cells": per_mode, "restart": restart, "errors": errors}


def _fmt(v, unit="", digits=2):
    if v is None:
        return "–"
    if unit == "ms":
        return f"{v * 1000:,.0f} ms"
    if unit == "x":
        return f"{v:.{digits}f}×"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:,.{digits}f}{unit}"
    return f"{int(v):,}{unit}"


def _ratio(a, b):
    return a / b if a is not None and b else None


def markdown(summary: dict, meta: dict) -> str:
    cells = summary["cells"]
    lines = [
        f"Medians over {meta['reps']} repetition(s), a fresh server per run; system prompt ≈ "
        f"{meta['system_tokens']} tokens, user prompts ≈ {meta['user_tokens']} tokens (a different "
        f"one per request), max_tokens {meta['max_tokens']}.",
        "",
        "| model | server | conc. | cold TTFT | warm TTFT | speedup | snapshot TTFT | snap / warm "
        "| launch → ready (cold / warm / snap) | computed at start (warm / snap) | decode tok/s vs "
        "cold (warm / snap) | cached tokens (cold / warm / snap) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for family in meta["families"]:
        for server, cold_m, warm_m, snap_m in SERVERS:
            for conc in meta["concurrency"]:
                row = {m: cells.get(f"{family}|{m}|{conc}") or {} for m in (cold_m, warm_m, snap_m)}

                def get(m, k, row=row):
                    return row[m].get(k)

                if all(get(m, "runs") is None for m in (cold_m, warm_m, snap_m)):
                    continue
                cold, warm, snap = (get(m, "ttft_s") for m in (cold_m, warm_m, snap_m))
                label = get(cold_m, "label") or get(warm_m, "label") or get(snap_m, "label")
                decode_cold = get(cold_m, "decode_tok_s")
                lines.append(
                    "| "
                    + " | ".join(
                        [
                            label,
                            server,
                            str(conc),
                            _fmt(cold, "ms"),
                            _fmt(warm, "ms"),
                            _fmt(_ratio(cold, warm), "x"),
                            _fmt(snap, "ms"),
                            _fmt(_ratio(snap, warm), "x"),
                            " / ".join(
                                _fmt(get(m, "ready_s"), " s", 1) for m in (cold_m, warm_m, snap_m)
                            ),
                            " / ".join(_fmt(get(m, "computed_at_start")) for m in (warm_m, snap_m)),
                            " / ".join(
                                _fmt(_ratio(get(m, "decode_tok_s"), decode_cold), "x")
                                for m in (warm_m, snap_m)
                            ),
                            " / ".join(
                                _fmt(
                                    None
                                    if get(m, "cached_tokens") is None
                                    else round(get(m, "cached_tokens"))
                                )
                                for m in (cold_m, warm_m, snap_m)
                            ),
                        ]
                    )
                    + " |"
                )
    if summary["restart"]:
        r = summary["restart"]
        lines += [
            "",
            f"Restart case ({next(iter(r.values()))['label']}, system prompt "
            f"{next(iter(r.values()))['system_tokens']} tokens, first agent request ≤ 32 user "
            f"tokens):",
            "",
            "| server, mode | launch → first token | launch → ready | computed at start | speedup "
            "vs the same server's --warm-prompts |",
            "|---|---:|---:|---:|---:|",
        ]
        for mode, row in r.items():
            base = r.get("kvsnap-warm" if mode.startswith("kvsnap") else "vllm-warm", {}).get(
                "first_token_from_launch_s"
            )
            lines.append(
                f"| {mode} | {_fmt(row['first_token_from_launch_s'], ' s')} | "
                f"{_fmt(row['ready_s'], ' s')} | {_fmt(row['computed_at_start'])} | "
                f"{_fmt(_ratio(base, row['first_token_from_launch_s']), 'x', 1)} |"
            )
    if meta.get("trimmed"):
        lines += ["", "Trimmed to fit --budget-minutes: " + "; ".join(meta["trimmed"]) + "."]
    if summary["errors"]:
        lines += [
            "",
            f"{len(summary['errors'])} run(s) failed: "
            + "; ".join(
                f"{e['family']} {e['mode']} c{e.get('concurrency', '-')} r{e['rep']}: "
                f"{e['error'][:160]}"
                for e in summary["errors"]
            ),
        ]
    return "\n".join(lines) + "\n"


# --- main -----------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", help="results folder (default: /tmp/kvsnap-bench-table/<UTC time>)")
    ap.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"comma-separated, in priority order (the budget drops from the end): "
        f"{', '.join(FAMILIES)}",
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--concurrency", help="comma-separated (default 1,4,8; --smoke: 1,4)")
    ap.add_argument(
        "--reps", type=int, help="repetitions per cell, interleaved (default 3; --smoke: 1)"
    )
    ap.add_argument(
        "--system-tokens",
        type=int,
        help="system prompt size when no --system-prompt-file (default 1700; --smoke: 300)",
    )
    ap.add_argument(
        "--system-prompt-file",
        type=Path,
        help="the system prompt (the warm prompt) to use instead of a generated one",
    )
    ap.add_argument(
        "--user-tokens", type=int, help="tokens per user prompt (default 2500; --smoke: 200)"
    )
    ap.add_argument("--max-tokens", type=int, help="default 128; --smoke: 8")
    ap.add_argument(
        "--budget-minutes",
        type=float,
        help="trim repetitions (to 3), then families, then repetitions (to 1) to fit; says what it "
        "trimmed",
    )
    ap.add_argument(
        "--start-overhead-s",
        type=float,
        default=8.0,
        help="budget estimate of one server start (default 8)",
    )
    ap.add_argument(
        "--restart-reps",
        type=int,
        default=None,
        help="restart-case repetitions (default: --reps; 0 skips it)",
    )
    ap.add_argument(
        "--restart-system-tokens",
        type=int,
        default=None,
        help="restart-case system prompt (default: --system-tokens)",
    )
    ap.add_argument(
        "--server-limit-s",
        type=int,
        default=1800,
        help="hard limit per server process (timeout -k)",
    )
    ap.add_argument(
        "--vllm-python",
        help="python of a venv with vllm-mlx 0.6.0 "
        "(default: the one tests/integrations/vllm_mlx/test_route.py caches)",
    )
    ap.add_argument(
        "--build-vllm-venv",
        action="store_true",
        help="make that venv through tests/integrations/vllm_mlx/test_route.py when it is missing",
    )
    ap.add_argument("--no-vllm", action="store_true", help="kvsnap modes only")
    ap.add_argument(
        "--merge",
        type=Path,
        help="an earlier run's --out folder: its cells for the families this run does not measure "
        "join the table (same settings)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models, ~300-token system and ~200-token user prompts, max_tokens 8, 1 rep, "
        "concurrency 1,4 (each overridable)",
    )
    args = ap.parse_args(argv)
    defaults = (
        dict(reps=1, system_tokens=300, user_tokens=200, max_tokens=8, concurrency="1,4")
        if args.smoke
        else dict(reps=3, system_tokens=1700, user_tokens=2500, max_tokens=128, concurrency="1,4,8")
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def merge_earlier_run(folder: Path, measured: list[str], cells: list[dict], settings: dict) -> dict:
    """Add the cells of families this run did not measure from an earlier run's folder (same
    script, same settings: the caller checks). Restart rows are never merged: this run has its
    own."""
    earlier = json.loads((folder / "summary.json").read_text())["meta"]
    for name, value in settings.items():
        if earlier[name] != value:
            raise SystemExit(
                f"--merge {folder}: its {name} is {earlier[name]}, this run's {value}; merge runs "
                f"of the same settings"
            )
    families = [f for f in earlier["families"] if f not in measured]
    for path in sorted((folder / "cells").glob("*.json")):
        cell = json.loads(path.read_text())
        if cell.get("family") in families:
            cells.append({**cell, "merged_from": str(folder)})
    return {
        "families": families,
        "system_tokens": {f: earlier["system_tokens"][f] for f in families},
        "shapes": {f: earlier["shapes"][f] for f in families},
        "merged_from": {"folder": str(folder), "command": earlier["command"], "families": families},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    modes = [m for m in args.modes.split(",") if m]
    for bad, known, what in ((families, FAMILIES, "--families"), (modes, MODES, "--modes")):
        unknown = [x for x in bad if x not in known]
        if unknown:
            raise SystemExit(
                f"{what}: unknown {', '.join(unknown)}; choose from {', '.join(known)}"
            )
    concurrency = [int(c) for c in args.concurrency.split(",")]
    out = Path(
        args.out or f"/tmp/kvsnap-bench-table/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    ).resolve()
    for sub in ("cells", "restart", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    vllm_python = None
    if args.no_vllm:
        modes = [m for m in modes if m in KVSNAP_MODES]
    else:
        vllm_python = find_vllm_python(args.vllm_python) or (
            build_vllm_venv() if args.build_vllm_venv else None
        )
        if vllm_python is None:
            raise SystemExit(
                "no vllm-mlx venv found (~/.cache/kvsnap-tests/vllm-mlx-venv); pass "
                "--build-vllm-venv, --vllm-python PATH or --no-vllm"
            )
    need_vllm = any(m in VLLM_MODES for m in modes)
    env = Env(work=out, vllm_python=vllm_python, kvsnap_cache=out / "kvsnap-cache")
    t_start = time.perf_counter()

    specs = {name: FAMILIES[name] for name in families}
    if args.smoke:  # the same architectures and quantization, tiny
        specs = {
            name: Family(
                f.label + " [smoke: tiny]",
                DemoSpec(
                    arch=f.spec.arch,
                    size="tiny",
                    quantize_bits=f.spec.quantize_bits,
                    seed=f.spec.seed,
                    text_outputs=True,
                ),
            )
            for name, f in specs.items()
        }
    prepared = {
        name: prepare(
            env, name, fam, args.system_tokens, args.system_prompt_file, need_vllm, args.user_tokens
        )
        for name, fam in specs.items()
    }
    restart_reps = args.reps if args.restart_reps is None else args.restart_reps
    restart_modes = [m for m in RESTART_MODES if m in modes]
    restart_prep = None
    restart_s = 0.0
    if restart_reps:
        restart_family = (
            Family(
                RESTART_FAMILY.label + " [smoke: tiny]", DemoSpec(arch="dense", text_outputs=True)
            )
            if args.smoke
            else RESTART_FAMILY
        )
        restart_prep = prepare(
            env,
            "restart-" + restart_family.spec.size,
            restart_family,
            args.restart_system_tokens or args.system_tokens,
            args.system_prompt_file,
            need_vllm and any(m.startswith("vllm") for m in restart_modes),
            32,
        )
        restart_s = sum(
            args.start_overhead_s
            + (
                restart_prep.system_tokens / restart_prep.prefill_tokens_per_s
                if m.endswith("warm")
                else 0
            )
            + 20
            for m in restart_modes
        )

    plan = plan_budget(
        Plan(
            families=list(prepared),
            concurrency=concurrency,
            modes=modes,
            reps=args.reps,
            restart_reps=restart_reps,
        ),
        {n: p.prefill_tokens_per_s for n, p in prepared.items()},
        {n: p.system_tokens for n, p in prepared.items()},
        args.user_tokens,
        args.max_tokens,
        args.start_overhead_s,
        restart_s,
        args.budget_minutes * 60 - (time.perf_counter() - t_start) if args.budget_minutes else None,
    )
    print(
        f"[plan] families {plan.families}, modes {plan.modes}, concurrency {plan.concurrency}, "
        f"reps {plan.reps}, restart reps {plan.restart_reps}; estimate {plan.estimate_s / 60:.0f} "
        f"min" + (f"; trimmed: {'; '.join(plan.trimmed)}" if plan.trimmed else ""),
        flush=True,
    )

    cells, restarts = [], []
    deadline = t_start + args.budget_minutes * 60 if args.budget_minutes else None
    for rep in range(plan.reps):
        for family in plan.families:
            prep = prepared[family]
            users = UserPrompts(prep.counter, args.user_tokens)
            # unique across the run
            users.n = 10_000 * (rep + 1) + 1_000 * plan.families.index(family)
            for conc in plan.concurrency:
                # rotate: modes interleave across reps
                order = plan.modes[rep % len(plan.modes) :] + plan.modes[: rep % len(plan.modes)]
                for mode in order:
                    if deadline and time.perf_counter() > deadline:
                        plan.trimmed.append(
                            f"stopped at the budget before rep {rep} {family} c{conc} {mode}"
                        )
                        break
                    cell = run_cell(
                        env,
                        prep,
                        mode,
                        conc,
                        rep,
                        users,
                        args.max_tokens,
                        out / "cells",
                        args.server_limit_s,
                    )
                    ttfts = [round(r["ttft_s"], 2) for r in cell.get("requests", [])]
                    print(
                        f"[cell] rep {rep} {family} c{conc} {mode}: ready "
                        f"{cell.get('ready_s', float('nan')):.1f}s computed at start "
                        f"{cell.get('computed_at_start')} TTFT {ttfts} cached {cell_cached(cell)} "
                        f"{cell.get('error', '')}",
                        flush=True,
                    )
                    cells.append(cell)
        if restart_prep is not None and rep < plan.restart_reps:
            for mode in (
                restart_modes[rep % len(restart_modes) :]
                + restart_modes[: rep % len(restart_modes)]
            ):
                row = run_restart(
                    env, restart_prep, mode, rep, out / "restart", args.server_limit_s
                )
                print(
                    f"[restart] rep {rep} {mode}: launch → first token "
                    f"{row.get('first_token_from_launch_s', float('nan')):.2f}s ready "
                    f"{row.get('ready_s', float('nan')):.2f}s {row.get('error', '')}",
                    flush=True,
                )
                restarts.append(row)

    # restart reps beyond --reps
    for rep in range(plan.reps, plan.restart_reps if restart_prep is not None else 0):
        for mode in (
            restart_modes[rep % len(restart_modes) :] + restart_modes[: rep % len(restart_modes)]
        ):
            row = run_restart(env, restart_prep, mode, rep, out / "restart", args.server_limit_s)
            print(
                f"[restart] rep {rep} {mode}: launch → first token "
                f"{row.get('first_token_from_launch_s', float('nan')):.2f}s ready "
                f"{row.get('ready_s', float('nan')):.2f}s {row.get('error', '')}",
                flush=True,
            )
            restarts.append(row)

    merged = (
        merge_earlier_run(
            args.merge,
            plan.families,
            cells,
            {
                "max_tokens": args.max_tokens,
                "user_tokens": args.user_tokens,
                "concurrency": plan.concurrency,
                "reps": plan.reps,
            },
        )
        if args.merge
        else {}
    )
    summary = summarize(cells, restarts)
    meta = {
        "families": plan.families,
        "concurrency": plan.concurrency,
        "modes": plan.modes,
        "reps": plan.reps,
        "system_tokens": {n: prepared[n].system_tokens for n in plan.families},
        "user_tokens": args.user_tokens,
        "max_tokens": args.max_tokens,
        "trimmed": plan.trimmed,
        "smoke": args.smoke,
        "shapes": {
            n: {
                "label": prepared[n].family.label,
                **asdict(prepared[n].family.spec),
                "config": json.loads((prepared[n].model / "config.json").read_text()),
            }
            for n in plan.families
        },
        "wall_s": round(time.perf_counter() - t_start, 1),
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
    }
    for key in ("families", "system_tokens", "shapes"):
        meta[key] = (
            merged[key] + meta[key]
            if isinstance(meta[key], list) and key in merged
            else ({**merged[key], **meta[key]} if key in merged else meta[key])
        )
    if merged:
        meta["merged_from"] = merged["merged_from"]
    (out / "summary.json").write_text(json.dumps({"meta": meta, **summary}, indent=1))
    table = markdown(
        summary,
        {**meta, "system_tokens": ", ".join(f"{v}" for v in meta["system_tokens"].values())},
    )
    (out / "summary.md").write_text(table)
    from plot_bench import plot_table

    for path in plot_table(out / "summary.json", str(out / "plot")):
        print(f"wrote {path}")
    print(table)
    print(f"results in {out} ({meta['wall_s'] / 60:.1f} min)")
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
