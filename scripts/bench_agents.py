#!/usr/bin/env python
"""Agents: launch -> first token of Claude Code's first request (``POST /v1/messages``,
streamed) for a ~10k-token prefix of Claude Code's shape, side by side in one run:

    cold       kvsnap serve M
    snapshots  kvsnap serve M --warm-prompts agents.json --kv-snapshots S --no-write-back
               (after kvsnap build agents.json --model M --out S)
    vllm       vllm-mlx serve M   (vllm-mlx 0.6 answers /v1/messages itself; its own venv)

    python scripts/bench_agents.py --out docs/bench/agents --plot
    python scripts/bench_agents.py --out docs/bench/agents --plot-only   # redraw from the JSON
    python scripts/bench_agents.py --out docs/bench/agents --plot --request short --reuse-store

``--request claude-code`` (the default) sends Claude Code's real first request: the warm prefix,
then its user turn (<system-reminder> blocks and the prompt) and its ``role: "system"``
environment message, which names folder and date and so follows the prefix uncached.
``--request short`` sends the same prefix (system + tools) with only the fixture's prompt as
the user turn (no reminders, no environment message: a <= 32-token suffix, the shape of the seed
table in docs/benchmarks.md): what a snapshot can save when nothing uncached follows. The warm
entry is the same for both, so ``--reuse-store`` serves the store an earlier run built. Short
results go under the JSON's ``short`` key; the claude-code results stay at its top level.

The request is tests/fixtures/agents/claude_code_first.json (system + 12 tools + the
attribution reminder + "Say hi" + the ``role: "system"`` environment message) trimmed
deterministically so that it renders to ~``--target-tokens`` tokens with the demo tokenizer:
one character fraction ``f`` is applied to the system prompt's main block, to the environment
message and to the tools list (the first tools kept whole, in order, while their JSON fits in
``f`` of the list's), ``f`` found by bisection. The warm-prompt entry is
``{"name": "claude-code", "anthropic": <that same body>}``: kvsnap warms its system + tools and
the request adds the messages after that cut. The model is the Qwen3-0.6B shape in fp32 made
locally (``make_demo_model``). One launch per mode (a cold 10k prefill takes 10+ minutes on 2
cores): no medians. CPU seconds of each server's process tree (``/proc``) and the machine's
load are recorded beside wall time, since other work shares the machine. Writes
``agents.json`` (raw results, rewritten after every mode) into ``--out``; ``--plot`` draws
``agents-first-token.png`` there.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from kvsnap.blas import find_openblas  # noqa: E402
from kvsnap.tools.serverproc import ServerProcess, free_port, under_hard_limit  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "agents" / "claude_code_first.json"
SERVED = "kvsnap-model"  # the model name the fixture's body carries
MODES = ("cold", "snapshots", "vllm")
LABELS = {
    "cold": "kvsnap serve, cold",
    "snapshots": "kvsnap serve --warm-prompts --kv-snapshots",
    "vllm": "vllm-mlx serve, cold",
}
TICKS = os.sysconf("SC_CLK_TCK")
REQUESTS = ("claude-code", "short")
SHORT_MAX_SUFFIX = 32  # tokens after the warm prefix, template tokens included


# --- the request ----------------------------------------------------------------------------


def _cut(text: str, frac: float) -> str:
    """The first ``frac`` of ``text``, ending at whitespace (deterministic)."""
    if frac >= 1:
        return text
    end = int(len(text) * frac)
    space = text.rfind(" ", 0, end)
    return text[: space if space > end // 2 else end]


def trimmed_body(body: dict, frac: float) -> dict:
    """``body`` with its system prompt's main block, its environment message and its tools list
    cut to ``frac`` of their characters (see the module's doc)."""
    out = copy.deepcopy(body)
    main = max(range(len(out["system"])), key=lambda i: len(out["system"][i]["text"]))
    out["system"][main]["text"] = _cut(out["system"][main]["text"], frac)
    for message in out["messages"]:
        if message["role"] == "system":
            for block in message["content"]:
                block["text"] = _cut(block["text"], frac)
    sizes = [len(json.dumps(t)) for t in out["tools"]]
    budget, kept, used = frac * sum(sizes), [], 0
    for tool, size in zip(out["tools"], sizes):
        if used + size > budget and kept:
            break
        kept.append(tool)
        used += size
    out["tools"] = kept
    return out


class Renderer:
    """Token counts of an Anthropic body as kvsnap renders it (its conversion, the model's
    template)."""

    def __init__(self, model: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model))

    def count(self, chat, generation: bool) -> int:
        text = self.tok.apply_chat_template(
            list(chat.messages),
            tools=list(chat.tools) if chat.tools else None,
            add_generation_prompt=generation,
            tokenize=False,
            **chat.template_kwargs,
        )
        return len(self.tok.encode(text, add_special_tokens=False))

    def request_tokens(self, body: dict) -> int:
        from kvsnap.agent_requests import anthropic_chat

        return self.count(anthropic_chat(body), True)

    def prefix_tokens(self, body: dict) -> int:
        from kvsnap.agent_requests import anthropic_prefix

        return self.count(anthropic_prefix(body, "entry")[0], False)


def fit_body(model: Path, target: int, max_tokens: int) -> tuple[dict, dict]:
    """The fixture trimmed to ~``target`` request tokens; and how it was trimmed."""
    body = json.loads(FIXTURE.read_text())
    body["max_tokens"] = max_tokens
    render = Renderer(model)
    full = render.request_tokens(body)
    lo, hi = 0.0, 1.0
    frac, got = 1.0, full
    for _ in range(30):  # bounded bisection on the character fraction
        if full <= target or abs(got - target) <= target * 0.01:
            break
        frac = (lo + hi) / 2
        got = render.request_tokens(trimmed_body(body, frac))
        lo, hi = (frac, hi) if got < target else (lo, frac)
    trimmed = trimmed_body(body, frac) if full > target else body
    info = {
        "fixture": str(FIXTURE.relative_to(ROOT)),
        "fixture_request_tokens": full,
        "fixture_prefix_tokens": render.prefix_tokens(body),
        "char_fraction": round(frac, 4),
        "tools_kept": [t["name"] for t in trimmed["tools"]],
        "system_chars": [len(b["text"]) for b in trimmed["system"]],
        "environment_chars": sum(
            len(b["text"])
            for m in trimmed["messages"]
            if m["role"] == "system"
            for b in m["content"]
        ),
        "request_tokens": render.request_tokens(trimmed),
        "prefix_tokens": render.prefix_tokens(trimmed),
        "max_tokens": max_tokens,
    }
    return trimmed, info


def short_body(body: dict) -> dict:
    """``body`` with its messages replaced by one user turn holding only the prompt (the first
    user message's last text block): no reminders, no environment message."""
    out = copy.deepcopy(body)
    user = next(m for m in body["messages"] if m["role"] == "user")
    content = user["content"]
    prompt = content if isinstance(content, str) else [b for b in content if b.get("text")][-1]
    text = prompt if isinstance(prompt, str) else prompt["text"]
    out["messages"] = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    return out


def short_request(model: Path, body: dict, fitted: dict) -> tuple[dict, dict]:
    """The short request built on the fitted body, and its token counts."""
    render = Renderer(model)
    short = short_body(body)
    total, prefix = render.request_tokens(short), render.prefix_tokens(short)
    if total - prefix > SHORT_MAX_SUFFIX:
        raise SystemExit(f"short request: {total - prefix} tokens after the prefix")
    info = {
        "shape": "the claude-code request's system + tools, then one user turn: the prompt alone",
        "user_text": short["messages"][0]["content"][0]["text"],
        "request_tokens": total,
        "prefix_tokens": prefix,
        "suffix_tokens": total - prefix,
        "max_tokens": short["max_tokens"],
        "fitted_from": {k: fitted[k] for k in ("char_fraction", "request_tokens")},
    }
    return short, info


# --- measuring --------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of one process, from /proc/PID/stat."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    # after the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15)
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
    return int(fields[1]), ticks / TICKS


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system, reaped children included) of ``root`` and its descendants."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            got = _proc_stat(int(entry))
            if got:
                stats[int(entry)] = got
    total, todo, seen = 0.0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo += [p for p, (ppid, _) in stats.items() if ppid == pid]
    return round(total, 2)


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat), all cores."""
    parts = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = parts[3] + parts[4]
    return (sum(parts[:8]) - idle) / TICKS


class LoadSampler:
    """The 1-minute load average every ``interval_s`` while a mode runs."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s, self.samples = interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(round(os.getloadavg()[0], 2))
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self.busy0, self.t0 = machine_cpu_s(), time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
        wall = time.monotonic() - self.t0
        self.summary = {
            "load_1min_samples": self.samples,
            "load_1min_mean": round(sum(self.samples) / max(1, len(self.samples)), 2),
            "machine_busy_cores_mean": round((machine_cpu_s() - self.busy0) / max(wall, 1e-9), 2),
            "cores": os.cpu_count(),
        }


def ask_messages(server: ServerProcess, body: dict, limit_s: float) -> dict:
    """One streamed ``POST /v1/messages``; the first token is the first content delta of any
    kind (text or thinking)."""
    got: dict = {"usage_start": None, "usage_end": None, "text": ""}
    first = None
    t0 = time.perf_counter()
    headers = {"x-api-key": "x", "anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json=body, headers=headers, timeout=limit_s
    ) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code} from {server.url}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if kind == "message_start":
                got["usage_start"] = event["message"].get("usage")
            elif kind == "content_block_delta":
                if first is None:
                    first = time.perf_counter()
                    got["cpu_s_at_first_token"] = tree_cpu_s(server.proc.pid)
                delta = event["delta"]
                got["text"] += delta.get("text") or delta.get("thinking") or ""
            elif kind == "message_delta":
                got["usage_end"] = event.get("usage")
            elif kind == "error":
                raise RuntimeError(f"stream error from {server.url}: {event}")
    if first is None:
        raise RuntimeError(f"no content delta from {server.url}: {got}")
    usage = {**(got["usage_start"] or {}), **(got["usage_end"] or {})}
    return {
        "request_to_first_token_s": round(first - t0, 3),
        "first_token_from_launch_s": round(first - server.launched_at, 3),
        "input_tokens": usage.get("input_tokens"),
        "cache_read_input_tokens": usage.get("cache_read_input_tokens"),
        "output_tokens": usage.get("output_tokens"),
        "usage_message_start": got["usage_start"],
        "usage_message_delta": got["usage_end"],
        "text": got["text"][:200],
        "cpu_s_at_first_token": got["cpu_s_at_first_token"],
    }


def launch(cmd: list[str], log: Path, env: dict, limit_s: int) -> ServerProcess:
    port = free_port()
    full = under_hard_limit([*cmd, "--host", "127.0.0.1", "--port", str(port)], limit_s)
    with open(log, "wb") as out:
        launched = time.perf_counter()  # before Popen: interpreter start and imports count
        proc = subprocess.Popen(
            full, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return ServerProcess(
        proc=proc, url=f"http://127.0.0.1:{port}", log_path=log, launched_at=launched
    )


def stop(server: ServerProcess) -> None:
    """SIGINT, then SIGKILL, to the server's own process group (it was started in a new
    session): nothing it started outlives the run."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        if server.proc.poll() is not None:
            break
        try:
            os.killpg(server.proc.pid, sig)
            server.proc.wait(wait)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def kvsnap_env(work: Path, home: Path) -> dict:
    return {
        **os.environ,
        "HOME": str(home),
        "KVSNAP_CACHE_DIR": str(work / "kvsnap-cache"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def vllm_env(home: Path) -> dict:
    from helpers.vllm_mlx_route import _venv_env

    env = _venv_env(home)  # a fresh HOME: vllm-mlx reloads ~/.cache/vllm-mlx/prefix_cache
    blas = find_openblas()
    if blas:  # kvsnap loads it in process; plain vllm-mlx gets the same BLAS this way
        env["LD_PRELOAD"] = blas
    return env


def server_cmd(mode: str, ctx: dict) -> tuple[list[str], dict]:
    home = ctx["work"] / f"home-{mode}{ctx.get('tag', '')}"
    shutil.rmtree(home, ignore_errors=True)  # fresh: vllm-mlx reloads its prefix cache from HOME
    home.mkdir(parents=True)
    if mode == "vllm":
        cmd = [str(ctx["vllm_python"]), "-m", "vllm_mlx.cli", "serve", str(ctx["model"])]
        # its default --timeout (300 s without an output chunk) ends a 10k cold prefill's stream
        cmd += ["--served-model-name", SERVED, "--timeout", str(ctx["limit_s"])]
        return cmd, vllm_env(home)
    cmd = [sys.executable, "-m", "kvsnap", "serve", str(ctx["model"])]
    cmd += ["--served-model-name", SERVED]
    if mode == "snapshots":
        cmd += ["--warm-prompts", str(ctx["agents"]), "--kv-snapshots", str(ctx["store"])]
        cmd += ["--no-write-back"]
    return cmd, kvsnap_env(ctx["work"], home)


VLLM_PREFILL = re.compile(r"will prefill (\d+) system \+ (\d+) suffix tokens")


def log_prompt_tokens(run: dict) -> dict:
    """vllm-mlx 0.6's Anthropic stream reports ``input_tokens: 0``; its log says what it
    prefilled ("will prefill N system + M suffix tokens"): that sum, from the run's log."""
    if run.get("mode") != "vllm" or not Path(run.get("log", "")).exists():
        return run
    found = VLLM_PREFILL.findall(Path(run["log"]).read_text(errors="replace"))
    if found:
        system, suffix = map(int, found[0])
        run["prompt_tokens_from_log"] = system + suffix
        run["prefilled_from_log"] = f"{system} system + {suffix} suffix"
    return run


def one(mode: str, ctx: dict) -> dict:
    cmd, env = server_cmd(mode, ctx)
    log = ctx["work"] / f"{mode}{ctx.get('tag', '')}.log"
    limit = ctx["limit_s"]
    with LoadSampler() as load:
        server = launch(cmd, log, env, limit)
        try:
            ready = server.wait_ready(limit)
            cpu_ready = tree_cpu_s(server.proc.pid)
            answer = ask_messages(server, ctx["body"], limit)
            cpu_done = tree_cpu_s(server.proc.pid)
        finally:
            stop(server)
    return log_prompt_tokens(
        {
            "mode": mode,
            "label": LABELS[mode],
            "request": ctx.get("request_kind", "claude-code"),
            "command": " ".join(cmd),
            "ready_s": round(ready, 2),
            **answer,
            "cpu_s_at_ready": cpu_ready,
            "cpu_s_at_end": cpu_done,
            "machine": load.summary,
            "log": str(log),
        }
    )


def build(ctx: dict) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "kvsnap",
        "build",
        str(ctx["agents"]),
        "--model",
        str(ctx["model"]),
    ]
    cmd += ["--out", str(ctx["store"]), "--json"]
    env = kvsnap_env(ctx["work"], ctx["work"] / "home-build")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with LoadSampler() as load:
        t0 = time.perf_counter()
        r = subprocess.run(
            under_hard_limit(cmd, ctx["limit_s"]), capture_output=True, text=True, env=env
        )
        wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"build failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "command": " ".join(cmd),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "report": json.loads(r.stdout),
        "store_bytes": sum(f.stat().st_size for f in ctx["store"].rglob("*") if f.is_file()),
        "machine": load.summary,
    }


# --- vllm-mlx -------------------------------------------------------------------------------


def vllm_python(arg: str | None) -> Path:
    """--vllm-python, else the venv tests/helpers/vllm_mlx_route.py caches (made by
    tests/integrations/conftest.py; waits while a colleague's build of it is under way)."""
    if arg:
        return Path(arg)
    from helpers.vllm_mlx_route import SPEC, _cache_root

    venv = _cache_root() / "vllm-mlx-venv"
    marker = venv / ".kvsnap-spec"
    for _ in range(90):  # up to 30 minutes
        if marker.exists() and marker.read_text() == SPEC:
            return venv / "bin" / "python"
        print(f"waiting for {venv} (no matching {marker.name} yet)", flush=True)
        time.sleep(20)
    raise SystemExit(
        f"no vllm-mlx venv at {venv}: run tests/integrations/vllm_mlx/test_route.py once "
        "(it builds it) or pass --vllm-python"
    )


def check_vllm(ctx: dict) -> dict:
    """vllm-mlx answers a streamed /v1/messages on a tiny demo model (before the long run)."""
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    tiny = make_demo_model(ctx["work"] / "model-tiny", DemoSpec(size="tiny", text_outputs=True))
    cmd, env = server_cmd("vllm", {**ctx, "model": tiny})
    server = launch(cmd, ctx["work"] / "vllm-check.log", env, 300)
    try:
        server.wait_ready(240)
        return ask_messages(server, {**ctx["body"], "max_tokens": 4}, 240)
    finally:
        stop(server)


# --- plot -----------------------------------------------------------------------------------


def _ratios(runs: list[dict]) -> dict:
    """vllm-mlx cold (and kvsnap cold) over snapshots, launch -> first token, wall and CPU."""
    by = {r["mode"]: r for r in runs if r}
    out = {}
    for other in ("vllm", "cold"):
        if other in by and "snapshots" in by:
            a, b = by[other], by["snapshots"]
            name = "vllm_cold" if other == "vllm" else "kvsnap_cold"
            out[f"ratio_{name}_over_snapshots"] = round(
                a["first_token_from_launch_s"] / b["first_token_from_launch_s"], 1
            )
            out[f"ratio_{name}_over_snapshots_cpu"] = round(
                a["cpu_s_at_first_token"] / b["cpu_s_at_first_token"], 1
            )
    return out


def _plot_row(a, b, runs: list[dict], title: str) -> None:
    names = [r["label"].replace(" --", "\n--") for r in runs]
    colors = {"cold": "C0", "snapshots": "C2", "vllm": "C1"}
    first = [r["first_token_from_launch_s"] for r in runs]
    bars = a.bar(names, first, color=[colors[r["mode"]] for r in runs])
    loads = [r["machine"]["load_1min_mean"] for r in runs]
    a.bar_label(bars, [f"{v:,.1f} s (load {x:.1f})" for v, x in zip(first, loads)], fontsize=8)
    a.set_ylabel("launch → first token (s)")
    a.tick_params(axis="x", labelsize=7)
    a.set_title(title, fontsize=9)
    cpu = [r["cpu_s_at_first_token"] for r in runs]
    bars = b.bar(names, cpu, color=[colors[r["mode"]] for r in runs])
    b.bar_label(bars, [f"{v:,.0f}" for v in cpu], fontsize=8)
    b.set_ylabel("server CPU s, launch → first token")
    b.tick_params(axis="x", labelsize=7)
    ratios = _ratios(runs)
    if "ratio_vllm_cold_over_snapshots" in ratios:
        b.set_title(
            f"vllm-mlx cold / kvsnap snapshots: {ratios['ratio_vllm_cold_over_snapshots']:.1f}×"
            f" wall, {ratios['ratio_vllm_cold_over_snapshots_cpu']:.1f}× CPU (goal ≥ 10×)",
            fontsize=9,
        )


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def split(runs: list[dict], req: dict) -> tuple[int, int]:
        """(warm prefix, tokens after it): the snapshots run's usage where there is one (the
        entry's cut), else the script's rendering."""
        snap = next((r for r in runs if r["mode"] == "snapshots"), None)
        if snap and snap.get("cache_read_input_tokens"):
            return snap["cache_read_input_tokens"], snap["input_tokens"]
        return req["prefix_tokens"], req["request_tokens"] - req["prefix_tokens"]

    rows = []
    shapes = [
        (result, "Claude Code's first request"),
        (result.get("short") or {}, "same prefix + a short user turn"),
    ]
    for section, name in shapes:
        runs = [r for r in section.get("runs", []) if r]
        if runs:
            warm, after = split(runs, section["request"])
            title = f"{name}: {warm + after:,} tokens (warm prefix {warm:,} + {after:,} after it)"
            rows.append((runs, title))
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 4.2 * len(rows)), squeeze=False)
    for (a, b), (runs, title) in zip(axes, rows):
        _plot_row(a, b, runs, title)
    fig.suptitle(
        "Agents, launch → first token of the first /v1/messages; Qwen3-0.6B shape, fp32, "
        "mlx-cpu + OpenBLAS, 2 cores; one launch per mode",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "agents")
    p.add_argument("--work", type=Path, default=Path("/tmp/kvsnap-bench-agents"))
    p.add_argument("--size", default="qwen3-0.6b", help="demo model size (tiny for a smoke run)")
    p.add_argument("--target-tokens", type=int, default=10_000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--only",
        default="snapshots,vllm,cold",
        help=f"modes to run, in this order, comma-separated ({', '.join(MODES)}); a mode left "
        "out keeps its result from OUT/agents.json",
    )
    p.add_argument(
        "--request",
        choices=REQUESTS,
        default="claude-code",
        help="claude-code: Claude Code's real first request (results at the JSON's top level); "
        "short: the same prefix + the prompt alone (results under its 'short' key)",
    )
    p.add_argument(
        "--reuse-store",
        action="store_true",
        help="snapshots: serve WORK/store as an earlier run built it (its build stays in the "
        "JSON) instead of building it again; WORK/agents.json must be unchanged",
    )
    p.add_argument("--limit-s", type=int, default=2700, help="hard limit per server and build")
    p.add_argument("--vllm-python", help="python of a venv with vllm-mlx 0.6.0")
    p.add_argument("--skip-vllm-check", action="store_true")
    p.add_argument("--plot", action="store_true", help="draw OUT/agents-first-token.png")
    p.add_argument("--plot-only", action="store_true", help="only redraw from OUT/agents.json")
    args = p.parse_args()
    out, work = args.out.resolve(), args.work.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    raw = out / "agents.json"
    if args.plot_only:  # also fills in what the logs say, where a run lacks it
        done = json.loads(raw.read_text())
        done["runs"] = [log_prompt_tokens(r) for r in done["runs"]]
        if done.get("short"):
            done["short"]["runs"] = [log_prompt_tokens(r) for r in done["short"]["runs"]]
        raw.write_text(json.dumps(done, indent=1) + "\n")
        plot(done, out / "agents-first-token.png")
        return 0
    modes = [m for m in args.only.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {', '.join(MODES)}")
    kept = json.loads(raw.read_text()) if raw.exists() else {}
    short = args.request == "short"
    kept_section = kept.get("short", {}) if short else kept
    kept_runs = {r["mode"]: r for r in kept_section.get("runs", []) if r}

    from kvsnap.blas import preload_openblas

    preload_openblas()  # before mlx: make_demo_model runs it
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    spec = DemoSpec(arch="dense", size=args.size, text_outputs=True)
    model = make_demo_model(work / f"model-{args.size}", spec)
    body, request = fit_body(model, args.target_tokens, args.max_tokens)
    print("request:", json.dumps(request), flush=True)
    agents = work / "agents.json"
    entries = json.dumps([{"name": "claude-code", "anthropic": body}], indent=1)
    store = work / "store"
    reuse = args.reuse_store and "snapshots" in modes
    if reuse and not (store.is_dir() and agents.exists() and agents.read_text() == entries):
        raise SystemExit(f"--reuse-store: no {store} built from this {agents}")
    agents.write_text(entries)
    sent, short_info = body, None
    if short:
        sent, short_info = short_request(model, body, request)
        print("short request:", json.dumps(short_info), flush=True)
    ctx = {
        "work": work,
        "model": model,
        "body": sent,
        "request_kind": args.request,
        "tag": "-short" if short else "",
        "agents": agents,
        "store": store,
        "limit_s": args.limit_s,
        "vllm_python": vllm_python(args.vllm_python) if "vllm" in modes else None,
    }
    header = {
        "command": " ".join(sys.argv),
        "model": f"demo {args.size} (Qwen3-0.6B shape), fp32, text_outputs",
        "openblas": find_openblas(),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS", "(default: one per core)"),
        "cores": os.cpu_count(),
    }
    if short:  # the claude-code results at the top level stay as they were
        result = {
            "command": header["command"],
            "request": short_info,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_before": os.getloadavg(),
            "vllm_check": kept_section.get("vllm_check"),
            "store": "the claude-code entry's store (the build above)" if reuse else None,
            "runs": [],
        }
    else:
        result = {
            **header,
            "request": request,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_before": os.getloadavg(),
            "vllm_check": kept.get("vllm_check"),
            "build": kept.get("build"),
            "runs": [],
        }

    def save() -> None:
        runs = {**kept_runs, **{r["mode"]: r for r in result["runs"]}}
        done = {**result, "runs": [runs[m] for m in MODES if m in runs]}
        done.update(_ratios(done["runs"]))
        done["load_after"] = os.getloadavg()
        if short:
            whole = {**kept, "short": done}
        else:
            whole = {**done, **({"short": kept["short"]} if kept.get("short") else {})}
        raw.write_text(json.dumps(whole, indent=1) + "\n")
        if args.plot and whole.get("runs"):
            plot(whole, out / "agents-first-token.png")

    if "vllm" in modes and not args.skip_vllm_check:
        result["vllm_check"] = check_vllm(ctx)
        print("vllm-mlx /v1/messages on a tiny model:", result["vllm_check"], flush=True)
        save()
    for mode in modes:
        if mode == "snapshots" and not reuse:  # a fresh store, built from this run's entry
            shutil.rmtree(ctx["store"], ignore_errors=True)
            result["build"] = build(ctx)
            print("build:", {k: v for k, v in result["build"].items() if k != "report"}, flush=True)
            save()
        try:
            run = one(mode, ctx)
        except (RuntimeError, TimeoutError, httpx.HTTPError) as e:  # recorded; the next mode runs
            print(f"{mode} failed: {e}", flush=True)
            result.setdefault("failed", {})[mode] = str(e)[:2000]
            save()
            continue
        print(mode, json.dumps({k: v for k, v in run.items() if k != "text"}), flush=True)
        result["runs"].append(run)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
