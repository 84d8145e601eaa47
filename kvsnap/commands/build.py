"""`kvsnap build`: prefill warm prompts once and write their snapshots, with a progress bar and a
table."""

from __future__ import annotations

import json

from kvsnap.commands.common import (
    EXIT_BAD,
    EXIT_OK,
    MODEL_HELP,
    REVISION_HELP,
    add_kv_options,
    console,
    human_bytes,
    kv_settings,
    table_title,
)
from kvsnap.errors import UsageError


def add_build(sub) -> None:
    p = sub.add_parser("build", help="prefill warm prompts once and write their snapshots")
    p.add_argument(
        "agents",
        help="warm-prompt file (JSON list of message lists or {name, messages, tools, "
        "chat_template_kwargs})",
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--revision", metavar="REV", help=REVISION_HELP)
    p.add_argument("--out", required=True, help="snapshot store directory (created if absent)")
    p.add_argument("--force", action="store_true", help="re-prefill and rewrite every snapshot")
    p.add_argument(
        "--for",
        dest="for_server",
        choices=("kvsnap", "vllm-mlx", "mlx-lm"),
        default="kvsnap",
        help="the server whose requests the snapshots must match: kvsnap serve (default), vllm-mlx "
        "(it encodes with the tokenizer's special tokens and its own enable_thinking; "
        "docs/vllm-mlx.md) or mlx-lm (mlx_lm.server with its --chat-template-args; docs/mlx-lm.md)",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="with --for vllm-mlx: the MODEL name vllm-mlx serve is started with, from which it "
        "picks enable_thinking (false when the name contains 'coder'); default: --model",
    )
    p.add_argument(
        "--chat-template-args",
        metavar="JSON",
        help="with --for mlx-lm: the --chat-template-args JSON object mlx_lm.server is started "
        "with (its defaults for every request's template)",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=256,
        metavar="B",
        help="tokens per stored block (default 256): prompts sharing a prefix share its blocks; an "
        "edit re-prefills from the block it falls in",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=1024,
        metavar="C",
        help="for hybrid models (SSM, sliding window): store those layers' whole state every C "
        "tokens too (default 1024), besides branch points and prompt ends",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON (per entry: tokens reused and prefilled, blocks and bytes "
        "written) instead of a table",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch: split the model's layers across the ranks (pipeline parallel) "
        "instead of its attention heads (tensor parallel, the default); see docs/distributed.md",
    )
    add_kv_options(p)
    p.set_defaults(run=cmd_build)


def block_settings(args):
    """--block-tokens / --checkpoint-every, checked (a UsageError names the flag, the value and the
    range)."""
    from kvsnap.errors import UsageError
    from kvsnap.snapshot.blocks import MAX_BLOCK_TOKENS, BlockSettings

    for flag, value in (
        ("--block-tokens", args.block_tokens),
        ("--checkpoint-every", args.checkpoint_every),
    ):
        if not 1 <= value <= MAX_BLOCK_TOKENS:
            raise UsageError(
                f"{flag} {value}: give a number of tokens from 1 to {MAX_BLOCK_TOKENS}"
            )
    return BlockSettings(args.block_tokens, args.checkpoint_every)


def build_tokenization(args):
    """The request path `build --for` names (None: kvsnap's own); bad combinations are usage
    errors."""
    from kvsnap.errors import UsageError

    if args.for_server == "mlx-lm":
        return mlx_lm_build_tokenization(args)
    if getattr(args, "chat_template_args", None) is not None:
        raise UsageError(
            f"--chat-template-args {args.chat_template_args!r} only applies with --for mlx-lm; add "
            f"--for mlx-lm or drop it"
        )
    if args.for_server != "vllm-mlx":
        if args.served_model_name is not None:
            raise UsageError(
                f"--served-model-name {args.served_model_name!r} only applies with --for vllm-mlx; "
                f"add --for vllm-mlx or drop it"
            )
        return None
    kv = {"--kv-bits": args.kv_bits, "--max-kv-size": args.max_kv_size}
    given = [f"{flag} {value}" for flag, value in kv.items() if value is not None]
    if given:
        raise UsageError(
            f"--for vllm-mlx with {', '.join(given)}: vllm-mlx's live KV cache is never quantized "
            f"or bounded, so it could not use these snapshots; drop "
            f"{', '.join(f.split()[0] for f in given)}"
        )
    from kvsnap.profiles import vllm_mlx_tokenization

    return vllm_mlx_tokenization(args.served_model_name or args.model)


def mlx_lm_build_tokenization(args):
    """`build --for mlx-lm`: mlx_lm.server's batched KV is never quantized or bounded."""
    from kvsnap.errors import UsageError
    from kvsnap.profiles import mlx_lm_tokenization, parse_chat_template_args

    if args.served_model_name is not None:
        raise UsageError(
            f"--served-model-name {args.served_model_name!r} only applies with --for vllm-mlx; "
            f"drop it (mlx_lm.server's rendering does not depend on the model name)"
        )
    given = [
        f"{flag} {value}"
        for flag, value in (("--kv-bits", args.kv_bits), ("--max-kv-size", args.max_kv_size))
        if value is not None
    ]
    if given:
        raise UsageError(
            f"--for mlx-lm with {', '.join(given)}: mlx_lm.server's prompt cache holds "
            f"full-precision, unbounded KV, so it could not use these snapshots; drop "
            f"{', '.join(f.split()[0] for f in given)}"
        )
    return mlx_lm_tokenization(parse_chat_template_args(args.chat_template_args))


def unread_template_kwargs(entries, tokenizer) -> list[str]:
    """One warning per agent ``chat_template_kwargs`` key the model's chat template never reads:
    it changes nothing in the snapshot, and kvsnap serve refuses requests that carry it."""
    # The server's own check (kvsnap serve's 400 for such a key), so both always agree.
    from kvsnap.http.limits import RESERVED_TEMPLATE_KWARGS, allowed_template_kwargs

    settable = allowed_template_kwargs(getattr(tokenizer, "chat_template", None))
    offered = ", ".join(sorted(settable)) or "none"

    def why(key: str) -> str:
        # A reserved name may well be read by the template (tools, messages): say what it is.
        if key in RESERVED_TEMPLATE_KWARGS:
            return "is filled in by kvsnap and the tokenizer, never by chat_template_kwargs"
        return "is not a variable this model's chat template reads"

    return [
        f"agent {entry.name!r}: chat_template_kwargs {key!r} {why(key)} (settable variables: "
        f"{offered}); it changes nothing in the snapshot, and kvsnap serve refuses requests "
        f"that carry it with a 400: drop it from the agents file or use one of those"
        + ("; an agent's tools go in its own 'tools' field" if key == "tools" else "")
        for entry in entries
        for key in (entry.chat_template_kwargs or {})
        if key not in settable
    ]


def cmd_build(args) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.faults import FaultHook
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.runtime.model.loading import default_digest_cache, load_model, resolve_model
    from kvsnap.runtime.sharding.launch import launched_ranks
    from kvsnap.store.local import Store

    tokenization = build_tokenization(args)
    blocks = block_settings(args)
    prompts = load_warm_prompts(args.agents)
    # a bad id or folder fails before the store is created
    source = resolve_model(args.model, args.revision)
    shard = ("pipeline" if args.pipeline else "tensor") if launched_ranks() > 1 else None
    if shard is None and args.pipeline:
        raise UsageError(
            "--pipeline splits a model across mlx.launch ranks; this build runs as one process "
            "(start it with `mlx.launch -n N --backend ring kvsnap build ... --pipeline`)"
        )
    if shard is not None:
        return build_sharded(args, source, shard, prompts, tokenization, blocks)
    store = Store.open(args.out, create=True, fault=FaultHook.from_env())
    out = console(stderr=args.json)
    for problem in prompts.problems:
        out.print(f"[yellow]skipped[/] {problem}", markup=True)
    lm = load_model(source, kv_settings(args))
    for warning in unread_template_kwargs(prompts.entries, lm.tokenizer):
        out.print(f"warning: {warning}", markup=False, soft_wrap=True)
    n_entries = len(prompts.entries)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=out,
        transient=True,
    ) as bar:
        # one bar per agent, by tokens: a long prefill moves it and gives it an ETA
        current = bar.add_task("prefilling", total=None)
        started, tokens = 0, 0

        def progress(event: str, name: str) -> None:
            nonlocal current, started, tokens
            if event == "start":
                started, tokens = started + 1, 0
                bar.update(current, visible=False)
                current = bar.add_task(f"{name} ({started}/{n_entries})", total=None)
            else:
                bar.update(current, total=tokens or 1, completed=tokens or 1)

        def on_tokens(name: str, done: int, total: int) -> None:
            nonlocal tokens
            if not tokens:
                # restored tokens count as done, not as speed: the ETA is the prefill's
                tokens = total
                bar.reset(current, total=total, completed=done)
            else:
                bar.update(current, completed=done)

        report = build_snapshots(
            lm,
            prompts,
            store,
            args.agents,
            force=args.force,
            progress=progress,
            digests=default_digest_cache(),
            tokenization=tokenization,
            blocks=blocks,
            on_tokens=on_tokens,
        )
    if args.json:
        print(json.dumps(build_report_json(report, blocks), indent=1))
    else:
        print_build_report(out, report)
    return EXIT_OK if report.ok else EXIT_BAD


def build_sharded(args, source, shard: str, prompts, tokenization, blocks) -> int:
    """``kvsnap build`` as one of several mlx.launch ranks: rank 0 builds and writes the store
    (its report as a single-process build prints it); the others only prefill their slices."""
    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.build.sharded import ShardedPrefill, follow
    from kvsnap.faults import FaultHook
    from kvsnap.runtime.model.loading import default_digest_cache, load_model
    from kvsnap.runtime.sharding.agreement import agree_identity
    from kvsnap.runtime.sharding.ranks import RankGroup
    from kvsnap.runtime.sharding.topology import shard_view_of
    from kvsnap.store.local import Store

    ranks = RankGroup.world()
    lm = load_model(source, kv_settings(args), shard=shard)
    view = shard_view_of(lm.model, ranks)
    if view is None:  # mlx-lm kept the whole model on every rank
        raise UsageError(f"mlx-lm did not shard {source.path} across {ranks.size} ranks")
    agree_identity(ranks, lm.identity(default_digest_cache()), str(source.path))
    if ranks.rank != 0:
        return follow(lm, view, ranks)
    prefill = ShardedPrefill(lm, view, ranks)
    # An error here ends this process, and mlx.launch then stops the ranks waiting on it.
    store = Store.open(args.out, create=True, fault=FaultHook.from_env())
    out = console(stderr=args.json)
    for problem in prompts.problems:
        out.print(f"[yellow]skipped[/] {problem}", markup=True)
    out.print(f"{view.describe()}: building; the other ranks prefill their slices", markup=False)
    report = build_snapshots(
        lm,
        prompts,
        store,
        args.agents,
        force=args.force,
        digests=default_digest_cache(),
        tokenization=tokenization,
        blocks=blocks,
        prefiller=prefill,
    )
    prefill.finish()  # the other ranks exit
    if args.json:
        print(json.dumps(build_report_json(report, blocks), indent=1))
    else:
        print_build_report(out, report)
    return EXIT_OK if report.ok else EXIT_BAD


def build_report_json(report, blocks) -> dict:
    """What `kvsnap build --json` prints: the totals, then per entry what was reused, prefilled and
    written."""
    fields = (
        "name",
        "status",
        "key",
        "n_tokens",
        "coverage",
        "tokens_reused",
        "tokens_prefilled",
        "blocks_written",
        "bytes_written",
        "seconds",
        "warnings",
        "error",
        "cut",
    )
    entries = [
        {f: (list(getattr(e, f)) if f == "warnings" else getattr(e, f)) for f in fields}
        for e in report.entries
    ]
    return {
        "store": str(report.store),
        "model_digest": report.model_digest,
        **blocks.as_dict(),
        "built": report.count("built"),
        "reused": report.count("reused"),
        "failed": report.count("failed"),
        "tokens_prefilled": sum(e.tokens_prefilled for e in report.entries),
        "bytes_written": sum(e.bytes_written for e in report.entries),
        "seconds": round(report.seconds, 3),
        "problems": report.problems,
        "entries": entries,
    }


def print_build_report(out, report) -> None:
    """One row per entry, its warnings and failures, then the totals line."""
    from rich.table import Table

    table = Table(title=table_title(f"kvsnap build → {report.store}"))
    for col in (
        "agent",
        "status",
        "tokens",
        "reused",
        "prefilled",
        "coverage",
        "written",
        "seconds",
    ):
        table.add_column(col, justify="left" if col in ("agent", "status") else "right")
    for e in report.entries:
        table.add_row(
            e.name,
            e.status,
            str(e.n_tokens),
            str(e.tokens_reused),
            str(e.tokens_prefilled),
            f"{e.coverage:.0%}",
            human_bytes(e.bytes_written),
            f"{e.seconds:.2f}",
        )
    out.print(table)
    for e in report.entries:
        if e.cut and e.status != "failed":
            out.print(f"{e.name}: {e.n_tokens} tokens warmed, cut from the {e.cut}", markup=False)
        for w in e.warnings:
            out.print(f"warning: {w}", markup=False)
        if e.error:
            out.print(f"failed: {e.error}", markup=False)
    total_tokens = sum(e.n_tokens for e in report.entries if e.status != "failed")
    total_bytes = sum(e.bytes_written for e in report.entries)
    out.print(
        f"{report.count('built')} built, {report.count('reused')} reused, {report.count('failed')} "
        f"failed, "
        f"{len(report.problems)} invalid; {total_tokens} tokens, {human_bytes(total_bytes)} in "
        f"{report.seconds:.1f}s",
        markup=False,
    )
