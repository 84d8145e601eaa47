#!/usr/bin/env python
"""Launch -> warm-ready for cold, ``--kv-snapshots`` alone and ``--kv-snapshots --warm-prompts``
on the same store, launches interleaved, medians (docs/benchmarks.md).

    python scripts/bench_kv_alone.py --size qwen3-0.6b --tokens 2176 --reps 5
    python scripts/bench_kv_alone.py ... --trees /path/after,/path/before   # each on PYTHONPATH

With ``--trees``, each kvsnap checkout serves both kv modes (cold runs from the first): a
before/after comparison within one interleaved run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsnap.blas import preload_openblas

preload_openblas()

from kvsnap.tools.bench_startup import build_store, system_prompt_of
from kvsnap.tools.demo import DemoSpec, make_demo_model
from kvsnap.tools.serverproc import start_server


def prepare(model: Path, workdir: Path, tokens: int, env: dict) -> tuple[Path, Path]:
    """One agent of ``tokens`` system-prompt tokens and its store, built once."""
    from transformers import AutoTokenizer

    agents, store = workdir / f"agents-{tokens}t.json", workdir / f"snaps-{tokens}t"
    if not store.exists():
        text = system_prompt_of(AutoTokenizer.from_pretrained(str(model)), tokens, salt="Agent 0.")
        agent = {"name": "agent-0", "messages": [{"role": "system", "content": text}]}
        agents.write_text(json.dumps([agent]))
        build_store(model, agents, store, env)
    return agents, store


def modes(trees: list[str], agents: Path, store: Path) -> list[tuple[str, str, list[str]]]:
    kv = ["--kv-snapshots", str(store), "--no-write-back"]
    out = [("cold", trees[0], [])]
    for tree in trees:
        tag = f"@{Path(tree).name}" if len(trees) > 1 else ""
        out.append((f"kv-alone{tag}", tree, kv))
        out.append((f"kv+warm-prompts{tag}", tree, [*kv, "--warm-prompts", str(agents)]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="qwen3-0.6b", choices=("tiny", "qwen3-0.6b"))
    ap.add_argument("--model", help="use this model directory instead of a demo model")
    ap.add_argument("--tokens", type=int, default=2176, help="system-prompt tokens, one agent")
    ap.add_argument("--reps", type=int, default=5, help="launches per mode (median reported)")
    ap.add_argument("--workdir", default=".kvsnap-bench", help="model, agents, store, logs")
    ap.add_argument("--trees", default="", help="kvsnap checkouts to compare (default: this one)")
    args = ap.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model).resolve()
    else:
        model = make_demo_model(workdir / f"demo-{args.size}", DemoSpec(size=args.size))
    env = {"KVSNAP_CACHE_DIR": str(workdir / "cache")}
    agents, store = prepare(model, workdir, args.tokens, env)
    here = str(Path(__file__).resolve().parents[1])
    trees = [str(Path(t).resolve()) for t in args.trees.split(",") if t] or [here]
    rows: dict[str, list[tuple[float, float]]] = {}
    for rep in range(args.reps):
        # interleaved: drift on a shared machine hits every mode alike
        for mode, tree, flags in modes(trees, agents, store):
            log = workdir / f"kv-alone-{mode.replace('@', '-')}-{rep}.log"
            flags = ["--continuous-batching", *flags]
            server = start_server(model, flags, log, env={**env, "PYTHONPATH": tree}, limit_s=900)
            try:
                ready = server.wait_ready(timeout=900)
                warmup = server.status()["warmup"] or {}
            finally:
                server.stop()
            rows.setdefault(mode, []).append((ready, float(warmup.get("seconds", 0.0))))
            warm = rows[mode][-1][1]
            print(f"rep {rep} {mode:<24} ready {ready:.2f}s warm-up {warm:.3f}s", flush=True)
    cold = statistics.median(r for r, _ in rows["cold"])
    for mode, got in rows.items():
        ready = statistics.median(r for r, _ in got)
        warm = statistics.median(w for _, w in got)
        each = [round(r, 2) for r, _ in got]
        over = f"{ready - cold:+.2f}s over cold"
        print(f"{mode:<24} ready {ready:.2f}s ({over}) warm-up {warm:.2f}s; {each}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
