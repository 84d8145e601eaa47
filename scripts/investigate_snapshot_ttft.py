"""Why was a --kv-snapshots server slower than a --warm-prompts one on the same cached prefix?

Issue 14 saw TTFT p50 3.5 s (warm-prompts) vs 4.8 s (snapshots), 2,663 cached tokens in
both, one repetition each, over HTTP. This reproduces the cell in process, without HTTP:
one demo qwen3 (hidden 512, 8 layers, fp32), a ~2,660-token system prompt, two engines in
this process, one with the warm prompt prefilled at start and one with it restored from a
snapshot built by ``kvsnap.build.pipeline.build_snapshots``. Requests (system prompt + a distinct
user message) alternate between the engines; request prefixes are dropped before each so
every timed request hits only the warm entry (checked: cached_tokens == warm length).

Then micro-benchmarks of the suspects on the two warm entries' states: the arrays' layout
(views of one uint8 buffer vs padded prefill buffers), the first append, lazy evaluation,
copy_cache, and a bare forward over a private copy. And the first requests of a fresh
process per mode (what a fresh server per cell measures), with mlx's CPU JIT kernel
cache warm or empty, with and without the proposed fix (kernels primed at the end of the
warm-up, applied by monkeypatching; kvsnap/ is not edited).

    python scripts/investigate_snapshot_ttft.py --work /tmp/w --reps 9 --user short,medium   #
    steady-state A/B
    python scripts/investigate_snapshot_ttft.py --work /tmp/w --micro --reps 9                #
    suspects (a)-(d)
    python scripts/investigate_snapshot_ttft.py --work /tmp/w --first --reps 5 --user
    medium,medium,short [--jit-cold] [--prime entry|fresh]

Finding (2 shared cores, load 5-8): in steady state and on a warm JIT cache the two modes
are equal within noise; the restored state is not slower (a-d). The first request of a
server that restored everything pays mlx's CPU JIT compile of the mx.compile'd swiglu
(g++, 1-3 s here) that a warm-prompts server pays in its start-up prefill, whenever
$TMPDIR/mlx/<version>/cpu does not hold it yet (a fresh machine or container).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
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
LONG_BODY = (
    "Here is the context. The function reads a request, checks the headers, parses the body, calls "
    "the "
    "store, retries on a timeout and writes a response. Tests cover the happy path only. "
)
WORDS = [
    "apple",
    "river",
    "orange",
    "zebra",
    "violet",
    "mango",
    "copper",
    "lemon",
    "tiger",
    "quartz",
    "nickel",
    "walnut",
    "falcon",
    "cedar",
    "ember",
    "harbor",
]


def make_model(root: Path) -> Path:
    from kvsnap.tools import demo, demo_families

    # a benchmark-only shape: hidden 512, 8 layers (demo_families.py untouched)
    demo_families._SHAPES[("dense", "mid")] = MID_SHAPE
    demo_families.SIZES = tuple(dict.fromkeys((*demo_families.SIZES, "mid")))
    return demo.make_demo_model(root / "mid", demo.DemoSpec(arch="dense", size="mid"))


def system_prompt(tokenizer, target: int) -> str:
    from kvsnap.chat import request_tokens

    text = SYSTEM
    while len(request_tokens(tokenizer, [{"role": "system", "content": text}])) < target:
        text += SYSTEM
    return text


def user_message(n: int, kind: str) -> str:
    # A different first word every time: no request shares more than the warm prefix with another.
    head = f"{WORDS[n % len(WORDS)]}{n} question: "
    if kind == "short":
        return (
            head
            + "review module number %d, list the three most important fixes and explain each one "
            "briefly with care." % n
        )
    reps = {"medium": 4, "long": 32}[kind]  # bench-serve's built-in medium and long prompts
    return (
        head
        + "Review the server's request handler. "
        + LONG_BODY * reps
        + "List the three most important fixes."
    )


def build_store(model: Path, agents: Path, store_dir: Path) -> None:
    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.store.local import Store

    lm = load_model(str(model))
    t0 = time.perf_counter()
    report = build_snapshots(
        lm, load_warm_prompts(agents), Store.open(store_dir, create=True), str(agents)
    )
    print(
        f"build: {[(e.name, e.status, e.n_tokens) for e in report.entries]} in "
        f"{time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    assert report.ok, report


def start_engine(model: Path, agents: Path, store_dir: Path | None):
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    cfg = EngineConfig(
        model=str(model),
        warm_prompts=load_warm_prompts(agents),
        warm_prompts_file=str(agents),
        snapshots=str(store_dir) if store_dir else None,
        write_back=False,
    )
    engine = Engine(cfg)
    t0 = time.perf_counter()
    engine.start()
    engine.wait_warm(900)
    entries = engine.call(
        lambda: [(e.source, len(e.tokens), e.loaded) for e in engine.prefix.entries]
    )
    print(
        f"engine {'snapshots' if store_dir else 'warm-prompts'}: warm in "
        f"{time.perf_counter() - t0:.1f}s, entries {entries}",
        flush=True,
    )
    return engine


def timed_request(engine, tokens: list[int], max_tokens: int, warm_len: int) -> dict:
    from kvsnap.runtime.engine.engine import GenerationRequest

    engine.call(lambda: engine.prefix.drop_request_prefixes())
    state = engine.submit(GenerationRequest(tokens=tokens, max_tokens=max_tokens), lambda *a: None)
    state.done.wait(900)
    assert state.finish_reason in ("length", "stop"), state.finish_reason
    assert state.cached_tokens == warm_len, (
        f"cached {state.cached_tokens} != warm prefix {warm_len} (source {state.cache_source})"
    )
    return {
        "ttft": state.t_first_token - state.t_submit,
        "e2e": state.t_done - state.t_submit,
        "source": state.cache_source,
        "cached": state.cached_tokens,
        "text": state.text,
    }


def engine_ab(
    engines: dict,
    tokenizer,
    system: str,
    warm_len: int,
    kinds: list[str],
    reps: int,
    max_tokens_list: list[int],
    label: str,
) -> dict:
    """Interleaved A/B: for every rep, kind and max_tokens, both engines get a fresh user message,
    in alternating order."""
    from kvsnap.chat import request_tokens

    results: dict = {}
    n = 0
    for rep in range(reps):
        for kind in kinds:
            for max_tokens in max_tokens_list:
                order = list(engines) if rep % 2 == 0 else list(reversed(engines))
                for mode in order:
                    n += 1
                    tokens = request_tokens(
                        tokenizer,
                        [
                            {"role": "system", "content": system},
                            {"role": "user", "content": user_message(n, kind)},
                        ],
                    )
                    r = timed_request(engines[mode], tokens, max_tokens, warm_len)
                    results.setdefault((kind, max_tokens, mode), []).append(r)
                    print(
                        f"[{label}] rep {rep} {kind:5s} max_tokens {max_tokens:2d} {mode:12s} "
                        f"prompt {len(tokens)} cached {r['cached']} ({r['source']}) TTFT "
                        f"{r['ttft']:.3f}s e2e {r['e2e']:.3f}s",
                        flush=True,
                    )
    print(f"\n[{label}] medians over {reps} reps (interleaved)")
    for kind in kinds:
        for max_tokens in max_tokens_list:
            row = {
                m: statistics.median(r["ttft"] for r in results[(kind, max_tokens, m)])
                for m in engines
            }
            e2e = {
                m: statistics.median(r["e2e"] for r in results[(kind, max_tokens, m)])
                for m in engines
            }
            print(
                f"[{label}] {kind:5s} max_tokens {max_tokens:2d}: TTFT warm {row['warm']:.3f}s "
                f"snapshots {row['snapshots']:.3f}s ratio {row['snapshots'] / row['warm']:.2f}x | "
                f"e2e warm {e2e['warm']:.3f}s snapshots {e2e['snapshots']:.3f}s",
                flush=True,
            )
    return results


def _timeit(fn, reps: int) -> float:
    """Median wall time of ``fn`` (which must mx.eval what it builds) over ``reps`` runs."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def describe(state) -> str:
    k = state[0].keys
    return (
        f"keys shape {tuple(k.shape)} offset {state[0].offset} contiguous-rows "
        f"{k.shape[2] == state[0].offset}"
    )


def micro(model: Path, agents: Path, store_dir: Path, system: str, reps: int) -> None:
    """Each suspect on the two warm states, alternating A/B inside every measurement."""
    import mlx.core as mx
    from mlx_lm.generate import _merge_caches

    from kvsnap.chat import request_tokens
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.runtime.prefill.chunked import prefill
    from kvsnap.snapshot.codec import cache_arrays, copy_cache
    from kvsnap.store.local import Store

    lm = load_model(str(model))
    tok = lm.tokenizer
    store = Store.open(store_dir)
    (info,) = store.scan()[0]
    warm_tokens = tuple(store.read_tokens(info))
    t0 = time.perf_counter()
    prefilled = prefill(lm, warm_tokens)
    t_prefill = time.perf_counter() - t0
    from kvsnap.snapshot.codec import decode_cache

    t0 = time.perf_counter()
    restored = decode_cache(store.load_arrays(info), info.layers)
    t_restore = time.perf_counter() - t0
    print(
        f"\n[micro] warm prefix {len(warm_tokens)} tokens: prefill {t_prefill:.2f}s, restore "
        f"{t_restore:.3f}s"
    )
    print(f"[micro] prefilled: {describe(prefilled)}; restored: {describe(restored)}")
    states = {"warm": prefilled, "snapshots": restored}

    # (c) lazy evaluation: is anything in the restored state still unevaluated?
    for mode, st in states.items():
        t0 = time.perf_counter()
        mx.eval([a for c in st for a in cache_arrays(c)])
        print(
            f"[micro] (c) mx.eval of the {mode} entry's arrays again: "
            f"{1000 * (time.perf_counter() - t0):.2f} ms"
        )

    suffixes = {}
    for kind in ("short", "medium"):
        full = request_tokens(
            tok,
            [
                {"role": "system", "content": system},
                {"role": "user", "content": user_message(999, kind)},
            ],
        )
        assert tuple(full[: len(warm_tokens)]) == warm_tokens
        suffixes[kind] = full[len(warm_tokens) :]

    def copy_eval(st):
        own = copy_cache(st)
        mx.eval([a for c in own for a in cache_arrays(c)])

    def forward_kv(st, suffix, step=512):
        # The sequential path: mlx-lm's KVCache on a private copy, chunks of prefill_step_size.
        own = copy_cache(st)
        body, last = suffix[:-1], suffix[-1:]
        for i in range(0, len(body), step):
            lm.model(mx.array(body[i : i + step])[None], cache=own)
            mx.eval([c.state for c in own])
        mx.eval(lm.model(mx.array(last)[None], cache=own))

    def forward_batch(st, suffix, step=512):
        # The batched path the engine takes: copy -> BatchKVCache.merge -> prompt chunks -> last
        # token.
        own = _merge_caches([copy_cache(st)])
        body, last = suffix[:-1], suffix[-1:]
        for i in range(0, len(body), step):
            lm.model(mx.array(body[i : i + step])[None], cache=own)
            mx.eval([c.state for c in own])
        mx.eval(lm.model(mx.array(last)[None], cache=own))

    def first_append(st):
        # (b) one token appended to a private copy: KVCache reallocates when the buffer is full.
        own = copy_cache(st)
        k = mx.zeros((1, own[0].keys.shape[1], 1, own[0].keys.shape[3]), dtype=own[0].keys.dtype)
        for c in own:
            c.update_and_fetch(k, k)
        mx.eval([a for c in own for a in cache_arrays(c)])

    def attention(st):
        # (a) attention of 44 queries over the entry's own arrays, per layer, no copy.
        c0 = st[0]
        q = mx.random.normal((1, 8, 44, c0.keys.shape[3]), key=mx.random.key(0))
        outs = []
        for c in st:
            k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125))
        mx.eval(outs)

    # (a) per layer: the same attention, one layer per mx.eval, modes alternating.
    q = mx.random.normal((1, 8, 44, restored[0].keys.shape[3]), key=mx.random.key(0))
    mx.eval(q)
    per_layer = {m: [[] for _ in states[m]] for m in states}
    for i in range(reps):
        for mode in list(states) if i % 2 == 0 else list(reversed(states)):
            for j, c in enumerate(states[mode]):
                k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
                t0 = time.perf_counter()
                mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125))
                per_layer[mode][j].append(time.perf_counter() - t0)
    for j in range(len(restored)):
        w, r = (statistics.median(per_layer[m][j]) for m in ("warm", "snapshots"))
        print(
            f"[micro] (a) layer {j} attention (44 queries x {restored[j].offset} keys): warm "
            f"{1000 * w:7.2f} ms  snapshots {1000 * r:7.2f} ms  ratio {r / w:.2f}x"
        )

    cases = [
        ("(a) attention over entry arrays", attention),
        ("(d) copy_cache + eval", copy_eval),
        ("(b) first 1-token append on a copy", first_append),
    ]
    for kind in ("short", "medium"):
        cases.append(
            (
                f"forward {kind} suffix ({len(suffixes[kind])} tok), KVCache path",
                lambda st, s=suffixes[kind]: forward_kv(st, s),
            )
        )
        cases.append(
            (
                f"forward {kind} suffix ({len(suffixes[kind])} tok), batch path",
                lambda st, s=suffixes[kind]: forward_batch(st, s),
            )
        )
    for name, fn in cases:
        r = reps
        times = {m: [] for m in states}
        for i in range(r):
            for mode in list(states) if i % 2 == 0 else list(reversed(states)):
                times[mode].append(_timeit(functools.partial(fn, states[mode]), 1))
        med = {m: statistics.median(v) for m, v in times.items()}
        low = {m: min(v) for m, v in times.items()}
        print(
            f"[micro] {name:55s} median warm {1000 * med['warm']:9.2f} ms  snapshots "
            f"{1000 * med['snapshots']:9.2f} ms  ratio {med['snapshots'] / med['warm']:.2f}x | min "
            f"ratio {low['snapshots'] / low['warm']:.2f}x",
            flush=True,
        )


def prime_kernels(engine, from_entry: bool = True) -> float:
    """The proposed fix, as it would sit at the end of Engine._warm_up (engine thread):
    run one tiny request through the serving path (a copy of a loaded warm entry, a
    3-token suffix, one greedy token) so mlx's CPU JIT compiles or loads its fused kernels
    (mx.compile'd swiglu, masks, ...) at start-up, as a warm-prompts server's own prefill
    does, instead of in the first request's TTFT. Returns the seconds it took."""
    from kvsnap.runtime.engine.sampling import make_request_sampler
    from kvsnap.snapshot.codec import copy_cache

    t0 = time.perf_counter()
    entry = next((e for e in engine.prefix.entries if e.loaded), None) if from_entry else None
    if entry is not None:
        cache, suffix = copy_cache(entry.state), list(entry.tokens[:3])
    else:
        cache, suffix = engine.lm.make_cache(), list(engine.lm.tokenizer.encode("hello world"))[:3]
    gen = engine._batch.new_generator(
        1, 1
    )  # a throwaway generator: the engine's token counters stay exact
    gen.insert(
        [suffix], max_tokens=[1], caches=[cache], samplers=[make_request_sampler(0.0, 1.0, None)]
    )
    while not any(r.finish_reason for r in gen.next()[1]):
        pass
    return time.perf_counter() - t0


def install_prime_patch(from_entry: bool = True) -> None:
    """Monkeypatch Engine._warm_up to prime the kernels after the warm-up (kvsnap/ untouched)."""
    from kvsnap.runtime.engine.engine import Engine

    original = Engine._warm_up

    def warm_up_then_prime(self, allow_prefill: bool = True) -> None:
        original(self, allow_prefill)
        self.primed_s = prime_kernels(self, from_entry)

    Engine._warm_up = warm_up_then_prime


def child_first_requests(
    model: Path,
    agents: Path,
    store_dir: Path | None,
    system: str,
    kinds: list[str],
    seed: int,
    prime: str | None = None,
) -> dict:
    """In a fresh process: start one engine, then time its first requests (what a fresh server per
    cell measures)."""
    from kvsnap.chat import request_tokens

    if prime:
        install_prime_patch(from_entry=(prime == "entry"))
    t0 = time.perf_counter()
    engine = start_engine(model, agents, store_dir)
    ready = time.perf_counter() - t0
    tokenizer = engine.lm.tokenizer
    warm_len = engine.call(lambda: len(engine.prefix.entries[0].tokens))
    out = {"ready_s": ready, "primed_s": getattr(engine, "primed_s", None), "ttft": []}
    for i, kind in enumerate(kinds):
        tokens = request_tokens(
            tokenizer,
            [
                {"role": "system", "content": system},
                {"role": "user", "content": user_message(1000 * seed + i, kind)},
            ],
        )
        r = timed_request(engine, tokens, 1, warm_len)
        out["ttft"].append([kind, r["ttft"]])
    engine.shutdown()
    return out


def first_request_ab(
    work: Path, reps: int, kinds: list[str], jit_cold: bool = False, prime: str | None = None
) -> None:
    """Fresh process per (mode, rep), modes alternating: TTFT of request 1, 2, 3 after start.

    ``jit_cold``: every child gets an empty TMPDIR, so mlx's CPU JIT kernel cache
    ($TMPDIR/mlx/<version>/cpu) is empty, as on a machine that never ran this model.
    """
    import os
    import subprocess

    rows: dict = {"warm": [], "snapshots": []}
    for rep in range(reps):
        for mode in ["warm", "snapshots"] if rep % 2 == 0 else ["snapshots", "warm"]:
            cmd = [
                sys.executable,
                __file__,
                "--work",
                str(work),
                "--child",
                mode,
                "--seed",
                str(rep * 2 + (mode == "warm")),
                "--user",
                ",".join(kinds),
            ] + (["--prime", prime] if prime else [])
            env = dict(os.environ)
            if jit_cold:
                env["TMPDIR"] = tempfile.mkdtemp(prefix=f"jit-{mode}-{rep}-", dir=work)
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            data = json.loads(res.stdout.strip().splitlines()[-1])
            rows[mode].append(data)
            print(
                f"[first] rep {rep} {mode:10s} ready {data['ready_s']:6.2f}s (primed in "
                f"{data['primed_s'] or 0:.2f}s) "
                + " ".join(f"req{i + 1}({k}) {t:.3f}s" for i, (k, t) in enumerate(data["ttft"])),
                flush=True,
            )
    print(
        f"\n[first] medians over {reps} fresh processes per mode (jit cache "
        f"{'cold' if jit_cold else 'warm'}, {'primed: ' + prime if prime else 'as is'})"
    )
    for i, kind in enumerate(kinds):
        med = {m: statistics.median(d["ttft"][i][1] for d in rows[m]) for m in rows}
        print(
            f"[first] request {i + 1} ({kind}): warm {med['warm']:.3f}s snapshots "
            f"{med['snapshots']:.3f}s ratio {med['snapshots'] / med['warm']:.2f}x",
            flush=True,
        )


def align_check(store_dir: Path, model: Path, reps: int) -> None:
    """(a) in detail: attention over the restored views vs over fresh copies of the same arrays.

    The views point into one uint8 buffer at the file's data offsets (8-byte, not 64-byte
    aligned); a copy gets its own allocation. Same values, same shapes, only the memory differs.
    """
    import mlx.core as mx
    import numpy as np

    from kvsnap.runtime.model.loading import load_model
    from kvsnap.runtime.prefill.chunked import prefill
    from kvsnap.snapshot.codec import decode_cache
    from kvsnap.store.local import Store

    store = Store.open(store_dir)
    (info,) = store.scan()[0]
    restored = decode_cache(store.load_arrays(info), info.layers)
    prefilled = prefill(load_model(str(model)), tuple(store.read_tokens(info)))
    copies = [(c.keys * 1.0, c.values * 1.0) for c in restored]
    mx.eval(copies)
    addr = [np.frombuffer(memoryview(c.keys), dtype=np.uint8).ctypes.data % 64 for c in restored]
    print(
        f"\n[align] restored keys data address mod 64, per layer: {addr}; copies: "
        f"{[np.frombuffer(memoryview(k), dtype=np.uint8).ctypes.data % 64 for k, _ in copies]}"
    )
    q = mx.random.normal((1, 8, 44, 64), key=mx.random.key(1))
    mx.eval(q)
    variants = {
        "prefilled (strided view of 2816)": [
            (c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in prefilled
        ],
        "restored (views of one buffer)": [(c.keys, c.values) for c in restored],
        "restored, copied to own buffers": copies,
    }
    times = {name: [] for name in variants}
    for i in range(reps):
        names = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in names:
            t0 = time.perf_counter()
            mx.eval(
                [
                    mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
                    for k, v in variants[name]
                ]
            )
            times[name].append(time.perf_counter() - t0)
    for name, t in times.items():
        print(
            f"[align] attention, 8 layers, 44 x 2703: {name:34s} median "
            f"{1000 * statistics.median(t):7.2f} ms  min {1000 * min(t):7.2f} ms",
            flush=True,
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--system-tokens", type=int, default=2660)
    ap.add_argument(
        "--user",
        default="short,long",
        help="user message kinds: short (~50 tokens), medium (~330), long (~2,500, bench-serve's "
        "'long')",
    )
    ap.add_argument("--max-tokens", default="1,16")
    ap.add_argument(
        "--work", default=None, help="folder for the model and the store (default: a temp dir)"
    )
    ap.add_argument("--skip-ab", action="store_true")
    ap.add_argument(
        "--first",
        action="store_true",
        help="fresh process per (mode, rep): TTFT of the first requests after start",
    )
    ap.add_argument(
        "--jit-cold",
        action="store_true",
        help="with --first: an empty mlx JIT kernel cache (TMPDIR) per process",
    )
    ap.add_argument(
        "--prime",
        choices=["entry", "fresh"],
        help="with --first: apply the proposed fix (prime the kernels at the end of warm-up, over "
        "a copy of a warm entry or a fresh cache) by monkeypatching",
    )
    ap.add_argument("--child", choices=["warm", "snapshots"], help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument(
        "--align",
        action="store_true",
        help="attention over restored views vs copies of them vs prefilled buffers",
    )
    ap.add_argument("--micro", action="store_true", help="run the micro-benchmarks of the suspects")
    args = ap.parse_args(argv)

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kvsnap-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work)
    from kvsnap.runtime.model.loading import load_model

    tokenizer = load_model(str(model)).tokenizer
    system = system_prompt(tokenizer, args.system_tokens)
    agents = work / "agents.json"
    agents.write_text(
        json.dumps([{"name": "reviewer", "messages": [{"role": "system", "content": system}]}])
    )
    store_dir = work / "snaps"
    if not (store_dir / "manifest.json").exists():
        build_store(model, agents, store_dir)
    if args.child:
        out = child_first_requests(
            model,
            agents,
            store_dir if args.child == "snapshots" else None,
            system,
            args.user.split(","),
            args.seed,
            args.prime,
        )
        print(json.dumps(out), flush=True)
        return 0
    if args.first:
        first_request_ab(work, args.reps, args.user.split(","), args.jit_cold, args.prime)
        return 0
    if args.align:
        align_check(store_dir, model, args.reps)
        return 0
    if args.micro:
        micro(model, agents, store_dir, system, args.reps)
        return 0
    engines = {
        "warm": start_engine(model, agents, None),
        "snapshots": start_engine(model, agents, store_dir),
    }
    warm_len = engines["warm"].call(lambda: len(engines["warm"].prefix.entries[0].tokens))
    assert warm_len == engines["snapshots"].call(
        lambda: len(engines["snapshots"].prefix.entries[0].tokens)
    )
    print(f"warm prefix: {warm_len} tokens", flush=True)
    if not args.skip_ab:
        engine_ab(
            engines,
            tokenizer,
            system,
            warm_len,
            args.user.split(","),
            args.reps,
            [int(x) for x in args.max_tokens.split(",")],
            "as is",
        )
    for e in engines.values():
        e.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
