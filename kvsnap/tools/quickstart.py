"""`kvsnap quickstart`: the whole story on a demo model, with nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from kvsnap.errors import KvsnapError

EXAMPLE_AGENTS = [
    {
        "name": "reviewer",
        "messages": [
            {
                "role": "system",
                "content": (
                    "You are a meticulous code reviewer for a python and rust server. Always read "
                    "the tests first, "
                    "then check every function and class for error handling, return values and "
                    "file paths. "
                    "Explain each fix briefly, list the steps, and never answer without checking "
                    "the data. "
                )
                * 4,
            }
        ],
    },
    {
        "name": "planner",
        "messages": [
            {
                "role": "system",
                "content": "You are a planner agent. Plan each task step by step, check the goal, "
                "list the tools you would call. " * 4,
            },
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hello, what are we planning today?"},
        ],
    },
]


def size_words(store, entry) -> str:
    """Both sizes, named: the entry's whole state on disk (record, blocks, checkpoints) and what
    this build wrote (0 when it was reused; less than the state when blocks were shared)."""
    try:
        state = store.inspect(store.path_for(entry.key)).nbytes
    except (KvsnapError, ValueError):
        return f"{entry.bytes_written} bytes written"
    return f"{state} bytes of state, {entry.bytes_written} bytes written"


def write_example_agents(path: Path) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(EXAMPLE_AGENTS, indent=2))
    return path


COLD_AGENT = [
    {
        "role": "system",
        "content": "You are a translator agent. Translate each message, check the words, explain "
        "hard ones. " * 5,
    }
]


# what the run measured, as data (tests and scripts read this, not the printed lines)
RECORD = "quickstart.json"


def run_quickstart(workdir: Path, print_fn=print, port: int = 0) -> int:
    """Demo model -> example agents -> build + verify -> serve (on ``port``, 0: a free one)
    -> a cold and a warm request."""
    from kvsnap.blas import preload_openblas

    preload_openblas()
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, agents, store, built = build_and_verify(workdir, print_fn)
    record = serve_and_ask(workdir, model_dir, agents, store, print_fn, port)
    record["build"] = [
        {"name": e.name, "status": e.status, "n_tokens": e.n_tokens} for e in built.entries
    ]
    record["ok"] = built.ok and record["warm"]["cached_tokens"] > 0
    (workdir / RECORD).write_text(json.dumps(record, indent=1))
    print_fn(
        "done: the server was stopped. Next: `kvsnap serve` your own model with --kv-snapshots "
        "(docs/server.md)."
    )
    return 0 if record["ok"] else 1


def build_and_verify(workdir: Path, print_fn):
    """Steps 1-2: the demo model and agents file (kept if present), the snapshots built and
    verified."""
    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.key import DigestCache
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.store.local import Store
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    model_dir = make_demo_model(workdir / "model", DemoSpec())
    agents = write_example_agents(workdir / "agents.json")
    print_fn(f"[1/4] demo model {model_dir}; agents file {agents}")
    digests = DigestCache(workdir / "file-digests.json")
    lm = load_model(model_dir)
    store = Store.open(workdir / "snaps", create=True)
    report = build_snapshots(lm, load_warm_prompts(agents), store, str(agents), digests=digests)
    for e in report.entries:
        print_fn(
            f"[2/4] build {e.name}: {e.status}, {e.n_tokens} tokens ({e.coverage:.0%} of the "
            f"entry), {size_words(store, e)}, {e.seconds:.2f}s"
        )
    identity = lm.identity(digests)
    for path in store.snapshot_files():
        store.verify_file(path, identity)
    print_fn(f"      verified {len(store.snapshot_files())} snapshot(s) in {store.root}")
    return model_dir, agents, store, report


def serve_and_ask(
    workdir: Path, model_dir: Path, agents: Path, store, print_fn, port: int = 0
) -> dict:
    """Steps 3-4: a server warm from the store, its warm-up report (from /v1/status), a cold and a
    warm request."""
    import httpx

    from kvsnap.runtime.warmup.report import WarmupReport, warmup_line
    from kvsnap.tools.client import stream_chat
    from kvsnap.tools.serverproc import start_server

    server = start_server(
        model_dir,
        ["--continuous-batching", "--warm-prompts", str(agents), "--kv-snapshots", str(store.root)],
        workdir / "server.log",
        port=port or None,
        env={"KVSNAP_CACHE_DIR": str(workdir)},
        limit_s=300,
    )
    try:
        ready = server.wait_ready(timeout=120)
        warmup = server.status()["warmup"]
        print_fn(f"[3/4] server warm {ready:.2f}s after launch at {server.url}")
        print_fn("      " + warmup_line(WarmupReport(**warmup)))
        agents_data = json.loads(agents.read_text())
        question = {
            "role": "user",
            "content": "Please check the server function and explain the fix.",
        }
        with httpx.Client(timeout=120) as client:
            cold = stream_chat(client, server.url, "model", COLD_AGENT + [question], max_tokens=16)
            warm = stream_chat(
                client, server.url, "model", agents_data[0]["messages"] + [question], max_tokens=16
            )
    finally:
        server.stop()
    print_fn(
        f"[4/4] cold request (agent not in agents.json): TTFT {cold.ttft_s * 1000:.1f} ms, "
        f"cached_tokens {cold.cached_tokens} of {cold.usage.get('prompt_tokens')}"
    )
    print_fn(
        f"      warm request (agent '{agents_data[0]['name']}'):        TTFT "
        f"{warm.ttft_s * 1000:.1f} ms, cached_tokens {warm.cached_tokens} of "
        f"{warm.usage.get('prompt_tokens')}"
    )
    requests = {
        name: {
            "ttft_ms": round(r.ttft_s * 1000, 3),
            "cached_tokens": r.cached_tokens,
            "prompt_tokens": r.usage.get("prompt_tokens"),
        }
        for name, r in (("cold", cold), ("warm", warm))
    }
    return {"url": server.url, "ready_s": round(ready, 3), "warmup": warmup, **requests}
