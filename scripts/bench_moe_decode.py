#!/usr/bin/env python
"""Why a MoE decodes slower per sequence in a batch: one decode step of B sequences
at once against B single-sequence steps, for the whole model and for its MoE blocks alone.

    python scripts/bench_moe_decode.py --model /tmp/table/run2/models/qwen3.6-35b-a3b-4bit
    python scripts/bench_moe_decode.py --model DIR --dense DIR2   # the same for a dense model,
    side by side

A batched step shares every dense weight read across the batch; a MoE layer's experts are
only shared when the sequences pick the same ones (top-k of E per token), so a batch reads up
to B·k expert matrices per layer instead of k. Prints per-sequence tokens/s at B = 1, 4, 8
(medians of --reps steps over a --context-token cache) and the fraction of a step spent in
the MoE blocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsnap.blas import preload_openblas  # noqa: E402

preload_openblas()

import mlx.core as mx  # noqa: E402


def step_times(model, batch: int, context: int, reps: int) -> list[float]:
    """Seconds per decode step for ``batch`` sequences after a ``context``-token prefill."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.array(
        [[(7 * i + b) % 200 + 10 for i in range(context)] for b in range(batch)], dtype=mx.int32
    )
    mx.eval(model(prompt, cache=cache))
    token = mx.array([[5] for _ in range(batch)], dtype=mx.int32)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        logits = model(token, cache=cache)
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
        token = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.int32)
    return times[1:]  # the first includes one-off kernel work


def moe_blocks(model) -> list:
    """The sparse MoE modules of a model (mlx-lm names them ``mlp`` with a ``switch_mlp``
    inside)."""
    found = []
    for _, module in model.named_modules():
        if hasattr(module, "switch_mlp"):
            found.append(module)
    return found


def moe_share(model, batch: int, reps: int) -> float:
    """Seconds of the MoE blocks alone for one decode step of ``batch`` tokens (all layers)."""
    blocks = moe_blocks(model)
    if not blocks:
        return 0.0
    hidden = (
        model.args.hidden_size
        if hasattr(model.args, "hidden_size")
        else model.args.text_config["hidden_size"]
    )
    x = mx.random.normal((batch, 1, hidden))
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        mx.eval([b(x) for b in blocks])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure(path: Path, context: int, reps: int) -> dict:
    from mlx_lm import load

    model, _ = load(str(path))
    out = {"model": str(path), "moe_layers": len(moe_blocks(model))}
    for batch in (1, 4, 8):
        step = statistics.median(step_times(model, batch, context, reps))
        moe = moe_share(model, batch, reps)
        out[batch] = {
            "step_s": step,
            "seq_tokens_per_s": 1 / step,
            "batch_tokens_per_s": batch / step,
            "moe_s": moe,
            "moe_fraction": moe / step if step else 0.0,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--dense", type=Path, help="a dense model to compare with")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    rows = [measure(args.model, args.context, args.reps)] + (
        [measure(args.dense, args.context, args.reps)] if args.dense else []
    )
    print(
        "| model | MoE layers | batch | step | tokens/s per sequence | × batch 1 | batch tokens/s "
        "| MoE share of a step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = r[1]["seq_tokens_per_s"]
        for b in (1, 4, 8):
            x = r[b]
            print(
                f"| {Path(r['model']).name} | {r['moe_layers']} | {b} | {x['step_s'] * 1000:.1f} "
                f"ms | {x['seq_tokens_per_s']:.1f} | {x['seq_tokens_per_s'] / base:.2f}× | "
                f"{x['batch_tokens_per_s']:.1f} | {x['moe_fraction']:.0%} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
