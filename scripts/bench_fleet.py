#!/usr/bin/env python
"""A warm fleet (docs/fleet.md, docs/benchmarks.md "A warm fleet: the next turn after a
failover"): the next turn of an ~8k-token conversation on the replica that holds it, on a
replica that fetches it from the shared tier, and on a cold replica, side by side in one run;
then a fleet whose tier is down against one without a tier.

Failover (the Qwen3-0.6B shape, fp32, made locally; one redis-server on 127.0.0.1):

  A  kvsnap serve M --continuous-batching --kv-snapshots SA --persist-requests
         --shared-tier redis://127.0.0.1:P/0 --shared-tier-budget B
     serves turn k: a ~``--tokens``-token system prompt and a short user message (one long
     first turn: its prefill is the run's first long wait); its record is written behind.
  (a) local hit    turn k+1 to A again (turn k warm in its memory)
  (a') disk hit    with --disk-hit: turn k+1 to D, a replica started on a copy of A's store
                   (no tier): the same replica restarted, its conversation on its own disk
  (b) tier fetch   turn k+1 to B: a fresh replica, its own empty store, the same tier
                   (started per repetition: one fetch each). B first serves a short
                   conversation of its own (two turns of ~400 tokens, the second a hit), as
                   a replica of a running fleet has: its weights (read after /health since
                   d6776df) are read and the hit's code has run once; --cold-b: measured
                   right after /health, as runs 1-10 of docs/benchmarks.md were
  (c) full prefill turn k+1 to C: kvsnap serve M --continuous-batching (no store, no tier)

Every turn k+1 is its own short user message (a branch off turn k), so the repetitions do
not reuse one another. A replica's record of a branch supersedes turn k's record in the
tier's index (only its index entry goes; the values stay), so before each (a) and (b) the
index is put back as it was once turn k was written behind (Redis DUMP/RESTORE of that one
key): each measure sees the tier of "a failover right after turn k". Order: a1 b1 c b2 a2 ...
(c once: it is a full prefill). ``--kill-a``: every (a) first, then A is killed -9 before
the first (b), as in the failover measured (B's fetch then does not share the box's memory
with a live A: docs/benchmarks.md "The fetch at this machine's floor"). Per measure: TTFT
(request -> first streamed content token), the server's CPU seconds (its process tree,
/proc) over the request, the 1-minute load average and free memory before it, and for (b)
B's shared_tier counters and redis-server's CPU seconds.
``--probe-default-budget`` also starts a replica with the default budget (10 s) and reads
its counters once the budget has passed (then kills it: it would prefill).

Tier down (a tiny demo model, fast): D has --shared-tier at a redis-server that was stopped
after one warm-up request each; E has no tier (both --kv-snapshots --persist-requests).
``--conversations`` distinct conversations of 2 turns each, sequential, each server first in
turn: p50/p99 TTFT of each and failed requests. ``--control`` adds F, E's twin (no tier), to
the same interleave: how far two equal servers' p99 differ on this machine. ``--only down
--down-key KEY`` repeats the tier-down part into another key of the JSON (the goal reads
``tier_down``).

    python scripts/bench_fleet.py --out docs/bench/fleet                     # ~25 min here
    python scripts/bench_fleet.py --size tiny --tokens 1000 --out /tmp/fleet # a dry run
    python scripts/bench_fleet.py --out docs/bench/fleet --only down --conversations 300 \
        --control --down-key tier_down_3way
    python scripts/bench_fleet.py --out docs/bench/fleet --plot-only

Writes OUT/fleet.json (rewritten after each part) and OUT/fleet-failover.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_agents import tree_cpu_s  # noqa: E402  (scripts/ is on sys.path: one /proc walk)

from kvsnap.blas import find_openblas, preload_openblas  # noqa: E402

preload_openblas()  # before mlx: make_demo_model imports it
from kvsnap.tools.client import stream_chat  # noqa: E402
from kvsnap.tools.serverproc import ServerProcess, free_port, under_hard_limit  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
SERVED = "kvsnap-model"
FIRST_USER = "Here is the task. Read the system prompt carefully and say when you are ready."
LABELS = {
    "local": "local hit (A)",
    "disk": "restarted on its store (D)",
    "tier": "tier fetch (B)",
    "prefill": "full prefill (C)",
}


# --- measuring ------------------------------------------------------------------------------


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def memory_mb() -> dict:
    """The kernel's MemFree and MemAvailable (MiB): a fetch's fresh pages cost more when free
    memory is low (the page cache reclaimed page by page, on the fetching process's CPU)."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemFree", "MemAvailable"):
                out[key] = int(rest.split()[0]) // 1024
    return out


def pctl(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# --- processes --------------------------------------------------------------------------------


class Redis:
    """A redis-server without persistence on a free port (its own session: killed by group)."""

    def __init__(self, folder: Path):
        self.folder, self.port = folder, free_port()
        folder.mkdir(parents=True, exist_ok=True)
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(folder)]
        with open(folder / "redis.log", "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    break
            except Exception:  # noqa: BLE001 - not listening yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start (exit {self.proc.poll()})"
                    ) from None
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30)

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def indexes(self) -> dict[bytes, bytes]:
        """DUMP of each kvsnap index (the sorted sets of records) now."""
        c = self.client()
        return {k: c.dump(k) for k in c.scan_iter(match="kvsnap:t?:*:records", count=1000)}

    def restore(self, dumps: dict[bytes, bytes]) -> None:
        c = self.client()
        for key, value in dumps.items():
            c.restore(key, 0, value, replace=True)

    def memory(self) -> dict:
        info = self.client().info("memory")
        keys = sum(1 for _ in self.client().scan_iter(match="kvsnap:*", count=1000))
        return {"used_memory": info["used_memory"], "keys": keys}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def serve(name: str, model: Path, args: list[str], work: Path, env: dict) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "kvsnap", "serve", str(model), "--served-model-name", SERVED]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *args]
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        launched = time.perf_counter()
        proc = subprocess.Popen(
            under_hard_limit(cmd, 7200),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=CODE or work,  # not the checkout: `-m` puts the cwd first on sys.path
        )
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log, launched)
    server.command = " ".join(cmd)  # type: ignore[attr-defined]
    try:
        server.wait_ready(600)
    except BaseException:
        stop(server)
        raise
    return server


def stop(server: ServerProcess, grace: float = 30) -> None:
    """SIGINT to ``timeout`` (it passes it on: the server sees one Ctrl-C and shuts down in
    order), then SIGKILL to the server's own process group."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 10)):
        if server.proc.poll() is not None:
            return
        try:
            if sig == signal.SIGINT:
                server.proc.send_signal(sig)
            else:
                os.killpg(server.proc.pid, sig)
            server.proc.wait(wait)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def persist(server: ServerProcess) -> dict:
    return server.status(timeout=60)["persist"]


def settle(server: ServerProcess, timeout: float = 600) -> dict:
    """Wait until the server's records are on disk and written behind (its tier's writes
    reach its local writes, nothing queued); returns persist status and the seconds waited."""
    t0 = time.monotonic()
    while True:
        p = persist(server)
        tier = p.get("shared_tier", {})
        local_done = p["queued"] == 0 and p["written"] >= 1
        tier_done = not tier.get("enabled") or (
            tier["queue_depth"] == 0 and tier["writes"] + tier["errors"] >= p["written"]
        )
        if local_done and tier_done:
            return {**p, "settle_s": round(time.monotonic() - t0, 2)}
        if time.monotonic() - t0 > timeout:
            return {**p, "settle_s": None, "settle_timed_out": True}
        time.sleep(0.2)


# --- requests ---------------------------------------------------------------------------------


def ask(
    server: ServerProcess,
    messages: list,
    max_tokens: int,
    limit_s: float = 3600,
    profile: Path | None = None,
) -> dict:
    """One streamed chat turn: TTFT, usage, the server's CPU seconds over it; with
    ``profile``, py-spy's raw stacks of the server's threads over the request there."""
    cpu0, load0, mem0 = tree_cpu_s(server.proc.pid), load(), memory_mb()
    spy = spy_on(server, profile) if profile is not None else None
    try:
        with httpx.Client(timeout=httpx.Timeout(limit_s, connect=10)) as client:
            r = stream_chat(client, server.url, SERVED, messages, max_tokens=max_tokens)
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
    extra = {"profile": profile_summary(profile)} if profile is not None else {}
    return {
        **extra,
        "ttft_s": round(r.ttft_s, 3),
        "total_s": round(r.total_s, 3),
        "prompt_tokens": r.usage.get("prompt_tokens"),
        "cached_tokens": r.cached_tokens,
        "completion_tokens": r.usage.get("completion_tokens"),
        "server_cpu_s": round(tree_cpu_s(server.proc.pid) - cpu0, 2),
        "load_before": load0,
        "memory_mb_before": mem0,
        "text": r.text,
    }


def spy_on(server: ServerProcess, path: Path) -> subprocess.Popen:
    """py-spy recording the server's threads (idle samples too: where the request waits) at
    50 Hz into ``path`` (raw collapsed stacks, one line per thread and stack)."""
    cmd = ["py-spy", "record", "--pid", str(server.proc.pid), "--rate", "50", "--threads"]
    cmd += ["--idle", "--subprocesses", "--format", "raw", "--output", str(path), "--nonblocking"]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the request goes in
    return spy


def profile_summary(path: Path, depth: int = 3, top: int = 8) -> dict:
    """py-spy's raw stacks as seconds per thread (name) and per innermost ``depth`` frames
    (file names without folders), each thread's ``top`` stacks of at least 0.1 s."""
    import collections
    import re

    if not path.exists():
        return {}
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        while frames and not frames[0].startswith("thread"):
            frames = frames[1:]
        if not frames:
            continue
        thread = re.sub(r"^thread \(\d+\):? ?", "", frames[0]) or "unnamed"
        named = [re.sub(r" \(/?(?:[^;()]*/)?([^/;()]+\.py):\d+\)", r" (\1)", f) for f in frames[1:]]
        per[thread][";".join(named[-depth:])] += int(count)
    return {
        thread: [[round(n / 50, 2), k] for k, n in stacks.most_common(top) if n >= 5]
        for thread, stacks in sorted(per.items(), key=lambda kv: -sum(kv[1].values()))
    }


# B's warm-up before the measure: a short conversation of its own (no prefix of the measured
# one), two turns, the second a hit on the first (the shared-prefix path's first run)
WARM_B_TOKENS = 400


def turn(history: list, tag: str) -> list:
    user = f"Turn two ({tag}): which of these files should I read first, and why?"
    return [*history, {"role": "user", "content": user}]


# --- the failover -----------------------------------------------------------------------------


def failover(args, out: dict, save) -> None:
    from transformers import AutoTokenizer

    from kvsnap.tools.bench_startup import system_prompt_of
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    work = args.workdir / "failover"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = make_demo_model(
        args.workdir / f"demo-{args.size}-text", DemoSpec(size=args.size, text_outputs=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    system = system_prompt_of(tokenizer, args.tokens - 40, salt="Fleet failover.")
    warm_b = system_prompt_of(tokenizer, WARM_B_TOKENS, salt="A warm-up of B's own.")
    env = kvsnap_env(args.workdir)
    redis = Redis(work / "redis")
    common = ["--continuous-batching"]
    if args.cache_memory_mb is not None:
        common += ["--cache-memory-mb", str(args.cache_memory_mb)]

    def replica(name: str, budget: float | None = args.fetch_budget) -> ServerProcess:
        extra = ["--kv-snapshots", str(work / f"store-{name}"), "--persist-requests"]
        extra += ["--shared-tier", redis.url]
        if budget is not None:
            extra += ["--shared-tier-budget", str(budget)]
        return serve(name, model, [*common, *extra], work, env)

    res = out["failover"] = {
        "command": args.command,
        "code": args.code,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": f"demo {args.size} (dense), fp32, text_outputs",
        "tokens_target": args.tokens,
        "cache_memory_mb": args.cache_memory_mb,
        "fetch_budget_s": args.fetch_budget,
        "b_warmed": not args.cold_b,
        "runs": [],
    }
    servers: list[ServerProcess] = []
    try:
        a = replica("A")
        servers.append(a)
        res["commands"] = {"A": a.command}
        history = [{"role": "system", "content": system}, {"role": "user", "content": FIRST_USER}]
        print(f"turn k on A (~{args.tokens} tokens, a full prefill) ...", flush=True)
        first = ask(a, history, args.max_tokens)
        t0 = time.monotonic()
        settled = settle(a)
        first["write_behind_wait_s"] = round(time.monotonic() - t0, 2)
        first["a_persist"] = settled
        res["turn_k"] = first
        history = [*history, {"role": "assistant", "content": first.pop("text")}]
        print("turn k:", json.dumps({k: v for k, v in first.items() if k != "a_persist"}))
        print("A shared_tier:", json.dumps(settled["shared_tier"]), flush=True)
        res["redis_after_turn_k"] = redis.memory()
        after_k = redis.indexes()
        res["tier_indexes"] = len(after_k)
        save()

        def local(rep: int) -> dict:
            redis.restore(after_k)
            spy = work / f"profile-local{rep}.txt" if args.profile else None
            row = {"kind": "local", "rep": rep}
            row.update(ask(a, turn(history, f"local {rep}"), 4, profile=spy))
            row["server_tier"] = persist(a)["shared_tier"]
            settle(a)
            return row

        def tier(rep: int) -> dict:
            redis.restore(after_k)
            b = replica(f"B{rep}")
            servers.append(b)
            try:
                if not args.cold_b:  # a running replica: weights read, kernels run
                    talk = [
                        {"role": "system", "content": warm_b},
                        {"role": "user", "content": "Hi."},
                    ]
                    reply = ask(b, talk, 2)
                    talk += [{"role": "assistant", "content": reply.pop("text")}]
                    ask(b, [*talk, {"role": "user", "content": "And then?"}], 2)
                    settle(b, timeout=60)
                before, rcpu = persist(b)["shared_tier"], redis.cpu_s()
                spy = work / f"profile-tier{rep}.txt" if args.profile else None
                row = {"kind": "tier", "rep": rep}
                row.update(ask(b, turn(history, f"tier {rep}"), 4, profile=spy))
                row["redis_cpu_s"] = round(redis.cpu_s() - rcpu, 2)
                after = persist(b)["shared_tier"]
                row["server_tier"] = after
                row["tier_delta"] = {
                    k: round(after[k] - before[k], 3)
                    for k in ("hits", "misses", "fetched_tokens", "bytes_in", "fetch_seconds")
                    + ("timeouts", "errors", "skipped_slower")
                }
                row["command"] = b.command
                settle(b)
            finally:
                stop(b)
                shutil.rmtree(work / f"store-B{rep}", ignore_errors=True)
            return row

        def disk(rep: int) -> dict:
            store = work / f"store-D{rep}"
            shutil.copytree(work / "store-A", store)
            d = serve(
                f"D{rep}",
                model,
                [*common, "--kv-snapshots", str(store), "--persist-requests"],
                work,
                env,
            )
            servers.append(d)
            try:
                row = {"kind": "disk", "rep": rep, **ask(d, turn(history, f"disk {rep}"), 4)}
                row["disk_hits"] = persist(d)["disk_hits"]
                row["command"] = d.command
            finally:
                stop(d)
                shutil.rmtree(store, ignore_errors=True)
            return row

        def prefill() -> dict:
            c = serve("C", model, common, work, env)
            servers.append(c)
            try:
                row = {"kind": "prefill", "rep": 1, **ask(c, turn(history, "cold 1"), 4)}
                row["command"] = c.command
            finally:
                stop(c)
            return row

        plan = []
        for rep in range(1, args.reps + 1):
            pair = [("local", rep), ("tier", rep)] + ([("disk", rep)] if args.disk_hit else [])
            plan += pair if rep % 2 else pair[::-1]
            if rep == 1 and not args.skip_prefill:
                plan.append(("prefill", 1))
        if args.kill_a:  # a failover as it happens: A's turns first, then A gone, then B's
            plan = [p for p in plan if p[0] == "local"] + [p for p in plan if p[0] != "local"]
        res["a_killed_before_tier"] = args.kill_a
        for kind, rep in plan:
            if args.kill_a and kind != "local" and a.proc.poll() is None:
                print("A killed (-9): its memory freed, as in the failover measured", flush=True)
                os.killpg(a.proc.pid, signal.SIGKILL)
                a.proc.wait(30)
            print(f"{kind} {rep} (load {load()}) ...", flush=True)
            run = {"local": local, "tier": tier, "disk": disk}
            row = run[kind](rep) if kind != "prefill" else prefill()
            row.pop("text", None)
            res["runs"].append(row)
            brief = {k: row.get(k) for k in ("ttft_s", "cached_tokens", "server_cpu_s")}
            print(kind, rep, json.dumps({**brief, **row.get("tier_delta", {})}), flush=True)
            res["summary"] = summarize(res["runs"])
            save()
        if args.probe_default_budget:
            redis.restore(after_k)
            res["default_budget_probe"] = probe(replica, history, work)
            print("default budget:", json.dumps(res["default_budget_probe"]), flush=True)
        res["redis_at_end"] = redis.memory()
        res["store_a_bytes"] = sum(
            f.stat().st_size for f in (work / "store-A").rglob("*") if f.is_file()
        )
    finally:
        for s in servers:
            stop(s)
        redis.stop()
    res["summary"] = summarize(res["runs"])
    save()


def probe(replica, history: list, work: Path) -> dict:
    """A replica with the default --shared-tier-budget: its counters once the budget has
    passed since the request went in (2 s more), then killed (past the budget it prefills)."""
    from kvsnap.runtime.persist.options import DEFAULT_TIER_BUDGET_S

    b = replica("B-default", budget=None)
    try:
        sent = time.monotonic()

        def send():
            try:
                ask(b, turn(history, "default budget"), 4, limit_s=30)
            except (httpx.HTTPError, RuntimeError) as exc:  # cut off on purpose
                print("default-budget request cut off:", type(exc).__name__, flush=True)

        threading.Thread(target=send, daemon=True).start()
        time.sleep(DEFAULT_TIER_BUDGET_S + 2.0)
        tier = persist(b)["shared_tier"]
        return {
            "budget_s": tier["budget_s"],
            "read_after_s": round(time.monotonic() - sent, 2),
            **{k: tier[k] for k in ("hits", "timeouts", "bytes_in", "fetch_seconds", "breaker")},
        }
    finally:
        stop(b, grace=2)
        shutil.rmtree(work / "store-B-default", ignore_errors=True)


def summarize(runs: list[dict]) -> dict:
    out = {}
    for kind in LABELS:
        rows = [r for r in runs if r["kind"] == kind]
        if rows:
            out[kind] = {
                "ttft_s_median": round(statistics.median(r["ttft_s"] for r in rows), 3),
                "ttft_s": [r["ttft_s"] for r in rows],
                "server_cpu_s": [r["server_cpu_s"] for r in rows],
                "cached_tokens": [r["cached_tokens"] for r in rows],
                "prompt_tokens": [r["prompt_tokens"] for r in rows],
                "load_before_1min": [r["load_before"][0] for r in rows],
            }
    if "local" in out and "tier" in out:
        out["tier_over_local"] = round(
            out["tier"]["ttft_s_median"] / out["local"]["ttft_s_median"], 2
        )
    if "disk" in out and "tier" in out:
        out["tier_over_disk"] = round(
            out["tier"]["ttft_s_median"] / out["disk"]["ttft_s_median"], 2
        )
    if "prefill" in out and "tier" in out:
        out["tier_over_prefill"] = round(
            out["tier"]["ttft_s_median"] / out["prefill"]["ttft_s_median"], 4
        )
    return out


# --- tier down --------------------------------------------------------------------------------


def refused_connect_s(url: str) -> float:
    """Seconds redis-py takes to fail on ``url`` (nothing listening there)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    t0 = time.perf_counter()
    try:
        client.ping()
    except redis.RedisError:
        pass
    return round(time.perf_counter() - t0, 5)


def tier_down(args, out: dict, save) -> None:
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    work = args.workdir / "tier-down"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = make_demo_model(
        args.workdir / f"demo-{args.down_size}-text",
        DemoSpec(size=args.down_size, text_outputs=True),
    )
    env = kvsnap_env(args.workdir)
    redis = Redis(work / "redis")
    base = ["--continuous-batching", "--persist-requests"]
    servers = {}
    res = out[args.down_key] = {
        "command": args.command,
        "code": args.code,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": f"demo {args.down_size}, fp32",
        "conversations": args.conversations,
        "control": args.control,
        "rows": [],
    }
    try:
        servers["down"] = serve(
            "D",
            model,
            [*base, "--kv-snapshots", str(work / "store-D"), "--shared-tier", redis.url],
            work,
            env,
        )
        servers["none"] = serve(
            "E", model, [*base, "--kv-snapshots", str(work / "store-E")], work, env
        )
        if args.control:  # E's twin: how far two equal servers' p99 differ here
            servers["control"] = serve(
                "F", model, [*base, "--kv-snapshots", str(work / "store-F")], work, env
            )
        res["commands"] = {k: s.command for k, s in servers.items()}

        def chat(i: int, n: int, server: ServerProcess, history: list) -> tuple[dict, list]:
            msgs = [*history, {"role": "user", "content": f"Conversation {i}, turn {n}: go on."}]
            try:
                r = ask(server, msgs, 4, limit_s=120)
                return r, [*msgs, {"role": "assistant", "content": r.pop("text")}]
            except (httpx.HTTPError, RuntimeError) as e:
                return {"error": str(e)[:300]}, msgs

        def system(i: int) -> list:
            text = f"Conversation {i} of the tier-down run. You review code and answer briefly. "
            return [{"role": "system", "content": text * 4}]

        for server in servers.values():  # one warm-up each, the tier still up
            chat(-1, 1, server, system(-1))
        settle(servers["down"], 60)
        res["warmup_tier"] = persist(servers["down"])["shared_tier"]
        redis.stop()  # the tier goes down: nothing listens on its port any more
        res["refused_connect_s"] = refused_connect_s(redis.url)
        print(f"tier stopped; a refused connect takes {res['refused_connect_s']} s", flush=True)
        t0 = time.monotonic()
        for i in range(args.conversations):
            names = list(servers)
            k = i % len(names)
            order = names[k:] + names[:k]  # each server first as often as the others
            histories = {name: system(i) for name in order}
            for n in (1, 2):
                for name in order:
                    row, histories[name] = chat(i, n, servers[name], histories[name])
                    keep = {k: row[k] for k in ("ttft_s", "cached_tokens", "error") if k in row}
                    if "load_before" in row:
                        keep["load_1min"] = row["load_before"][0]
                    res["rows"].append({"server": name, "conversation": i, "turn": n, **keep})
        res["wall_s"] = round(time.monotonic() - t0, 1)
        res["down_tier_counters"] = persist(servers["down"])["shared_tier"]
    finally:
        for s in servers.values():
            stop(s)
        redis.stop()
    res["summary"] = summarize_down(res["rows"])
    print("tier down:", json.dumps(res["summary"]), flush=True)
    save()


def summarize_down(rows: list[dict]) -> dict:
    out = {}
    for name in ("down", "none", "control"):
        mine = [r for r in rows if r["server"] == name]
        if not mine:
            continue
        ok = [r["ttft_s"] for r in mine if "ttft_s" in r]
        entry = {"requests": len(mine), "failed": len(mine) - len(ok)}
        if ok:
            entry.update(
                p50_s=round(pctl(ok, 50), 4),
                p99_s=round(pctl(ok, 99), 4),
                max_s=round(max(ok), 4),
                first3_s=[r.get("ttft_s") for r in mine[:3]],
                load_before_1min_mean=round(
                    statistics.mean(r["load_1min"] for r in mine if "load_1min" in r), 2
                ),
            )
        out[name] = entry
    if out.get("none", {}).get("p99_s") and out.get("down", {}).get("p99_s"):
        out["p99_down_over_none"] = round(out["down"]["p99_s"] / out["none"]["p99_s"], 3)
        out["p50_down_over_none"] = round(out["down"]["p50_s"] / out["none"]["p50_s"], 3)
    if "control" in out and out.get("none", {}).get("p99_s"):
        out["p99_control_over_none"] = round(out["control"]["p99_s"] / out["none"]["p99_s"], 3)
    return out


# --- results ----------------------------------------------------------------------------------


def goals(out: dict) -> dict:
    g = {}
    s = out.get("failover", {}).get("summary", {})
    if "tier_over_local" in s:
        g["tier_fetch_within_1.5x_local"] = s["tier_over_local"] <= 1.5
    if "tier_over_prefill" in s:
        g["tier_fetch_within_0.3x_prefill"] = s["tier_over_prefill"] <= 0.3
    d = out.get("tier_down", {}).get("summary", {})
    if "p99_down_over_none" in d:
        g["tier_down_p99_within_10pct"] = d["p99_down_over_none"] <= 1.10
        g["tier_down_no_failures"] = d["down"]["failed"] == 0
    return g


def ratios(s: dict) -> str:
    """The measured ratios of the failover summary, each beside its goal (if it has one)."""
    shown = [
        ("tier_over_local", "tier / local", "{:.2f}× (goal ≤ 1.5)"),
        ("tier_over_disk", "tier / restarted", "{:.2f}×"),
        ("tier_over_prefill", "tier / prefill", "{:.3f}× (goal ≤ 0.3)"),
    ]
    return ", ".join(f"{name} " + fmt.format(s[k]) for k, name, fmt in shown if k in s)


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    down = out.get("tier_down", {}).get("summary", {})
    if "down" in down and "p50_s" in down["down"]:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.4), width_ratios=[3, 2])
    else:  # the tier-down part was not run: the failover alone
        fig, left = plt.subplots(figsize=(7.5, 5.4))
        right = None
    s = out.get("failover", {}).get("summary", {})
    kinds = [k for k in LABELS if k in s]
    if kinds:
        vals = [s[k]["ttft_s_median"] for k in kinds]
        left.bar([LABELS[k] for k in kinds], vals, color=["C2", "C1", "C0", "C3"][: len(kinds)])
        for i, k in enumerate(kinds):  # each measure on its median's bar, the label above both
            runs = s[k]["ttft_s"]
            left.scatter([i] * len(runs), runs, color="k", s=12, zorder=3)
            cpu = statistics.median(s[k]["server_cpu_s"])
            label = f"{vals[i]:,.1f} s\n(CPU {cpu:,.1f} s)"
            left.annotate(label, (i, max(runs) * 1.2), ha="center", va="bottom", fontsize=9)
        left.set_yscale("log")
        left.set_ylim(min(vals) / 3, max(vals) * 8)
        left.set_ylabel("TTFT of turn k+1 (s, log scale; median)")
        tokens = s[kinds[0]]["prompt_tokens"][0]
        left.set_title(
            f"Next turn after a failover, {tokens:,}-token prompt; {out['failover']['model']}, "
            f"{out.get('cores')} cores\n{ratios(s)}; bars: median, dots: each run",
            fontsize=9,
        )
    d = down
    if right is not None:
        names = [("none", "no tier"), ("down", "tier down")]
        x = range(len(names))
        for off, (q, color) in zip((-0.2, 0.2), (("p50_s", "C0"), ("p99_s", "C1"))):
            vals = [d[n][q] * 1000 for n, _ in names]
            bars = right.bar([i + off for i in x], vals, 0.4, label=q[:3], color=color)
            right.bar_label(bars, [f"{v:.0f} ms" for v in vals], fontsize=8)
        right.set_xticks(list(x), [f"{lab}\n({d[n]['failed']} failed)" for n, lab in names])
        right.set_ylabel("TTFT (ms)")
        right.legend()
        n = d["down"]["requests"]
        repeats = [
            f"{v['summary']['p99_down_over_none']}×"
            for k, v in out.items()
            if k.startswith("tier_down_")
            and "p99_down_over_none" in v.get("summary", {})
            and not v.get("note")
        ]
        more = f"; repeats: p99 down / none {', '.join(repeats)}" if repeats else ""
        right.set_title(
            f"Tier down (redis stopped): {n} requests each, tiny model\n"
            f"p99 down / none {d.get('p99_down_over_none')}× (goal ≤ 1.1)\n{more[2:]}",
            fontsize=9,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


CODE: Path | None = None  # the copy of kvsnap/ every server of this run imports


def pin_code(workdir: Path, rev: str | None = None) -> dict:
    """Copy kvsnap/ as it is now (or as commit ``rev`` has it): every server of the run imports
    that copy (PYTHONPATH), so edits others make to the shared working tree meanwhile (or have
    not committed) do not reach the run."""
    global CODE
    CODE = workdir / "code"
    shutil.rmtree(CODE, ignore_errors=True)

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout

    if rev is not None:
        CODE.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "archive", rev, "kvsnap"], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(CODE)], input=archive.stdout, check=True)
        return {"head": git("rev-parse", rev).strip(), "exported_commit": True}
    shutil.copytree(ROOT / "kvsnap", CODE / "kvsnap", ignore=shutil.ignore_patterns("__pycache__"))
    return {
        "head": git("rev-parse", "HEAD").strip(),
        "kvsnap_changed_from_head": git("status", "--porcelain", "--", "kvsnap").splitlines(),
        "copied_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def kvsnap_env(work: Path) -> dict:
    pinned = {"PYTHONPATH": str(CODE)} if CODE is not None else {}
    return {
        **os.environ,
        **pinned,
        "KVSNAP_CACHE_DIR": str(work / "kvsnap-cache"),
        "KVSNAP_SHARED_TIER_SECRET": FLEET_SECRET,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


FLEET_SECRET = secrets.token_hex(32)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "fleet")
    p.add_argument("--workdir", type=Path, default=ROOT / ".kvsnap-bench" / "fleet")
    p.add_argument("--size", default="qwen3-0.6b", help="demo size of the failover model")
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens at turn k")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated at turn k")
    p.add_argument("--reps", type=int, default=2, help="(a) and (b) measures each")
    p.add_argument(
        "--disk-hit",
        action="store_true",
        help="also (a'): a replica started on a copy of A's store, no tier (a restart)",
    )
    p.add_argument("--cache-memory-mb", type=int, help="every replica's (default: serve's)")
    p.add_argument(
        "--fetch-budget",
        type=float,
        default=120.0,
        help="--shared-tier-budget of A and B (the default, 10 s, is probed separately)",
    )
    p.add_argument("--no-probe-default-budget", dest="probe_default_budget", action="store_false")
    p.add_argument("--skip-prefill", action="store_true", help="no (c): it is a full prefill")
    p.add_argument(
        "--cold-b",
        action="store_true",
        help="(b) right after B's /health, without its warm-up request (its weights still "
        "being read)",
    )
    p.add_argument(
        "--kill-a",
        action="store_true",
        help="(a) runs first, then A is killed -9 before every (b), as in a failover: B's fetch "
        "does not share the machine's memory with a live A (a 24 GiB box holds A, B and Redis)",
    )
    p.add_argument("--down-size", default="tiny", help="demo size of the tier-down model")
    p.add_argument("--conversations", type=int, default=60, help="tier down: 2 turns each")
    p.add_argument(
        "--down-key",
        default="tier_down",
        help="the JSON key of the tier-down results (another keeps a repeat beside the goal's)",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="tier down: a third server F, E's twin (no tier), in the same interleave: how far "
        "two equal servers' p99 differ on this machine",
    )
    p.add_argument("--only", default="failover,down", help="parts to run: failover,down")
    p.add_argument("--plot-only", action="store_true", help="redraw from OUT/fleet.json")
    p.add_argument(
        "--code-at",
        metavar="REV",
        help="the servers import kvsnap/ as commit REV has it (git archive), not the working "
        "tree's (which others may be editing)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="py-spy (50 Hz, idle samples too) on A and B over each turn k+1: "
        "WORKDIR/failover/profile-*.txt, raw stacks per thread",
    )
    args = p.parse_args()
    args.out, args.workdir = args.out.resolve(), args.workdir.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    raw, png = args.out / "fleet.json", args.out / "fleet-failover.png"
    if args.plot_only:
        plot(json.loads(raw.read_text()), png)
        return 0
    out = json.loads(raw.read_text()) if raw.exists() else {}
    args.command = "python " + " ".join(sys.argv)
    parts = args.only.split(",")
    whole = {"failover", "down"} <= set(parts) and args.down_key == "tier_down"
    if whole or not out:  # a part run alone keeps the whole run's header
        out.update(
            command=args.command,
            started=time.strftime("%Y-%m-%d %H:%M:%S"),
            load_at_start=load(),
            cores=os.cpu_count(),
            openblas=find_openblas(),
        )

    def save() -> None:
        out["goals"] = goals(out)
        out["load_at_end" if whole else "load_now"] = load()
        raw.write_text(json.dumps(out, indent=1) + "\n")
        plot(out, png)

    args.code = pin_code(args.workdir, args.code_at)
    if "failover" in parts:
        failover(args, out, save)
    if "down" in parts:
        tier_down(args, out, save)
    if whole:
        out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print("goals:", json.dumps(out["goals"]))
    print(f"results: {raw}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
