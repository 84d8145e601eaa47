"""Cold TTFT of N concurrent requests sharing one system prompt: shared prefix computed once vs per
request.

In process (no HTTP), one engine, the cache cleared before every round so every round is
cold; rounds alternate between sharing on and off (the threshold set out of reach), and a
different user message goes into every request. Prints medians and the ratio.

    python scripts/bench_shared_prefix.py --concurrency 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from kvsnap.blas import preload_openblas

preload_openblas()

MID_SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)
SYSTEM = (
    "You are the house code reviewer. Read the tests first, then every function for error "
    "handling, "
    "return values, file paths and concurrency. Explain each fix, list the steps, quote the line. "
)


def make_model(root: Path) -> Path:
    from kvsnap.tools import demo, demo_families

    # a benchmark-only shape: hidden 512, 8 layers
    demo_families._SHAPES[("dense", "mid")] = MID_SHAPE
    demo_families.SIZES = tuple(dict.fromkeys((*demo_families.SIZES, "mid")))
    return demo.make_demo_model(root / "mid", demo.DemoSpec(arch="dense", size="mid"))


def run_round(engine, token_lists) -> list[float]:
    from kvsnap.runtime.engine.engine import GenerationRequest

    states = []
    engine.call(lambda: engine.prefix.clear())

    def submit_all():
        for tokens in token_lists:
            states.append(
                engine.submit(GenerationRequest(tokens=tokens, max_tokens=4), lambda *a: None)
            )

    engine.call(submit_all)
    for s in states:
        s.done.wait(600)
    return [s.t_first_token - s.t_submit for s in states]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1700)
    args = ap.parse_args(argv)

    import kvsnap.runtime.engine.request_cache as engine_mod  # owns MIN_SHARED_TOKENS_TO_COMPUTE
    from kvsnap.chat import request_tokens
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        engine = Engine(EngineConfig(model=str(model), continuous_batching=True, max_batch_size=8))
        engine.start()
        engine.wait_warm(300)
        tok = engine.lm.tokenizer
        system = SYSTEM
        while (
            len(request_tokens(tok, [{"role": "system", "content": system}])) < args.system_tokens
        ):
            system += SYSTEM
        results = {"shared": [], "per-request": []}
        n = 0
        for r in range(args.rounds):
            for mode in ("shared", "per-request"):
                engine_mod.MIN_SHARED_TOKENS_TO_COMPUTE = 32 if mode == "shared" else 10**9
                users = [
                    f"Question {n + i}: review module number {n + i} and report."
                    for i in range(args.concurrency)
                ]
                n += args.concurrency
                lists = [
                    request_tokens(
                        tok, [{"role": "system", "content": system}, {"role": "user", "content": u}]
                    )
                    for u in users
                ]
                before = engine.status()["tokens"]["computed"]
                ttfts = run_round(engine, lists)
                computed = engine.status()["tokens"]["computed"] - before
                results[mode].append(statistics.median(ttfts))
                print(
                    f"round {r} {mode:12s} TTFT p50 {statistics.median(ttfts):6.2f}s max "
                    f"{max(ttfts):6.2f}s computed {computed} tokens "
                    f"(prompt {sum(map(len, lists))})",
                    flush=True,
                )
        engine.shutdown()
    shared, per = statistics.median(results["shared"]), statistics.median(results["per-request"])
    print(
        f"\nconcurrency {args.concurrency}, system prompt ~{args.system_tokens} tokens, hidden 512 "
        f"x 8 layers fp32"
    )
    print(
        f"median TTFT p50: shared {shared:.2f}s, per-request {per:.2f}s, ratio {per / shared:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
