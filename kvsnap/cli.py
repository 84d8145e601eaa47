"""The `kvsnap` command. Heavy imports (mlx, mlx-lm) happen inside the subcommands that need them.

Exit codes: 0 success; 1 a check found bad files (verify), or some warm-prompt entries
were invalid or failed to build (build: the valid ones are still built and the table
says which); 2 a usage or input error, printed as one line on stderr naming the problem
and the fix.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from kvsnap import __version__
from kvsnap.errors import KvsnapError

log = logging.getLogger("kvsnap")

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _add_kv_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache settings (build and serve must agree)")
    g.add_argument("--kv-bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=None, help="quantize the KV cache to this many bits (default: off)")
    g.add_argument("--kv-group-size", type=_positive_int, default=64, help="KV quantization group size; must divide the head dim (default: 64)")
    g.add_argument("--quantized-kv-start", type=int, default=0, help="quantize the KV once a prompt reaches this many tokens (default: 0)")
    g.add_argument("--max-kv-size", type=_positive_int, default=None, help="rotating KV cache of this many tokens for models without their own cache layout")
    g.add_argument("--prefill-step-size", type=_positive_int, default=None, help="prefill chunk size (default: 512; recorded, not keyed)")


def _kv_settings(args: argparse.Namespace):
    from kvsnap.key import DEFAULT_PREFILL_STEP, KVSettings

    return KVSettings(
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        max_kv_size=args.max_kv_size,
        prefill_step_size=args.prefill_step_size or DEFAULT_PREFILL_STEP,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsnap", description="Persistent, shippable warm prefix caches for LLM serving on MLX.")
    parser.add_argument("--version", action="version", version=f"kvsnap {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("demo-model", help="write a small random-weight mlx-lm model (no download)")
    p.add_argument("out", help="model directory to create")
    p.add_argument("--arch", default="dense", choices=("dense", "hybrid", "sliding"), help="dense (qwen3), hybrid SSM (qwen3_next) or sliding window (gemma3_text)")
    p.add_argument("--size", default="tiny", choices=("tiny", "qwen3-0.6b"), help="tiny for tests, qwen3-0.6b (fp32) for benchmarks")
    p.add_argument("--template", default="chatml", choices=("chatml", "mistral", "default-system"), help="chat template")
    p.add_argument("--quantize", type=int, choices=(4, 8), default=None, help="quantize the weights to 4 or 8 bits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing directory")

    p = sub.add_parser("build", help="prefill warm prompts once and write their snapshots")
    p.add_argument("agents", help="warm-prompt file (JSON list of message lists or {name, messages, tools, chat_template_kwargs})")
    p.add_argument("--model", required=True, help="hub id (org/name, from the Hugging Face cache as mlx-lm resolves it) or local mlx-lm model folder")
    p.add_argument("--revision", metavar="REV", help="hub revision: branch, tag or commit (default: main); only with a hub id")
    p.add_argument("--out", required=True, help="snapshot store directory (created if absent)")
    p.add_argument("--force", action="store_true", help="re-prefill and rewrite every snapshot")
    p.add_argument("--for", dest="for_server", choices=("kvsnap", "vllm-mlx"), default="kvsnap", help="the server whose requests the snapshots must match: kvsnap serve (default) or vllm-mlx (it encodes with the tokenizer's special tokens and its own enable_thinking); see docs/vllm-mlx.md")
    p.add_argument("--served-model-name", metavar="NAME", help="with --for vllm-mlx: the MODEL name vllm-mlx serve is started with, from which it picks enable_thinking (false when the name contains 'coder'); default: --model")
    _add_kv_options(p)

    p = sub.add_parser("serve", help="OpenAI-compatible server that starts warm from snapshots")
    p.add_argument("model", help="hub id (org/name, from the Hugging Face cache as mlx-lm resolves it) or local mlx-lm model folder")
    p.add_argument("--revision", metavar="REV", help="hub revision: branch, tag or commit (default: main); only with a hub id")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--continuous-batching", action="store_true", help="batch concurrent requests (mlx-lm BatchGenerator); without it requests run one at a time")
    p.add_argument("--warm-prompts", metavar="FILE", help="warm-prompt file: these prefixes are warm before /health says ok")
    p.add_argument("--kv-snapshots", metavar="DIR_OR_OCI", help="snapshot store to start warm from: a folder, or oci://HOST[:PORT]/REPO:TAG (pulled into a local cache first); prefilled warm prompts are written back when writable")
    p.add_argument("--no-write-back", action="store_true", help="never write prefilled warm prompts back to the store")
    p.add_argument("--warm-prompts-concurrency", type=_positive_int, default=1, help="at most N warm-prompt prefills at once (default: 1)")
    p.add_argument("--cache-memory-mb", type=float, default=2048.0, help="prefix cache budget in MiB: pinned snapshots load up to it, the rest on first hit (default: 2048)")
    p.add_argument("--max-batch-size", type=_positive_int, default=8, help="most requests decoding at once (default: 8)")
    p.add_argument("--max-tokens", type=_positive_int, default=256, help="default max_tokens of a request (default: 256)")
    p.add_argument("--served-model-name", help="model id clients send (default: the hub id, else the model folder's name)")
    g = p.add_argument_group("security and limits (docs/server.md#security)")
    g.add_argument("--api-key", action="append", metavar="KEY", help="require `Authorization: Bearer KEY` on every endpoint but /health; repeatable. Prefer KVSNAP_API_KEY (comma-separated): arguments show in `ps`")
    g.add_argument("--admin-api-key", action="append", metavar="KEY", help="only these keys may DELETE /v1/cache/prefix and see every request in /v1/status; repeatable; or KVSNAP_ADMIN_API_KEY")
    g.add_argument("--max-request-bytes", type=_positive_int, default=8 * 2**20, help="larger request bodies get 413 (default: 8 MiB)")
    g.add_argument("--max-queued-requests", type=int, default=64, help="requests waiting beyond --max-batch-size before new ones get 429 (default: 64)")
    g.add_argument("--no-request-prefix-cache", action="store_true", help="never keep request prompts for reuse; only warm prompts are cached")
    g.add_argument("--cached-tokens-granularity", type=_positive_int, default=128, help="partial matches on prefixes shared between clients report cached_tokens in these steps (default: 128, as OpenAI; 1 = exact)")
    _add_kv_options(p)

    p = sub.add_parser("bench-serve", help="measure TTFT, TPOT, latency and throughput of a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: http://127.0.0.1:8000)")
    p.add_argument("--prompts", default="short,medium,long", help="built-in sets short,medium,long and/or files (JSON list or one prompt per line)")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated concurrency levels (default: 1,4,8)")
    p.add_argument("--system-prompt-file", help="system prompt prepended to every request (nothing is sent that could warm it first)")
    p.add_argument("--max-tokens", type=_positive_int, default=64)
    p.add_argument("--repetitions", type=_positive_int, default=3, help="rounds per configuration (default: 3)")
    p.add_argument("--warmup", type=int, default=0, help="requests sent before measuring (default: 0, so a cold server stays cold)")
    p.add_argument("--tag", default="", help="label for this run's rows")
    p.add_argument("--output", help="also write the results to this file")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")

    p = sub.add_parser("quickstart", help="make a demo model, build snapshots for example agents, verify them")
    p.add_argument("--dir", default=".kvsnap-demo", help="working folder (default: ./.kvsnap-demo)")

    p = sub.add_parser("ls", help="list the snapshots in a store (headers only)")
    p.add_argument("store")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("inspect", help="show one snapshot file's header")
    p.add_argument("file")

    p = sub.add_parser("verify", help="check every snapshot (exit 1 if any is bad)")
    p.add_argument("store")
    p.add_argument("--model", help="also reject snapshots not built for this model: hub id or local folder (imports mlx)")
    p.add_argument("--revision", metavar="REV", help="hub revision: branch, tag or commit (default: main); only with a hub id")
    _add_kv_options(p)

    p = sub.add_parser("gc", help="remove temp files and snapshots no manifest record uses (dry run unless --yes)")
    p.add_argument("store")
    p.add_argument("--yes", action="store_true", help="really delete")

    plain = "plain HTTP instead of HTTPS (the default for localhost and 127.0.0.1; or set KVSNAP_REGISTRY_PLAIN_HTTP=1)"
    p = sub.add_parser("push", help="verify a store and upload it to an OCI registry (blobs the registry has are not sent again)")
    p.add_argument("store", help="snapshot store directory")
    p.add_argument("ref", help="oci://HOST[:PORT]/REPO:TAG")
    p.add_argument("--plain-http", action="store_true", default=None, help=plain)

    p = sub.add_parser("pull", help="download a store from an OCI registry (only missing files), verify it, install it atomically")
    p.add_argument("ref", help="oci://HOST[:PORT]/REPO:TAG or oci://HOST/REPO@sha256:…")
    p.add_argument("store", help="snapshot store directory (created if absent; files already there are reused)")
    p.add_argument("--plain-http", action="store_true", default=None, help=plain)

    p = sub.add_parser("pack", help="verify a store and write it to a tarball (.tar, .tar.gz, .tar.xz)")
    p.add_argument("store", help="snapshot store directory")
    p.add_argument("-o", "--output", required=True, help="archive file to write")

    p = sub.add_parser("unpack", help="unpack a tarball made by `kvsnap pack`, verify it, install it atomically")
    p.add_argument("archive", help="archive file")
    p.add_argument("store", help="snapshot store directory (created if absent)")

    p = sub.add_parser(
        "vllm-mlx",
        help="run vllm-mlx's own server warm from a store: kvsnap vllm-mlx serve MODEL [its flags] --kv-snapshots DIR",
        description="Run vllm-mlx's own server (installed beside kvsnap) with the store's snapshots of MODEL in its prefix cache before it accepts requests. "
        "Every argument but --kv-snapshots goes to `vllm-mlx serve` unchanged; `kvsnap vllm-mlx serve --help` shows both. See docs/vllm-mlx.md.",
    )
    p.add_argument("vllm_mlx_args", nargs=argparse.REMAINDER, metavar="serve MODEL [vllm-mlx flags] --kv-snapshots DIR")
    return parser


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cmd_demo_model(args) -> int:
    from kvsnap.tools.demo import DemoSpec, make_demo_model
    from kvsnap.blas import preload_openblas

    preload_openblas()
    path = make_demo_model(args.out, DemoSpec(arch=args.arch, size=args.size, template=args.template, quantize_bits=args.quantize, seed=args.seed), force=args.force)
    print(f"demo model ({args.arch}, {args.size}, {args.template}{', q' + str(args.quantize) if args.quantize else ''}) in {path}")
    return EXIT_OK


def _build_tokenization(args):
    """The request path `build --for` names (None: kvsnap's own); bad combinations are usage errors."""
    from kvsnap.errors import UsageError

    if args.for_server != "vllm-mlx":
        if args.served_model_name is not None:
            raise UsageError(f"--served-model-name {args.served_model_name!r} only applies with --for vllm-mlx; add --for vllm-mlx or drop it")
        return None
    kv = {"--kv-bits": args.kv_bits, "--max-kv-size": args.max_kv_size}
    given = [f"{flag} {value}" for flag, value in kv.items() if value is not None]
    if given:
        raise UsageError(f"--for vllm-mlx with {', '.join(given)}: vllm-mlx's live KV cache is never quantized or bounded, so it could not use these snapshots; drop {', '.join(f.split()[0] for f in given)}")
    from kvsnap.integrations.vllm_mlx_profile import vllm_mlx_tokenization

    return vllm_mlx_tokenization(args.served_model_name or args.model)


def cmd_build(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from kvsnap.build import build_snapshots
    from kvsnap.faults import FaultHook
    from kvsnap.runtime.modeling import default_digest_cache, load_model, resolve_model
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.store.local import Store

    tokenization = _build_tokenization(args)
    prompts = load_warm_prompts(args.agents)
    source = resolve_model(args.model, args.revision)  # a bad id or folder fails before the store is created
    store = Store.open(args.out, create=True, fault=FaultHook.from_env())
    console = _console()
    for problem in prompts.problems:
        console.print(f"[yellow]skipped[/] {problem}", markup=True)
    lm = load_model(source, _kv_settings(args))
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("prefilling", total=len(prompts.entries))

        def progress(event: str, name: str) -> None:
            if event == "start":
                bar.update(task, description=f"{name}")
            else:
                bar.advance(task)

        report = build_snapshots(lm, prompts, store, args.agents, force=args.force, progress=progress, digests=default_digest_cache(), tokenization=tokenization)

    table = Table(title=f"kvsnap build → {report.store}")
    for col in ("agent", "status", "tokens", "coverage", "bytes", "seconds"):
        table.add_column(col, justify="left" if col in ("agent", "status") else "right")
    for e in report.entries:
        table.add_row(e.name, e.status, str(e.n_tokens), f"{e.coverage:.0%}", _human_bytes(e.nbytes), f"{e.seconds:.2f}")
    console.print(table)
    for e in report.entries:
        for w in e.warnings:
            console.print(f"warning: {w}", markup=False)
        if e.error:
            console.print(f"failed: {e.error}", markup=False)
    total_tokens = sum(e.n_tokens for e in report.entries if e.status != "failed")
    total_bytes = sum(e.nbytes for e in report.entries)
    console.print(
        f"{report.count('built')} built, {report.count('reused')} reused, {report.count('failed')} failed, "
        f"{len(report.problems)} invalid; {total_tokens} tokens, {_human_bytes(total_bytes)} in {report.seconds:.1f}s",
        markup=False,
    )
    return EXIT_OK if report.ok else EXIT_BAD


def cmd_ls(args) -> int:
    from kvsnap.store.local import Store

    store = Store.open(args.store, readonly=True)
    good, bad = store.scan()
    if args.json:
        print(json.dumps({"snapshots": [{"key": i.key, "name": i.name, "file": i.relpath, "n_tokens": i.n_tokens, "bytes": i.nbytes, "model_digest": i.model_digest, "model_repo": i.recorded.get("model_repo"), "model_commit": i.recorded.get("model_commit"), "created": i.recorded.get("created")} for i in good], "problems": [{"file": str(p.path), "reason": p.reason} for p in bad]}, indent=1))
        return EXIT_OK
    from rich.markup import escape
    from rich.table import Table

    # Names and dates come from the files: data, never rich markup ("[/bold]" would raise).
    table = Table(title=escape(f"{store.root}: {len(good)} snapshot(s)"))
    for col in ("key", "agent", "tokens", "size", "model", "created"):
        table.add_column(col)
    for i in good:
        origin = f" {i.recorded['model_repo']}@{str(i.recorded.get('model_commit', '?'))[:7]}" if i.recorded.get("model_repo") else ""  # hub builds only
        table.add_row(i.key[:12], escape(i.name), str(i.n_tokens), _human_bytes(i.nbytes), escape(i.model_digest[:12] + origin), escape(i.recorded.get("created", "?")))
    console = _console()
    console.print(table)
    for p in bad:
        console.print(f"unreadable: {p}", markup=False)
    return EXIT_OK


def cmd_inspect(args) -> int:
    from kvsnap.errors import SnapshotError
    from kvsnap.snapshot.file import FormatError, read_header
    from kvsnap.store.local import inspect_header

    path = Path(args.file)
    if not path.is_file():
        raise KvsnapError(f"{path}: no such snapshot file; give a path like STORE/snapshots/<key>.safetensors")
    try:
        header = read_header(path)
        info = inspect_header(path, header)
    except FormatError as exc:
        raise SnapshotError(str(path), str(exc), "give a kvsnap snapshot file (STORE/snapshots/<key>.safetensors); `kvsnap verify STORE` checks them all") from None
    except OSError as exc:
        raise SnapshotError(str(path), f"cannot be read ({exc.strerror or exc})", "check the file's permissions") from None
    out = {
        "file": str(path),
        "key": info.key,
        "name": info.name,
        "n_tokens": info.n_tokens,
        "bytes": info.nbytes,
        "model_digest": info.model_digest,
        "model": info.model,
        "prompt_digest": info.prompt_digest,
        "recorded": info.recorded,
        "layers": info.layers,
        "tensors": {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in sorted(header.tensors.items())},
    }
    print(json.dumps(out, indent=1))
    return EXIT_OK


def cmd_verify(args) -> int:
    from kvsnap.errors import SnapshotError, StoreError
    from kvsnap.store.local import Store

    store = Store.open(args.store, readonly=True)
    if not store.is_initialized():
        raise StoreError(f"{store.root} is not a kvsnap store (no manifest.json, no snapshots/); give the folder passed to `kvsnap build --out`")
    expected = None
    if args.revision and not args.model:
        raise KvsnapError(f"--revision {args.revision!r} needs --model (a hub id); add --model ORG/NAME or drop --revision")
    if args.model:
        from kvsnap.runtime.modeling import default_digest_cache, load_model

        expected = load_model(args.model, _kv_settings(args), args.revision).identity(default_digest_cache())
    ok = bad = 0
    files = store.snapshot_files()
    for path in files:
        try:
            info = store.verify_file(path, expected)
            ok += 1
            name = info.name if info.name.isprintable() else repr(info.name)  # a name from a file must not forge output lines
            print(f"ok   {info.relpath}  {name}  {info.n_tokens} tokens")
        except SnapshotError as exc:
            bad += 1
            print(f"BAD  {exc.path}: {exc.reason}; {exc.fix}")
    try:
        referenced = store.referenced()
    except StoreError as exc:
        bad += 1
        referenced = set()
        print(f"BAD  {exc}")
    present = {f"snapshots/{p.name}" for p in files}
    for ref in sorted(referenced - present):
        bad += 1
        print(f"BAD  {store.root / ref}: listed in the manifest but missing; run `kvsnap build` again")
    for tmp in store.temp_files():
        print(f"note {tmp}: leftover temp file of an interrupted write (harmless; `kvsnap gc --yes` removes it)")
    print(f"{ok} ok, {bad} bad")
    return EXIT_BAD if bad else EXIT_OK


def cmd_gc(args) -> int:
    from kvsnap.store.local import MANIFEST, Store

    store = Store.open(args.store)
    doomed, freed = store.gc(apply=args.yes)
    verb = "removed" if args.yes else "would remove"
    if not (store.root / MANIFEST).exists() and store.snapshot_files():
        print(f"note {store.root} has no manifest.json, so no snapshot is known to be unused; only temp files are removed")
    for p in doomed:
        print(f"{verb} {p}")
    print(f"{verb} {len(doomed)} file(s), {_human_bytes(freed)}" + ("" if args.yes else "; run again with --yes to delete"))
    return EXIT_OK


def cmd_serve(args) -> int:
    import uvicorn

    from kvsnap.runtime.engine import Engine, EngineConfig
    from kvsnap.http.guard import Auth
    from kvsnap.runtime.modeling import default_digest_cache, resolve_model
    from kvsnap.store.oci import resolve_kv_snapshots
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.http.limits import context_length
    from kvsnap.http.watch import exit_when_warm_up_fails, is_loopback
    from kvsnap.http.server import ServerConfig, create_app

    source = resolve_model(args.model, args.revision)
    model_dir = source.path
    auth = Auth.from_flags(args.api_key, args.admin_api_key)
    if args.max_queued_requests < 0:
        raise KvsnapError(f"--max-queued-requests {args.max_queued_requests} must be 0 or more")
    if not auth.enabled and not is_loopback(args.host):
        log.warning("[kvsnap] serving on %s without API keys: anyone who can reach this port can use and clear the cache; set KVSNAP_API_KEY", args.host)
    if args.kv_snapshots and "://" not in args.kv_snapshots and Path(args.kv_snapshots).expanduser().is_file():
        raise KvsnapError(f"--kv-snapshots {args.kv_snapshots}: is a file; give the store folder made by `kvsnap build --out` (or oci://…)")
    prompts = load_warm_prompts(args.warm_prompts) if args.warm_prompts else None
    for problem in prompts.problems if prompts else []:
        log.warning("[kvsnap] skipped warm prompt %s", problem)
    args.kv_snapshots = resolve_kv_snapshots(args.kv_snapshots)  # oci://… is pulled into a local cache folder first
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            settings=_kv_settings(args),
            warm_prompts=prompts,
            warm_prompts_file=args.warm_prompts,
            snapshots=args.kv_snapshots,
            write_back=not args.no_write_back,
            warm_prompts_concurrency=args.warm_prompts_concurrency,
            cache_memory_mb=args.cache_memory_mb,
            continuous_batching=args.continuous_batching,
            max_batch_size=args.max_batch_size if args.continuous_batching else 1,
            digest_cache=default_digest_cache(),
        )
    )
    config_json = json.loads((model_dir / "config.json").read_text())
    name = args.served_model_name or source.repo_id or Path(args.model).expanduser().name or model_dir.name
    max_batch = args.max_batch_size if args.continuous_batching else 1
    server_config = ServerConfig(
        served_model_name=name,
        model_aliases=(args.model, str(model_dir)),
        default_max_tokens=args.max_tokens,
        context_length=context_length(config_json),
        auth=auth,
        max_request_bytes=args.max_request_bytes,
        max_inflight=max_batch + args.max_queued_requests,
        request_prefix_cache=not args.no_request_prefix_cache,
        cached_tokens_granularity=args.cached_tokens_granularity,
    )
    engine.start()  # load the model on the main thread, before the port opens
    server = uvicorn.Server(uvicorn.Config(create_app(engine, server_config), host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5))
    exit_when_warm_up_fails(engine, server)
    server.run()
    if engine.failed:
        print(f"kvsnap serve: error: warm-up failed: {engine.failed}", file=sys.stderr)
        return EXIT_BAD
    return EXIT_OK


def cmd_bench_serve(args) -> int:
    import asyncio

    import httpx
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvsnap.tools.bench_serve import load_prompt_set, render, run_bench

    sets = load_prompt_set(args.prompts)
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise KvsnapError(f"--concurrency {args.concurrency!r} must be comma-separated integers, e.g. 1,4,8") from None
    if not concurrencies or min(concurrencies) < 1:
        raise KvsnapError(f"--concurrency {args.concurrency!r} must list positive integers, e.g. 1,4,8")
    system = None
    if args.system_prompt_file:
        path = Path(args.system_prompt_file)
        if not path.is_file():
            raise KvsnapError(f"--system-prompt-file {path}: no such file")
        system = path.read_text()
    total = len(sets) * sum(concurrencies) * args.repetitions
    with Progress(TextColumn("bench-serve"), BarColumn(), TextColumn("{task.completed}/{task.total} requests"), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("requests", total=total)
        try:
            results = asyncio.run(run_bench(args.url, sets, concurrencies, args.max_tokens, args.repetitions, args.warmup, system, args.tag, on_done=lambda n: bar.advance(task, n)))
        except (OSError, RuntimeError, httpx.HTTPError) as exc:
            raise KvsnapError(f"benchmark against {args.url} failed ({type(exc).__name__}: {exc}); is `kvsnap serve` running there?") from None
    text = render(results, args.format)
    print(text)
    if args.output:
        Path(args.output).write_text(render(results, "csv" if args.format == "table" else args.format))
    return EXIT_OK


def cmd_push(args) -> int:
    from kvsnap.store.oci import Reference, push

    report = push(args.store, Reference.parse(args.ref), plain_http=args.plain_http)
    print(f"pushed {args.store} to {report.ref} ({report.manifest_digest})")
    print(f"{len(report.uploaded)} blob(s) uploaded ({_human_bytes(report.uploaded_bytes)}), {len(report.skipped)} already in the registry")
    return EXIT_OK


def cmd_pull(args) -> int:
    from kvsnap.store.oci import Reference, pull

    report = pull(Reference.parse(args.ref), args.store, plain_http=args.plain_http)
    print(f"pulled {report.ref} ({report.manifest_digest}) into {report.dest}")
    print(f"{len(report.downloaded)} file(s) downloaded ({_human_bytes(report.downloaded_bytes)}), {len(report.present)} already there; all verified")
    return EXIT_OK


def cmd_pack(args) -> int:
    from kvsnap.store.archive import pack

    report = pack(args.store, args.output)
    print(f"packed {len(report.files)} file(s), {_human_bytes(report.nbytes)}, from {args.store} into {report.archive}")
    return EXIT_OK


def cmd_unpack(args) -> int:
    from kvsnap.store.archive import unpack

    report = unpack(args.archive, args.store)
    print(f"unpacked {len(report.files)} file(s), {_human_bytes(report.nbytes)}, from {args.archive} into {report.dest}; all verified")
    return EXIT_OK


def cmd_vllm_mlx(args) -> int:
    from kvsnap.integrations.vllm_mlx import main as vllm_mlx_main

    # vllm-mlx logs through the root logger: give its lines a time, level and source, like `serve`.
    logging.basicConfig(force=True, level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rc = vllm_mlx_main(args.vllm_mlx_args)
    if args.vllm_mlx_args[:1] == ["serve"]:
        # vllm-mlx has shut down cleanly. Skip interpreter finalization: a thread that ran mlx
        # work and ends there aborts the process ("terminate called without an active
        # exception", mlx's per-thread compile cache), turning a clean exit into SIGABRT.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    return rc


def cmd_quickstart(args) -> int:
    from kvsnap.tools.quickstart import run_quickstart

    return run_quickstart(Path(args.dir))


COMMANDS = {
    "serve": cmd_serve,
    "quickstart": cmd_quickstart,
    "bench-serve": cmd_bench_serve,
    "demo-model": cmd_demo_model,
    "build": cmd_build,
    "ls": cmd_ls,
    "inspect": cmd_inspect,
    "verify": cmd_verify,
    "gc": cmd_gc,
    "push": cmd_push,
    "pull": cmd_pull,
    "pack": cmd_pack,
    "unpack": cmd_unpack,
    "vllm-mlx": cmd_vllm_mlx,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(message)s" if args.command == "serve" else "%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call drowns the output
    if not args.command:
        parser.print_help()
        return EXIT_USAGE
    try:
        return COMMANDS[args.command](args)
    except KvsnapError as exc:
        print(f"kvsnap {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"kvsnap {args.command}: interrupted", file=sys.stderr)
        return 130
