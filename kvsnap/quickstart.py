"""`kvsnap quickstart`: the whole story on a demo model, with nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

EXAMPLE_AGENTS = [
    {
        "name": "reviewer",
        "messages": [
            {
                "role": "system",
                "content": (
                    "You are a meticulous code reviewer for a python and rust server. Always read the tests first, "
                    "then check every function and class for error handling, return values and file paths. "
                    "Explain each fix briefly, list the steps, and never answer without checking the data. "
                )
                * 4,
            }
        ],
    },
    {
        "name": "planner",
        "messages": [
            {"role": "system", "content": "You are a planner agent. Plan each task step by step, check the goal, list the tools you would call. " * 4},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hello, what are we planning today?"},
        ],
    },
]


def write_example_agents(path: Path) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(EXAMPLE_AGENTS, indent=2))
    return path


def run_quickstart(workdir: Path, print_fn=print) -> int:
    """Make the demo model, write example agents, build and verify their snapshots."""
    from .blas import preload_openblas

    preload_openblas()
    from .build import build_snapshots
    from .demo import DemoSpec, make_demo_model
    from .key import DigestCache
    from .modeling import load_model
    from .prompts import load_warm_prompts
    from .store import Store

    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = make_demo_model(workdir / "model", DemoSpec())
    agents = write_example_agents(workdir / "agents.json")
    print_fn(f"[1/3] demo model: {model_dir}")
    print_fn(f"      agents file: {agents}")
    lm = load_model(model_dir)
    store = Store.open(workdir / "snaps", create=True)
    report = build_snapshots(lm, load_warm_prompts(agents), store, str(agents), digests=DigestCache(workdir / "digests.json"))
    for e in report.entries:
        print_fn(f"[2/3] {e.name}: {e.status}, {e.n_tokens} tokens ({e.coverage:.0%} of the entry), {e.nbytes} bytes, {e.seconds:.2f}s")
    bad = 0
    identity = lm.identity(DigestCache(workdir / "digests.json"))
    for path in store.snapshot_files():
        store.verify_file(path, identity)
    print_fn(f"[3/3] verified {len(store.snapshot_files())} snapshot(s) in {store.root}")
    return 0 if report.ok and not bad else 1
