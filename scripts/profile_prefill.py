#!/usr/bin/env python
"""Where a prefill's time goes on mlx's CPU backend, against the matmul rate at the model's shapes
(docs/benchmarks.md, "Long prompts").

    python scripts/profile_prefill.py --model DIR --tokens 1024 --steps 256,512,1024,2048 --reps 3

For each step size, interleaved, medians of --reps:

- ``prefill``: the model over the prompt in step-size chunks with mlx-lm's own ``KVCache`` (grown
  256 tokens at a time), each chunk's cache evaluated, as ``kvsnap build`` and the server do;
- ``prefill, cache allocated once``: the same with every layer's cache sized for the prompt;
- at one step size (--ablate-step, default 512), ablations of that run, each one piece of
  the layer replaced by a cheaper stand-in of the same shape (attention by its queries, rope,
  the four RMSNorms and swiglu by identities): what the piece costs inside the real graph;
- ``matmuls``: the layers' seven projections alone, chained as in the model (one evaluation per
  layer), on the same token counts: the matmul rate at the model's shapes;
- ``attention``: mlx's scaled_dot_product_attention alone on every chunk's shapes (causal).

The rate ratio is matmul time / prefill time: 1.0 means the prefill costs only its projections.
Writes --json when given. The model must be a qwen3 one: the ablations patch its layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: a checkout wins

from kvsnap.blas import preload_openblas  # noqa: E402

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402


class Identity:
    """A stand-in for a norm or a rope: returns its input (offset accepted and ignored)."""

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def layer_shapes(args: Any) -> list[tuple[int, int]]:
    """(in, out) of the seven projections of one layer: q, k, v, o, gate, up, down."""
    d, hd = args.hidden_size, args.head_dim
    q, kv, i = args.num_attention_heads * hd, args.num_key_value_heads * hd, args.intermediate_size
    return [(d, q), (d, kv), (d, kv), (q, d), (d, i), (d, i), (i, d)]


def chunks(n_tokens: int, step: int) -> list[tuple[int, int]]:
    return [(s, min(s + step, n_tokens)) for s in range(0, n_tokens, step)]


def prefill_time(model: Any, tokens: list[int], step: int, allocate_once: bool) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if allocate_once:
        for c in cache:
            c.step = len(tokens)  # the first update allocates room for the whole prompt
    t0 = time.perf_counter()
    for lo, hi in chunks(len(tokens), step):
        model(mx.array(tokens[lo:hi], dtype=mx.int32)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def matmul_time(weights: list[list[Any]], hidden: int, n_tokens: int, step: int) -> float:
    """The projections alone, chained per layer as the model chains them."""
    t0 = time.perf_counter()
    for lo, hi in chunks(n_tokens, step):
        h = mx.ones((1, hi - lo, hidden)) * 0.01
        for wq, wk, wv, wo, wg, wu, wd in weights:
            q, k, v = h @ wq.T, h @ wk.T, h @ wv.T
            a = q @ wo.T
            g, u = a @ wg.T, a @ wu.T
            h = g @ wd.T
            mx.eval(h, k, v, u)
    return time.perf_counter() - t0


def attention_time(args: Any, n_tokens: int, step: int) -> float:
    """mlx's fused attention alone, every layer, every chunk, causal, as the model calls it."""
    hd, n_layers = args.head_dim, args.num_hidden_layers
    total = 0.0
    for lo, hi in chunks(n_tokens, step):
        q = mx.ones((1, args.num_attention_heads, hi - lo, hd)) * 0.01
        kv = mx.ones((1, args.num_key_value_heads, hi, hd)) * 0.01
        mx.eval(q, kv)
        t0 = time.perf_counter()
        for _ in range(n_layers):
            out = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=hd**-0.5, mask="causal")
            mx.eval(out)
        total += time.perf_counter() - t0
    return total


@contextmanager
def ablated(model: Any, what: str) -> Iterator[None]:
    """The model with one piece replaced by a same-shaped stand-in, restored on exit."""
    import mlx_lm.models.qwen3 as qwen3

    saved: list[tuple[Any, str, Any]] = []

    def swap(obj: Any, name: str, new: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    layers = model.model.layers
    if what == "attention":
        swap(qwen3, "scaled_dot_product_attention", lambda q, k, v, **kw: q + k[:, :1, :1] * 0)
    elif what == "rope":
        for layer in layers:
            swap(layer.self_attn, "rope", Identity())
    elif what == "norms":
        for layer in layers:
            for obj, name in (
                (layer.self_attn, "q_norm"),
                (layer.self_attn, "k_norm"),
                (layer, "input_layernorm"),
                (layer, "post_attention_layernorm"),
            ):
                swap(obj, name, Identity())
    elif what == "swiglu":
        swap(qwen3, "swiglu", lambda g, u: g + u)
    elif what != "none":
        raise ValueError(f"unknown ablation {what!r}")
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


ABLATIONS = ("attention", "rope", "norms", "swiglu")


def measured(fn: Callable[[], float]) -> tuple[float, float]:
    """``fn``'s own wall time and the process CPU time around it: on a busy machine the CPU
    time still counts the work done."""
    c0 = time.process_time()
    wall = fn()
    return wall, time.process_time() - c0


def one_round(
    model: Any, weights: list, tokens: list[int], step: int, ablations: tuple[str, ...]
) -> dict[str, tuple[float, float]]:
    """Each variant once at ``step``: name -> (wall, CPU) seconds."""
    n, hidden = len(tokens), model.args.hidden_size
    out = {
        "prefill": measured(lambda: prefill_time(model, tokens, step, False)),
        "prefill, cache allocated once": measured(lambda: prefill_time(model, tokens, step, True)),
    }
    for what in ablations:
        with ablated(model, what):
            out[f"without {what}"] = measured(lambda: prefill_time(model, tokens, step, True))
    out["matmuls"] = measured(lambda: matmul_time(weights, hidden, n, step))
    out["attention"] = measured(lambda: attention_time(model.args, n, step))
    return out


def profile(
    model_dir: Path,
    n_tokens: int,
    steps: list[int],
    reps: int,
    ablate_step: int | None = None,
    log: Callable = print,
) -> dict:
    """Every variant at every step size; the ablations at ``ablate_step`` only (default: the
    shared 512, else the smallest step)."""
    from mlx_lm import load

    model = load(str(model_dir))[0]
    args = model.args
    if getattr(args, "model_type", "") != "qwen3":
        raise SystemExit(f"--model {model_dir}: profile_prefill ablates qwen3 layers only")
    # ids inside the vocabulary (an id past it reads outside the embedding: a crash on CPU)
    tokens = [(i * 7919) % min(args.vocab_size - 10, 2000) + 10 for i in range(n_tokens)]
    weights = [
        [
            layer.self_attn.q_proj.weight,
            layer.self_attn.k_proj.weight,
            layer.self_attn.v_proj.weight,
            layer.self_attn.o_proj.weight,
            layer.mlp.gate_proj.weight,
            layer.mlp.up_proj.weight,
            layer.mlp.down_proj.weight,
        ]
        for layer in model.model.layers
    ]
    flops = 2 * sum(i * o for i, o in layer_shapes(args)) * args.num_hidden_layers * n_tokens
    runs: dict[int, dict[str, list[float]]] = {s: {} for s in steps}
    cpu: dict[int, dict[str, list[float]]] = {s: {} for s in steps}
    if ablate_step is None:
        ablate_step = 512 if 512 in steps else min(steps)
    prefill_time(model, tokens[: min(steps)], min(steps), True)  # first-call kernel set-up
    for rep in range(reps):  # interleaved: a shared machine's drift hits every variant alike
        load_before = os.getloadavg()[0]
        for step in steps:
            ablations = ABLATIONS if step == ablate_step else ()
            for name, (wall, used) in one_round(model, weights, tokens, step, ablations).items():
                runs[step].setdefault(name, []).append(wall)
                cpu[step].setdefault(name, []).append(used)
            log(
                f"rep {rep} step {step}: "
                + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in runs[step].items())
                + f" (load {load_before:.1f})",
                flush=True,
            )
    out: dict[str, Any] = {
        "model": str(model_dir),
        "tokens": n_tokens,
        "projection_gflop": flops / 1e9,
        "openblas": BLAS,
        "reps": reps,
        "ablate_step": ablate_step,
        "loadavg_end": os.getloadavg(),
        "steps": {},
    }
    for step in steps:
        out["steps"][step] = {
            **ratios(runs[step], flops),
            "cpu": ratios(cpu[step], flops),
            "runs": runs[step],
            "cpu_runs": cpu[step],
        }
    return out


def ratios(got: dict[str, list[float]], flops: int) -> dict:
    """Medians, the matmul rate, the rate ratios and each piece's share of one step's runs."""
    med = {k: statistics.median(v) for k, v in got.items()}
    base = med["prefill, cache allocated once"]
    shares = {w: (base - med[f"without {w}"]) / base for w in ABLATIONS if f"without {w}" in med}
    return {
        "seconds": med,
        "matmul_gflops": flops / med["matmuls"] / 1e9,
        "rate_ratio": med["matmuls"] / med["prefill"],
        "rate_ratio_allocated_once": med["matmuls"] / base,
        "share_of_prefill": {
            **shares,
            "matmuls": med["matmuls"] / base,
            "attention alone": med["attention"] / base,
        },
    }


def print_summary(result: dict) -> None:
    print(f"{result['tokens']} tokens, {result['projection_gflop']:.0f} GFLOP of projections")
    for step, r in result["steps"].items():
        s = r["seconds"]
        shares = ", ".join(f"{k} {v:.0%}" for k, v in r["share_of_prefill"].items())
        print(
            f"step {step}: prefill {s['prefill']:.2f}s, allocated once "
            f"{s['prefill, cache allocated once']:.2f}s, matmuls {s['matmuls']:.2f}s "
            f"({r['matmul_gflops']:.0f} GFLOP/s): rate ratio {r['rate_ratio']:.2f} "
            f"({r['rate_ratio_allocated_once']:.2f} allocated once; in CPU time "
            f"{r['cpu']['rate_ratio']:.2f}); {shares}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True, help="a qwen3 model folder (fp32)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", default="256,512,1024,2048", help="prefill step sizes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ablate-step", type=int, help="the step size to ablate at (default 512)")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    steps = sorted({min(int(s), args.tokens) for s in args.steps.split(",")})
    result = profile(args.model, args.tokens, steps, args.reps, args.ablate_step)
    print_summary(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
