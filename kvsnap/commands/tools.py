"""`kvsnap demo-model`, `quickstart` and `bench-serve`: demo models, the guided tour, the serving
benchmark."""

from __future__ import annotations

from pathlib import Path

from kvsnap.commands.common import EXIT_OK, console, port_number, positive_int
from kvsnap.errors import KvsnapError


def add_demo_model(sub) -> None:
    p = sub.add_parser("demo-model", help="write a small random-weight mlx-lm model (no download)")
    p.add_argument("out", help="model directory to create")
    p.add_argument(
        "--arch",
        default="dense",
        choices=("dense", "hybrid", "sliding", "llama", "moe"),
        help="dense (qwen3), hybrid SSM (qwen3_next), sliding window (gemma3_text), llama (Llama-3 "
        "tokenizer and template) or moe (qwen3_5_moe, a Qwen3.5/3.6 MoE hybrid)",
    )
    p.add_argument(
        "--size",
        default="tiny",
        choices=("tiny", "small", "qwen3-0.6b"),
        help="tiny for tests, small for the benchmark table (scripts/bench_table.py), qwen3-0.6b "
        "(fp32) for benchmarks",
    )
    p.add_argument(
        "--template",
        default=None,
        choices=("chatml", "mistral", "default-system", "llama3"),
        help="chat template (default: llama3 for --arch llama, else chatml)",
    )
    p.add_argument(
        "--quantize",
        type=int,
        choices=(4, 8),
        default=None,
        help="quantize the weights to 4 or 8 bits",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing directory")
    p.set_defaults(run=cmd_demo_model)


def cmd_demo_model(args) -> int:
    from kvsnap.blas import preload_openblas
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    preload_openblas()
    path = make_demo_model(
        args.out,
        DemoSpec(
            arch=args.arch,
            size=args.size,
            template=args.template,
            quantize_bits=args.quantize,
            seed=args.seed,
        ),
        force=args.force,
    )
    print(
        f"demo model ({args.arch}, {args.size}, "
        f"{args.template or 'default template'}"
        f"{', q' + str(args.quantize) if args.quantize else ''}) in {path}"
    )
    return EXIT_OK


def add_bench_serve(sub) -> None:
    p = sub.add_parser(
        "bench-serve", help="measure TTFT, TPOT, latency and throughput of a running server"
    )
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="server base URL (default: http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--prompts",
        default="short,medium,long",
        help="built-in sets short,medium,long and/or files (JSON list or one prompt per line)",
    )
    p.add_argument(
        "--concurrency", default="1,4,8", help="comma-separated concurrency levels (default: 1,4,8)"
    )
    p.add_argument(
        "--system-prompt-file",
        help="system prompt prepended to every request (nothing is sent that could warm it "
        "first); any readable path, <(...) too; one trailing newline is dropped, as a warm "
        "prompt's JSON string has none",
    )
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument(
        "--repetitions", type=positive_int, default=3, help="rounds per configuration (default: 3)"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="requests sent before measuring (default: 0, so a cold server stays cold)",
    )
    p.add_argument("--tag", default="", help="label for this run's rows")
    p.add_argument("--output", help="also write the results to this file")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.set_defaults(run=cmd_bench_serve)


def _concurrencies(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise KvsnapError(
            f"--concurrency {text!r} must be comma-separated integers, e.g. 1,4,8"
        ) from None
    if not levels or min(levels) < 1:
        raise KvsnapError(f"--concurrency {text!r} must list positive integers, e.g. 1,4,8")
    return levels


def cmd_bench_serve(args) -> int:
    import asyncio

    import httpx
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvsnap.tools.bench_serve import load_prompt_set, read_system_prompt, render, run_bench

    sets = load_prompt_set(args.prompts)
    concurrencies = _concurrencies(args.concurrency)
    system = read_system_prompt(Path(args.system_prompt_file)) if args.system_prompt_file else None
    total = len(sets) * sum(concurrencies) * args.repetitions
    with Progress(
        TextColumn("bench-serve"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} requests"),
        TimeElapsedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("requests", total=total)
        try:
            results = asyncio.run(
                run_bench(
                    args.url,
                    sets,
                    concurrencies,
                    args.max_tokens,
                    args.repetitions,
                    args.warmup,
                    system,
                    args.tag,
                    on_done=lambda n: bar.advance(task, n),
                )
            )
        except (OSError, RuntimeError, httpx.HTTPError) as exc:
            raise KvsnapError(
                f"benchmark against {args.url} failed ({type(exc).__name__}: {exc}); is `kvsnap "
                f"serve` running there?"
            ) from None
    # A terminal's width, or whole rows in a file or pipe (CI logs).
    print(render(results, args.format, width=max(200, console().width)))
    if args.output:
        Path(args.output).write_text(
            render(results, "csv" if args.format == "table" else args.format)
        )
    return EXIT_OK


def add_quickstart(sub) -> None:
    what = (
        "make a demo model, build and verify snapshots for example agents, start a server on "
        "127.0.0.1 from them, send it a cold and a warm request, and stop it"
    )
    p = sub.add_parser("quickstart", help=what, description=what[0].upper() + what[1:] + ".")
    p.add_argument("--dir", default=".kvsnap-demo", help="working folder (default: ./.kvsnap-demo)")
    p.add_argument(
        "--port",
        type=port_number,
        default=0,
        help="the server's port on 127.0.0.1 (default: 0, a free one)",
    )
    p.set_defaults(run=cmd_quickstart)


def cmd_quickstart(args) -> int:
    from kvsnap.tools.quickstart import run_quickstart

    workdir = Path(args.dir).expanduser()
    if workdir.exists() and not workdir.is_dir():
        raise KvsnapError(f"--dir {args.dir}: is a file; give a folder (created when absent)")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvsnapError(
            f"--dir {args.dir}: cannot create it ({exc.strerror}); give a folder you can write"
        ) from None
    if args.port:
        from kvsnap.http.listen import bind_socket

        bind_socket("127.0.0.1", args.port).close()  # a busy port: one line now, not a traceback
    return run_quickstart(workdir, port=args.port)
