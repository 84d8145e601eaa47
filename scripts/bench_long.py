#!/usr/bin/env python
"""Long prompts at the physical limit (docs/benchmarks.md, "Long prompts"): each cost as a ratio
to its limit, measured side by side in one run.

    python scripts/bench_long.py --out /tmp/long                 # everything (hours on 2 cores)
    python scripts/bench_long.py --quick --out /tmp/long-quick   # tiny sizes, a few minutes
    python scripts/bench_long.py --only tokens,restore --out /tmp/long
    PYTHONPATH=/path/to/old/checkout python scripts/bench_long.py --label before --out /tmp/long
    python scripts/bench_long.py --plot /tmp/long/long-before.json,/tmp/long/long-after.json \\
        --out docs/bench/long                                      # before/after plots

Parts (``--only``, comma-separated):

- ``tokens``: ``kvsnap build`` of one agent, 512 → 32k tokens, against the same tokens' prefill
  with a cache allocated once (compute alone), on "L4": the first 4 layers of the Qwen3-0.6B
  shape (the whole 28-layer model takes hours at 32k on 2 cores);
- ``agents``: ``kvsnap build`` of 10 → 1,000 agents on the tiny model, so the manifest and
  store work shows, against linear in the agent count;
- ``restore``: the server's restore of the ``tokens`` part's stores from a cold page cache
  (posix_fadvise DONTNEED) against an O_DIRECT sequential read of the same files, and from a
  warm one against a plain read into fresh memory;
- ``first-request``: a real ``kvsnap serve`` on 127.0.0.1 restored from a store, its first and
  second request (same shape, other user text) against the model's compute alone, and
  ``kvsnap mlx-lm serve``'s first request on the same model;
- ``start``: launch → ready with 1,000 agents against a cold launch (medians of 5, interleaved);
- ``prefill``: scripts/profile_prefill.py on the full Qwen3-0.6B shape: prefill against the
  matmul rate at its shapes, per step size, and where the rest goes.

The kvsnap measured is the one Python imports: this checkout, or PYTHONPATH's (the JSON records
its path and commit). Models are made locally (fp32, random weights), never downloaded; OpenBLAS
is preloaded in this process and every server. Writes OUT/long-LABEL.json and
OUT/long-LABEL-PART.png; each plot's caption carries the machine's load (os.getloadavg).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # appended: a checkout on PYTHONPATH is the one measured

from kvsnap.blas import preload_openblas  # noqa: E402

BLAS = preload_openblas()

# bench_mlx_lm puts this checkout first on sys.path: harmless, kvsnap is imported already
import bench_mlx_lm  # noqa: E402
import httpx  # noqa: E402
import profile_prefill  # noqa: E402

import kvsnap  # noqa: E402
from kvsnap.tools.bench_startup import (  # noqa: E402
    SweepPoint,
    medians,
    run_point,
    system_prompt_of,
)
from kvsnap.tools.demo import DemoSpec, make_demo_model  # noqa: E402
from kvsnap.tools.serverproc import ServerProcess, start_server, under_hard_limit  # noqa: E402

PARTS = ("tokens", "agents", "restore", "first-request", "start", "prefill")
# kv-stub, kv-stub-28: the KV bytes per token of L4 and of the whole Qwen3-0.6B shape (4 or 28
# layers x 8 KV heads x 128) with projections 64 wide and attention replaced by its queries:
# the build's own work with the model's compute stubbed out
STUB_LAYERS = {"kv-stub": 4, "kv-stub-28": 28}
MODELS = ("tiny", "l4", "qwen3-0.6b", *STUB_LAYERS)
STUB_MAIN = """import sys
from kvsnap.blas import preload_openblas
preload_openblas()
import mlx_lm.models.qwen3 as qwen3
qwen3.scaled_dot_product_attention = lambda q, k, v, **kw: q + k[:, :1, :1] * 0
from kvsnap.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""
KVSNAP = (sys.executable, "-m", "kvsnap")
# two user turns, padded to one token count so the second request has the first's shape
USERS = (
    "Please review the request handler and list the three riskiest lines in it.",
    "Please check the retry loop and name the two slowest calls made inside it.",
)


@dataclass(frozen=True)
class Sizes:
    tokens_model: str = "l4"
    tokens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384, 32768)
    stub_tokens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384, 32768)
    stub28_tokens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    agents: tuple[int, ...] = (10, 30, 100, 300, 1000)
    agent_tokens: int = 100
    agents_reps: int = 2
    restore_min_tokens: int = 2048
    restore_reps: int = 3
    request_model: str = "l4"
    request_tokens: int = 2017
    request_reps: int = 3
    start_agents: int = 1000
    start_tokens: int = 100
    start_reps: int = 5
    prefill_model: str = "qwen3-0.6b"
    prefill_tokens: int = 1024
    prefill_steps: tuple[int, ...] = (256, 512, 1024, 2048)
    prefill_reps: int = 2


QUICK = Sizes(
    tokens_model="tiny",
    tokens=(256, 512, 1024),
    stub_tokens=(256, 512, 1024, 2048),
    stub28_tokens=(256, 1024),
    agents=(10, 30),
    agent_tokens=50,
    agents_reps=1,
    restore_min_tokens=512,
    restore_reps=1,
    request_model="tiny",
    request_tokens=300,
    request_reps=1,
    start_agents=50,
    start_tokens=50,
    start_reps=2,
    prefill_model="tiny",
    prefill_tokens=256,
    prefill_steps=(128, 256),
    prefill_reps=1,
)


def load_now() -> float:
    return round(os.getloadavg()[0], 2)


@dataclass
class Run:
    """What every part shares: where models, stores and logs go, the servers' environment."""

    workdir: Path
    label: str
    sizes: Sizes
    env: dict
    loads: dict[str, list[float]] = field(default_factory=dict)

    @property
    def lab(self) -> Path:
        path = self.workdir / self.label
        path.mkdir(parents=True, exist_ok=True)
        return path

    def note_load(self, part: str) -> float:
        now = load_now()
        self.loads.setdefault(part, []).append(now)
        return now


# --- models, agents, builds ------------------------------------------------------------------


def cut_layers(full: Path, out: Path, keep: int) -> Path:
    """``full`` with only its first ``keep`` layers (same widths, vocabulary and tokenizer)."""
    import mlx.core as mx

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in full.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy2(f, tmp / f.name)
    config = json.loads((full / "config.json").read_text())
    config["num_hidden_layers"] = keep
    config["kvsnap_demo"] = {**config.get("kvsnap_demo", {}), "layers": keep}
    weights = cast(dict[str, Any], mx.load(str(full / "model.safetensors")))
    kept = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep
    }
    mx.save_safetensors(str(tmp / "model.safetensors"), kept, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, out)
    return out


def model_dir(name: str, workdir: Path) -> Path:
    """A local demo model: ``tiny``, ``qwen3-0.6b`` (the shape, 28 layers) or ``l4`` (its first
    4 layers)."""
    models = workdir / "models"
    if name == "tiny":
        return make_demo_model(models / "demo-tiny", DemoSpec(size="tiny"))
    full = make_demo_model(models / "demo-qwen3-0.6b", DemoSpec(size="qwen3-0.6b"))
    if name == "qwen3-0.6b":
        return full
    if name == "l4":
        return cut_layers(full, models / "demo-qwen3-0.6b-l4", 4)
    if name in STUB_LAYERS:
        tiny = make_demo_model(models / "demo-tiny", DemoSpec(size="tiny"))
        return kv_stub(tiny, models / name, STUB_LAYERS[name])
    raise SystemExit(f"model {name!r} is not one of {', '.join(MODELS)}")


def kv_stub(tiny: Path, out: Path, layers: int) -> Path:
    """The tiny model's tokenizer, ``layers`` layers of the 0.6B shape's KV (8 heads x 128) and
    projections 64 wide (mlx's own init)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny, tmp)
    config = json.loads((tiny / "config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
    )
    config["kvsnap_demo"] = {**config.get("kvsnap_demo", {}), "kv_stub": True}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    weights = dict(tree_flatten(model_cls(args_cls.from_dict(config)).parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, out)
    return out


def write_agents(model: Path, path: Path, count: int, tokens: int) -> Path:
    """``count`` agents of about ``tokens`` system-prompt tokens each, none sharing a block."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    one = system_prompt_of(tok, tokens, salt="Agent 0.")
    agents = [
        {
            "name": f"agent-{i}",
            "messages": [{"role": "system", "content": one.replace("Agent 0.", f"Agent {i}.", 1)}],
        }
        for i in range(count)
    ]
    path.write_text(json.dumps(agents))
    return path


def children_cpu() -> float:
    """CPU seconds of this process's finished children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def kvsnap_build(
    model: Path, agents: Path, store: Path, env: dict, *extra: str, stub: bool = False
) -> dict:
    """`kvsnap build` into a fresh store, in its own process (``stub``: attention stubbed out);
    the build's own seconds (model load left out) and the wall time."""
    shutil.rmtree(store, ignore_errors=True)
    cli = [sys.executable, "-c", STUB_MAIN] if stub else list(KVSNAP)
    cmd = [*cli, "build", str(agents), "--model", str(model), "--out", str(store), "--json"]
    load = load_now()
    cpu0 = children_cpu()
    t0 = time.perf_counter()
    r = subprocess.run(
        under_hard_limit([*cmd, *extra], 14400), capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - t0
    cpu = children_cpu() - cpu0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    report = json.loads(r.stdout)
    return {
        "seconds": report["seconds"],
        "wall_s": round(wall, 3),
        # the whole process's CPU time (imports and model load too): on a busy machine it
        # still counts the work done
        "cpu_s": round(cpu, 3),
        "agents": len(report["entries"]),
        "n_tokens": sum(e["n_tokens"] for e in report["entries"]),
        "bytes_written": report["bytes_written"],
        "load": [load, load_now()],
    }


# --- tokens: build time vs prompt length -----------------------------------------------------


def part_tokens(run: Run) -> dict:
    """Per model (the stub first: it is fast), each length's build against its compute alone."""
    out = {}
    for name, lengths in (
        ("kv-stub", run.sizes.stub_tokens),
        ("kv-stub-28", run.sizes.stub28_tokens),
        (run.sizes.tokens_model, run.sizes.tokens),
    ):
        if lengths:
            out[name] = tokens_rows(run, name, lengths)
    return {"models": out}


def tokens_rows(run: Run, name: str, lengths: tuple[int, ...]) -> dict:
    from kvsnap.key import DEFAULT_PREFILL_STEP

    model = model_dir(name, run.workdir)
    stub = name in STUB_LAYERS
    lm = load_mlx(model)
    with profile_prefill.ablated(lm, "attention" if stub else "none"):
        # mlx's first call sets up its kernels: not part of any length's compute
        profile_prefill.prefill_time(lm, token_ids(lm, 64), 64, True)
    rows = []
    for n in lengths:
        agents = write_agents(model, run.lab / f"tokens-{name}-{n}.json", 1, n)
        built = kvsnap_build(model, agents, run.lab / f"tokens-{name}-{n}", run.env, stub=stub)
        ids = token_ids(lm, built["n_tokens"])
        run.note_load("tokens")
        with profile_prefill.ablated(lm, "attention" if stub else "none"):
            cpu0 = time.process_time()
            compute = profile_prefill.prefill_time(lm, ids, DEFAULT_PREFILL_STEP, True)
            compute_cpu = time.process_time() - cpu0
        row = {
            "tokens": built["n_tokens"],
            "build_s": built["seconds"],
            "build_wall_s": built["wall_s"],
            "compute_s": round(compute, 3),
            "build_over_compute": round(built["seconds"] / compute, 3),
            "build_cpu_s": built["cpu_s"],
            "compute_cpu_s": round(compute_cpu, 3),
            "store_bytes": built["bytes_written"],
            "load": [*built["load"], load_now()],
        }
        rows.append(row)
        print(f"[tokens] {name} {json.dumps(row)}", flush=True)
    return {"stubbed": stub, "step": DEFAULT_PREFILL_STEP, "rows": rows}


def load_mlx(model: Path) -> Any:
    from mlx_lm import load

    return load(str(model))[0]


def token_ids(lm: Any, n: int) -> list[int]:
    vocab = min(lm.args.vocab_size - 10, 2000)
    return [(i * 7919) % vocab + 10 for i in range(n)]


def scaling(rows: list[dict], x: str, big: int, small: int, keys: tuple[str, ...]) -> dict:
    """key(big) / key(small) for each key, from the rows nearest those x values."""

    def near(v: int) -> dict:
        return min(rows, key=lambda r: abs(r[x] - v))

    b, s = near(big), near(small)
    return {
        "between": [s[x], b[x]],
        "x_ratio": round(b[x] / s[x], 3),
        **{k: round(b[k] / s[k], 3) for k in keys},
    }


# --- agents: build time vs agent count ------------------------------------------------------


def part_agents(run: Run) -> dict:
    model = model_dir("tiny", run.workdir)
    runs: dict[int, list[dict]] = {n: [] for n in run.sizes.agents}
    files = {
        n: write_agents(model, run.lab / f"agents-{n}.json", n, run.sizes.agent_tokens)
        for n in run.sizes.agents
    }
    for rep in range(run.sizes.agents_reps):  # interleaved over the counts
        for n in run.sizes.agents:
            run.note_load("agents")
            built = kvsnap_build(model, files[n], run.lab / f"agents-{n}", run.env)
            runs[n].append(built)
            print(f"[agents] rep {rep} x{n}: {built['seconds']:.2f}s {built['load']}", flush=True)
    rows = [
        {
            "agents": n,
            "build_s": statistics.median(b["seconds"] for b in got),
            "build_wall_s": statistics.median(b["wall_s"] for b in got),
            "build_cpu_s": statistics.median(b["cpu_s"] for b in got),
            "runs": got,
        }
        for n, got in runs.items()
    ]
    base = rows[0]
    for r in rows:
        r["per_agent_ms"] = round(r["build_s"] / r["agents"] * 1000, 3)
        # 1.0: exactly linear from the smallest count; above 1, superlinear
        r["over_linear"] = round(r["build_s"] / (base["build_s"] * r["agents"] / base["agents"]), 3)
    return {"model": "tiny", "agent_tokens": run.sizes.agent_tokens, "rows": rows}


# --- restore: store size vs the disk ---------------------------------------------------------


def store_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*.safetensors") if p.is_file())


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_direct(paths: list[Path], chunk: int = 16 << 20) -> float:
    """Every file read once with O_DIRECT into one aligned buffer: the disk's sequential rate."""
    buf = mmap.mmap(-1, chunk)
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            while os.readv(fd, [buf]) == chunk:
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def read_plain(paths: list[Path]) -> float:
    """Every file read into fresh memory of its size, all of it kept to the end as a restore
    keeps it: what any restore must at least do. (Freed buffers would hand the next file
    pages already touched: a faster read no restore can match.)"""
    kept = []
    t0 = time.perf_counter()
    for p in paths:
        # an anonymous map: untouched pages, faulted in by the read (bytearray would zero them)
        buf = mmap.mmap(-1, p.stat().st_size)
        with open(p, "rb", buffering=0) as f:
            f.readinto(buf)
        kept.append(buf)
    took = time.perf_counter() - t0
    for buf in kept:
        buf.close()
    return took


def restore_server(store_root: Path) -> float:
    """The server's restore of the store's one record: its blocks read into a pool, evaluated."""
    import mlx.core as mx

    from kvsnap.runtime.cache.composed import BlockPool, load_composed
    from kvsnap.store.local import Store

    store = Store.open(store_root, readonly=True)
    info = store.scan()[0][0]
    t0 = time.perf_counter()
    state, _ = load_composed(store, info, BlockPool())
    held = [b for _, _, b in state.blocks] + ([state.checkpoint] if state.checkpoint else [])
    mx.eval([a for b in held for a in b.arrays.values()])
    return time.perf_counter() - t0


def restore_round(store: Path) -> dict[str, float]:
    """One of each: the O_DIRECT read and the restore from a cold page cache, a plain read and
    the restore from a warm one."""
    files = store_files(store)
    evict(files)
    direct = read_direct(files)
    evict(files)
    cold = restore_server(store)
    read_plain(files)
    plain = read_plain(files)
    read_plain(files)
    warm = restore_server(store)
    return {
        "direct_cold_s": direct,
        "restore_cold_s": cold,
        "plain_warm_s": plain,
        "restore_warm_s": warm,
    }


def part_restore(run: Run) -> dict:
    # the stubs' stores: the bytes per token of L4 and of the 0.6B shape, built in minutes
    stores = [
        p
        for p in run.lab.glob("tokens-kv-stub*")
        if p.is_dir() and int(p.name.rsplit("-", 1)[1]) >= run.sizes.restore_min_tokens
    ]
    if not stores:
        raise SystemExit(
            f"no stores of the tokens part under {run.lab} (tokens-kv-stub-N, N >= "
            f"{run.sizes.restore_min_tokens}); run --only tokens,restore"
        )
    stores.sort(key=lambda p: sum(f.stat().st_size for f in store_files(p)))
    runs: dict[str, dict[str, list[float]]] = {p.name: {} for p in stores}
    for rep in range(run.sizes.restore_reps):  # interleaved over sizes and readers
        for store in stores:
            run.note_load("restore")
            got = runs[store.name]
            for name, took in restore_round(store).items():
                got.setdefault(name, []).append(took)
            last = {k: round(v[-1], 3) for k, v in got.items()}
            print(f"[restore] rep {rep} {store.name}: {last}", flush=True)
    rows = []
    for store in stores:
        got = runs[store.name]
        med = {k: statistics.median(v) for k, v in got.items()}
        files = store_files(store)
        rows.append(
            {
                "store": store.name.removeprefix("tokens-"),
                "tokens": int(store.name.rsplit("-", 1)[1]),
                "bytes": sum(f.stat().st_size for f in files),
                "files": len(files),
                **{k: round(v, 4) for k, v in med.items()},
                "cold_vs_direct": round(med["direct_cold_s"] / med["restore_cold_s"], 3),
                "warm_vs_plain": round(med["plain_warm_s"] / med["restore_warm_s"], 3),
                "runs": got,
            }
        )
    return {"rows": rows}


# --- first request: a restored server's first and second request vs compute alone -----------


def ask(server: ServerProcess, model_name: str | None, system: str, user: str) -> dict:
    """One non-streamed request of one token: its time is the prefill of what was not cached."""
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 1,
        "temperature": 0,
    }
    if model_name:  # kvsnap serve needs it; mlx_lm.server would load another model by that name
        body["model"] = model_name
    t0 = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1800)
    took = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code} from {server.url}: {r.text[:300]}")
    usage = r.json().get("usage") or {}
    return {
        "seconds": round(took, 4),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


PAD_WORDS = ("now", "a", "it", "so", "then", "x", "ok")


def same_length_users(model: Path) -> tuple[str, str]:
    """USERS, the shorter padded with words until both are the same number of tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    users = list(USERS)
    for _ in range(50):
        counts = [count(u) for u in users]
        if counts[0] == counts[1]:
            return users[0], users[1]
        short = counts.index(min(counts))
        # the word that adds fewest tokens: one at a time, never past the other's count
        users[short] += min((f" {w}" for w in PAD_WORDS), key=lambda w: count(users[short] + w))
    raise SystemExit(f"could not pad {USERS} to one token count with {model}'s tokenizer")


def serve_twice(run: Run, route: str, model: Path, agents: Path, stores: dict, rep: int) -> dict:
    system = json.loads(agents.read_text())[0]["messages"][0]["content"]
    users = same_length_users(model)
    log = run.lab / "logs" / f"{route}-{rep}.log"
    log.parent.mkdir(exist_ok=True)
    load = load_now()
    if route == "kvsnap serve":
        flags = ["--continuous-batching", "--warm-prompts", str(agents)]
        flags += ["--kv-snapshots", str(stores["kvsnap"]), "--no-write-back"]
        server = start_server(model, flags, log, env=run.env, limit_s=3600)
        name: str | None = model.name
    else:
        cmd = [*KVSNAP, "mlx-lm", "serve", "--model", str(model)]
        server = bench_mlx_lm.launch([*cmd, "--kv-snapshots", str(stores["mlx-lm"])], log, run.env)
        name = None
    try:
        ready = server.wait_ready(1800)
        first = ask(server, name, system, users[0])
        second = ask(server, name, system, users[1])
    finally:
        server.stop()
    return {
        "route": route,
        "rep": rep,
        "ready_s": round(ready, 3),
        "first": first,
        "second": second,
        "load": [load, load_now()],
    }


def compute_alone(lm: Any, cached: int, new: int, reps: int = 3) -> float:
    """The model over ``new`` tokens after ``cached`` ones already in its cache, to the first
    token: what a warm request cannot avoid (median after one untimed pass)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm)
    for c, layer in zip(cache, lm.layers):
        attn = layer.self_attn
        shape = (1, attn.n_kv_heads, cached, lm.args.head_dim)
        c.update_and_fetch(mx.zeros(shape), mx.zeros(shape))
    mx.eval([c.state for c in cache])
    ids = mx.array(token_ids(lm, new), dtype=mx.int32)[None]
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        mx.eval(mx.argmax(lm(ids, cache=cache)[:, -1, :], axis=-1))
        times.append(time.perf_counter() - t0)
        for c in cache:
            c.trim(new)
    return statistics.median(times[1:])


def part_first_request(run: Run) -> dict:
    model = model_dir(run.sizes.request_model, run.workdir)
    agents = write_agents(model, run.lab / "request.json", 1, run.sizes.request_tokens)
    stores = {"kvsnap": run.lab / "request-kvsnap", "mlx-lm": run.lab / "request-mlx-lm"}
    builds = {
        "kvsnap": kvsnap_build(model, agents, stores["kvsnap"], run.env),
        "mlx-lm": kvsnap_build(model, agents, stores["mlx-lm"], run.env, "--for", "mlx-lm"),
    }
    routes = ("kvsnap serve", "kvsnap mlx-lm serve")
    launches = []
    for rep in range(run.sizes.request_reps):
        for route in routes if rep % 2 == 0 else routes[::-1]:  # interleaved, each leads
            run.note_load("first-request")
            launches.append(serve_twice(run, route, model, agents, stores, rep))
            print(f"[first-request] {json.dumps(launches[-1])}", flush=True)
    first = launches[0]["first"]
    cached, prompt = first["cached_tokens"] or 0, first["prompt_tokens"] or 0
    lm = load_mlx(model)
    compute = compute_alone(lm, cached, max(1, prompt - cached))
    summary: dict[str, Any] = {"compute_s": round(compute, 4)}
    for route in routes:
        mine = [x for x in launches if x["route"] == route]
        f = statistics.median(x["first"]["seconds"] for x in mine)
        s = statistics.median(x["second"]["seconds"] for x in mine)
        summary[route] = {
            "first_s": round(f, 4),
            "second_s": round(s, 4),
            "first_over_second": round(f / s, 3),
            "first_over_compute": round(f / compute, 3),
            "cached_tokens": sorted({x["first"]["cached_tokens"] for x in mine}, key=str),
            "prompt_tokens": sorted({x["first"]["prompt_tokens"] for x in mine}, key=str),
        }
    summary["first_over_mlx_lm_first"] = round(
        summary["kvsnap serve"]["first_s"] / summary["kvsnap mlx-lm serve"]["first_s"], 3
    )
    return {
        "model": run.sizes.request_model,
        "cached": cached,
        "new": prompt - cached,
        "builds": builds,
        "summary": summary,
        "launches": launches,
    }


# --- start: launch -> ready with many agents ---------------------------------------------------


def part_start(run: Run) -> dict:
    model = model_dir("tiny", run.workdir)
    point = SweepPoint(
        model=model,
        prompt_tokens=run.sizes.start_tokens,
        agents=run.sizes.start_agents,
        reps=run.sizes.start_reps,
        modes=("cold", "kv-snapshots"),
        request=False,
    )
    work = run.lab / "start"
    work.mkdir(exist_ok=True)
    run.note_load("start")
    rows = run_point(point, work, time.monotonic() + 3600, run.env)
    run.note_load("start")
    med = {m["mode"]: m for m in medians(rows)}
    extra = med["kv-snapshots"]["ready_s"] - med["cold"]["ready_s"]
    return {
        "agents": point.agents,
        "tokens": point.prompt_tokens,
        "reps": point.reps,
        "cold_ready_s": round(med["cold"]["ready_s"], 3),
        "kv_ready_s": round(med["kv-snapshots"]["ready_s"], 3),
        "kv_warmup_s": round(med["kv-snapshots"]["warmup_s"], 3),
        "ms_per_agent": round(extra / point.agents * 1000, 3),
        "launches": [asdict(r) for r in rows],
    }


# --- prefill: the matmul rate --------------------------------------------------------------------


def part_prefill(run: Run) -> dict:
    model = model_dir(run.sizes.prefill_model, run.workdir)
    steps = sorted({min(s, run.sizes.prefill_tokens) for s in run.sizes.prefill_steps})
    run.note_load("prefill")
    out = profile_prefill.profile(
        model,
        run.sizes.prefill_tokens,
        steps,
        run.sizes.prefill_reps,
        log=lambda line, **kw: print(f"[prefill] {line}", flush=True),
    )
    run.note_load("prefill")
    out["model_name"] = run.sizes.prefill_model
    return out


# --- the run's record and its plots ----------------------------------------------------------


def tree() -> dict:
    """The kvsnap measured: its folder and commit (and whether its files differ from it)."""
    root = Path(kvsnap.__file__).resolve().parents[1]

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return r.stdout.strip()

    return {
        "kvsnap_file": kvsnap.__file__,
        "commit": git("rev-parse", "--short", "HEAD"),
        "subject": git("log", "-1", "--format=%s")[:120],
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", "kvsnap")),
    }


def caption(result: dict, part: str) -> str:
    loads = result["loads"].get(part) or [0.0]
    t = result["tree"]
    return (
        f"{result['label']}: kvsnap {t['commit']}{'+' if t['dirty'] else ''}; load (1 min) "
        f"{min(loads):.1f}–{max(loads):.1f} on {result['cpus']} cores"
    )


def plot_all(results: list[dict], out: Path, stem: str) -> list[Path]:
    """One PNG per part any result has; several results (before, after) share each plot."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for part, draw in PLOTS.items():
        have = [r for r in results if part in r["parts"]]
        if not have:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for i, r in enumerate(have):
            draw(axes, r, "-o" if i == len(have) - 1 else "--s", r["label"])
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.text(0.01, 0.01, "\n".join(caption(r, part) for r in have), fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.04 + 0.03 * len(have), 1, 1))
        path = out / f"{stem}-{part}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def draw_tokens(axes: Any, r: dict, style: str, label: str) -> None:
    a, b = axes
    for name, got in r["parts"]["tokens"]["models"].items():
        rows = got["rows"]
        x = [row["tokens"] for row in rows]
        c = f"C{MODELS.index(name)}"  # one colour per model in every run
        what = f"{label}, {name}" + (" (compute stubbed)" if got["stubbed"] else "")
        a.plot(x, [row["build_s"] for row in rows], style, color=c, label=f"{what}: build")
        a.plot(x, [row["compute_s"] for row in rows], style, color=c, alpha=0.35)
        b.plot(x, [row["build_over_compute"] for row in rows], style, color=c, label=what)
    a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds")
    a.set_title("build vs prompt length (faint: compute alone, cache allocated once)", fontsize=9)
    b.axhline(1.0, color="gray", lw=0.8)
    b.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="build / compute alone")
    b.set_title("ratio to compute (1 = the limit)", fontsize=9)


def draw_agents(axes: Any, r: dict, style: str, label: str) -> None:
    rows = r["parts"]["agents"]["rows"]
    x = [row["agents"] for row in rows]
    a, b = axes
    a.plot(x, [row["build_s"] for row in rows], style, color="C0", label=f"{label}: kvsnap build")
    base = rows[0]
    linear = [base["build_s"] * n / base["agents"] for n in x]
    a.plot(x, linear, ":", color="gray", label=f"{label}: linear from {base['agents']}")
    a.set(xscale="log", yscale="log", xlabel="agents", ylabel="seconds")
    a.set_title("build vs agent count (tiny model)", fontsize=9)
    b.plot(x, [row["over_linear"] for row in rows], style, color="C0", label=label)
    b.axhline(1.0, color="gray", lw=0.8)
    b.set(xscale="log", xlabel="agents", ylabel="build / linear")
    b.set_title("ratio to linear (1 = the limit)", fontsize=9)


def draw_restore(axes: Any, r: dict, style: str, label: str) -> None:
    rows = r["parts"]["restore"]["rows"]
    x = [row["bytes"] / 1e6 for row in rows]
    a, b = axes
    for i, (key, name) in enumerate(
        (
            ("restore_cold_s", "restore, cold"),
            ("direct_cold_s", "O_DIRECT read, cold"),
            ("restore_warm_s", "restore, warm"),
            ("plain_warm_s", "plain read, warm"),
        )
    ):
        a.plot(x, [row[key] for row in rows], style, color=f"C{i}", label=f"{label}: {name}")
    a.set(xscale="log", yscale="log", xlabel="store MB", ylabel="seconds")
    a.set_title("restore vs store size", fontsize=9)
    cold = [row["cold_vs_direct"] for row in rows]
    b.plot(x, cold, style, color="C0", label=f"{label}: cold / O_DIRECT")
    warm = [row["warm_vs_plain"] for row in rows]
    b.plot(x, warm, style, color="C2", label=f"{label}: warm / plain read")
    b.axhline(0.8, color="gray", lw=0.8, ls=":")
    b.set(xscale="log", xlabel="store MB", ylabel="speed / the read's speed")
    b.set_title("ratio to the read (goal ≥ 0.8)", fontsize=9)


def draw_first_request(axes: Any, r: dict, style: str, label: str) -> None:
    s = r["parts"]["first-request"]["summary"]
    names = ["kvsnap 1st", "kvsnap 2nd", "mlx-lm route 1st", "mlx-lm route 2nd", "compute"]
    values = [
        s["kvsnap serve"]["first_s"],
        s["kvsnap serve"]["second_s"],
        s["kvsnap mlx-lm serve"]["first_s"],
        s["kvsnap mlx-lm serve"]["second_s"],
        s["compute_s"],
    ]
    a, b = axes
    a.plot(names, values, style, color="C0", label=label)
    a.set(ylabel="seconds")
    a.tick_params(axis="x", labelsize=7)
    part = r["parts"]["first-request"]
    a.set_title(f"warm requests, {part['cached']} cached + {part['new']} new tokens", fontsize=9)
    ratios = [v / s["compute_s"] for v in values]
    b.plot(names, ratios, style, color="C0", label=label)
    b.axhline(1.0, color="gray", lw=0.8)
    b.set(ylabel="/ compute alone")
    b.tick_params(axis="x", labelsize=7)
    b.set_title("ratio to compute (1 = the limit)", fontsize=9)


def draw_start(axes: Any, r: dict, style: str, label: str) -> None:
    s = r["parts"]["start"]
    a, b = axes
    a.plot(
        ["cold", f"{s['agents']} agents"],
        [s["cold_ready_s"], s["kv_ready_s"]],
        style,
        color="C0",
        label=label,
    )
    a.set(ylabel="launch → ready, s (median)")
    a.set_title("start-up", fontsize=9)
    b.plot([label], [s["ms_per_agent"]], style, color="C0", label=label)
    b.axhline(2.0, color="gray", lw=0.8, ls=":")
    b.set(ylabel="ms per agent over cold (goal ≤ 2)")
    b.set_title("per agent", fontsize=9)


def draw_prefill(axes: Any, r: dict, style: str, label: str) -> None:
    p = r["parts"]["prefill"]
    steps = sorted(p["steps"], key=int)
    a, b = axes
    x = [int(s) for s in steps]
    for i, (key, name) in enumerate(
        (("rate_ratio", "mlx-lm's cache"), ("rate_ratio_allocated_once", "cache allocated once"))
    ):
        wall = [p["steps"][s][key] for s in steps]
        a.plot(x, wall, style, color=f"C{i}", label=f"{label}: {name}")
        cpu = [p["steps"][s]["cpu"][key] for s in steps]
        a.plot(x, cpu, style, color=f"C{i}", alpha=0.35, label=f"{label}: {name}, CPU time")
    a.axhline(0.7, color="gray", lw=0.8, ls=":")
    a.set(xscale="log", xlabel="prefill step size", ylabel="matmul time / prefill time")
    a.set_title(f"prefill of {p['tokens']} tokens vs the matmul rate", fontsize=9)
    shares: dict[str, float] = next(
        (
            p["steps"][s]["share_of_prefill"]
            for s in steps
            if "rope" in p["steps"][s]["share_of_prefill"]
        ),
        {},
    )
    names = list(shares)
    b.plot(names, [shares[n] for n in names], style, color="C0", label=label)
    b.set(ylabel="share of the prefill")
    b.tick_params(axis="x", labelsize=7)
    b.set_title("where the time goes (ablations, one step size)", fontsize=9)


PLOTS: dict[str, Callable[[Any, dict, str, str], None]] = {
    "tokens": draw_tokens,
    "agents": draw_agents,
    "restore": draw_restore,
    "first-request": draw_first_request,
    "start": draw_start,
    "prefill": draw_prefill,
}


def summary(result: dict) -> dict:
    """The ratios the issue's goals are stated in, where their parts ran."""
    parts, out = result["parts"], cast(dict[str, Any], {})
    for name, got in parts.get("tokens", {}).get("models", {}).items():
        rows = got["rows"]
        if len(rows) > 1:
            big = 8192 if max(r["tokens"] for r in rows) >= 8192 else rows[-1]["tokens"]
            out[f"tokens {name}"] = {
                **scaling(rows, "tokens", big, big // 4, ("build_s", "compute_s")),
                "build_over_compute": {r["tokens"]: r["build_over_compute"] for r in rows},
            }
    if "agents" in parts and len(parts["agents"]["rows"]) > 1:
        rows = parts["agents"]["rows"]
        big = rows[-1]["agents"]
        out["agents"] = scaling(rows, "agents", big, big // 10, ("build_s",))
    if "restore" in parts:
        out["restore"] = [
            {k: r.get(k) for k in ("store", "bytes", "cold_vs_direct", "warm_vs_plain")}
            for r in parts["restore"]["rows"]
        ]
    if "first-request" in parts:
        out["first-request"] = parts["first-request"]["summary"]
    if "start" in parts:
        out["start"] = {"ms_per_agent": parts["start"]["ms_per_agent"]}
    if "prefill" in parts:
        out["prefill"] = {
            s: {k: round(v[k], 3) for k in ("rate_ratio", "rate_ratio_allocated_once")}
            for s, v in parts["prefill"]["steps"].items()
        }
    return out


def merged(paths: list[str]) -> dict:
    """One result from several runs of one checkout (``a.json+b.json``): the tokens part's
    models and the restore part's stores added up, any other part from the last run having it."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    out = results[0]
    for more in results[1:]:
        for part, got in more["parts"].items():
            have = out["parts"].get(part)
            if have is not None and part == "tokens":
                have["models"].update(got["models"])
            elif have is not None and part == "restore":
                have["rows"] = sorted(have["rows"] + got["rows"], key=lambda r: r["bytes"])
            else:
                out["parts"][part] = got
        for part, loads in more["loads"].items():
            out["loads"].setdefault(part, []).extend(loads)
    return out


def counts(flag: str, value: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers; ``none``: the empty list (skip that model)."""
    if value == "none":
        return ()
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise SystemExit(
            f"{flag} {value!r}: give whole numbers separated by commas (e.g. 512,2048) or none"
        ) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="JSON and PNG output folder")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of minutes")
    ap.add_argument("--label", default="run", help="names the outputs (e.g. before, after)")
    ap.add_argument(
        "--workdir",
        type=Path,
        default=Path(".kvsnap-bench/long"),
        help="models (shared by runs), stores and logs (per label)",
    )
    ap.add_argument("--tokens", help="the tokens part's lengths on its real model, comma-separated")
    ap.add_argument("--stub-tokens", help="the same for the compute-stubbed L4 (none: skip it)")
    ap.add_argument("--stub28-tokens", help="the same for the stubbed 28-layer shape (none: skip)")
    ap.add_argument("--agents", help="the agents part's agent counts, comma-separated")
    ap.add_argument("--model", choices=MODELS, help="the tokens, restore and request parts' model")
    ap.add_argument(
        "--plot",
        help="only draw: comma-separated result JSONs (e.g. before,after; a+b: one checkout's "
        "runs merged) into OUT/long-*.png and OUT/long-summary.json",
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        results = [merged(group.split("+")) for group in args.plot.split(",") if group]
        for path in plot_all(results, args.out, "long"):
            print(path)
        (args.out / "long-summary.json").write_text(
            json.dumps({r["label"]: summary(r) for r in results}, indent=1)
        )
        return 0
    only = [p for p in args.only.split(",") if p]
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    sizes = QUICK if args.quick else Sizes()
    if args.tokens:
        sizes = replace(sizes, tokens=counts("--tokens", args.tokens))
    if args.stub_tokens:
        sizes = replace(sizes, stub_tokens=counts("--stub-tokens", args.stub_tokens))
    if args.stub28_tokens:
        sizes = replace(sizes, stub28_tokens=counts("--stub28-tokens", args.stub28_tokens))
    if args.agents:
        sizes = replace(sizes, agents=counts("--agents", args.agents))
    if args.model:
        sizes = replace(sizes, tokens_model=args.model, request_model=args.model)
    workdir = args.workdir.resolve()
    # this environment (PYTHONPATH too) plus OpenBLAS and a digest cache per label
    env = bench_mlx_lm.server_env(workdir / args.label)
    # python -m and -c put the working folder first on sys.path: without this, a build or
    # server started from a checkout measures that checkout, not PYTHONPATH's
    env["PYTHONSAFEPATH"] = "1"
    run = Run(workdir=workdir, label=args.label, sizes=sizes, env=env)
    result: dict[str, Any] = {
        "label": args.label,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "tree": tree(),
        "openblas": BLAS,
        "cpus": os.cpu_count(),
        "sizes": asdict(sizes),
        "loads": run.loads,
        "parts": {},
    }
    print(f"measuring {result['tree']}", flush=True)
    runs = {
        "tokens": part_tokens,
        "agents": part_agents,
        "restore": part_restore,
        "first-request": part_first_request,
        "start": part_start,
        "prefill": part_prefill,
    }
    path = args.out / f"long-{args.label}.json"
    for name in only:
        t0 = time.perf_counter()
        run.note_load(name)
        result["parts"][name] = runs[name](run)
        run.note_load(name)
        result["parts"][name]["part_seconds"] = round(time.perf_counter() - t0, 1)
        result["summary"] = summary(result)
        path.write_text(json.dumps(result, indent=1, default=str))  # kept after every part
        print(f"[{name}] done in {result['parts'][name]['part_seconds']}s", flush=True)
    print(json.dumps(result["summary"], indent=1))
    for png in plot_all([result], args.out, f"long-{args.label}"):
        print(png)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
