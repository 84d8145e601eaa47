"""`kvsnap serve` (kvsnap's OpenAI-compatible server), `kvsnap vllm-mlx` and `kvsnap mlx-lm`
(vllm-mlx's and mlx-lm's own servers, started warm)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from kvsnap.commands.common import (
    EXIT_BAD,
    EXIT_OK,
    MODEL_HELP,
    REVISION_HELP,
    add_kv_options,
    kv_settings,
    port_number,
    positive_int,
)
from kvsnap.errors import KvsnapError, StoreError, UsageError
from kvsnap.http.tool_calls import REASONING_PARSERS
from kvsnap.store.tier_backends import PASSWORD_ENV, SECRET_ENV

log = logging.getLogger("kvsnap")


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server that starts warm from snapshots")
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument(
        "--model",
        dest="model_flag",
        metavar="MODEL",
        help="the model, as mlx_lm.server takes it: the same as the positional MODEL",
    )
    p.add_argument("--revision", metavar="REV", help=REVISION_HELP)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--continuous-batching",
        action="store_true",
        help="batch concurrent requests (mlx-lm BatchGenerator); without it requests run one at a "
        "time",
    )
    p.add_argument(
        "--warm-prompts",
        metavar="FILE",
        help="warm-prompt file: these prefixes are warm before /health says ok",
    )
    p.add_argument(
        "--kv-snapshots",
        metavar="DIR_OR_OCI",
        help="snapshot store to start warm from: a folder, or oci://HOST[:PORT]/REPO:TAG (pulled "
        "into a local cache first); prefilled warm prompts are written back when writable",
    )
    p.add_argument(
        "--no-write-back",
        action="store_true",
        help="never write prefilled warm prompts back to the store",
    )
    p.add_argument(
        "--warm-prompts-concurrency",
        type=positive_int,
        default=1,
        help="at most N warm-prompt prefills at once (default: 1)",
    )
    p.add_argument(
        "--cache-memory-mb",
        type=float,
        default=2048.0,
        help="prefix cache budget in MiB: pinned snapshots load up to it, the rest on first hit "
        "(default: 2048)",
    )
    p.add_argument(
        "--max-batch-size",
        type=positive_int,
        default=8,
        help="most requests decoding at once (default: 8)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=256,
        help="default max_tokens of a request (default: 256; mlx_lm.server's is 512)",
    )
    d = p.add_argument_group(
        "request defaults, for a request that leaves the field out (mlx_lm.server's flags)"
    )
    d.add_argument(
        "--temp",
        type=bounded_float(0.0, 2.0),
        default=0.0,
        help="default temperature; 0 is greedy (default: 0.0)",
    )
    d.add_argument(
        "--top-p",
        type=bounded_float(0.0, 1.0, low_open=True),
        default=1.0,
        help="default nucleus sampling top_p; 1 is off (default: 1.0)",
    )
    d.add_argument(
        "--top-k",
        type=non_negative_int,
        default=0,
        help="default top_k: sample among the K most likely tokens; 0 is off (default: 0)",
    )
    d.add_argument(
        "--min-p",
        type=bounded_float(0.0, 1.0),
        default=0.0,
        help="default min_p (relative to the most likely token); 0 is off (default: 0.0)",
    )
    d.add_argument(
        "--chat-template-args",
        metavar="JSON",
        default="{}",
        help="a JSON object of chat template variables, e.g. '{\"enable_thinking\": false}'; a "
        "request's chat_template_kwargs override it key by key (default: {})",
    )
    p.add_argument(
        "--record-agents",
        metavar="FILE",
        help="append each new distinct agent prefix this server answers (Anthropic system + "
        "tools, Responses instructions + developer items + tools, chat's leading system "
        "messages + tools) to FILE as a warm-prompt entry, for `kvsnap build FILE`; "
        "deduplicated, one entry per API key, at most 64 (docs/agents.md)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split <think>...</think> out of chat answers into reasoning_content: auto (the "
        "tokenizer's think markers), qwen3, or deepseek_r1 (reasoning from the first token); "
        "tool calls need no flag (default: off, think blocks stay in content)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model ids clients send, one or more (vLLM's flag); answers name the first; a "
        "request without model, or with mlx-lm's default_model, gets it too (default: the hub "
        "id, else the model folder's name)",
    )
    p.add_argument(
        "--allowed-origins",
        type=comma_list,
        metavar="ORIGINS",
        help="comma-separated browser origins answered with CORS headers (preflights too), e.g. "
        "https://app.example, or * for any (mlx_lm.server's flag; default: none, no CORS)",
    )
    lg = p.add_argument_group("logging")
    lg.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        help="least severe lines logged, kvsnap's and uvicorn's (default: info; debug with -v)",
    )
    lg.add_argument(
        "--no-access-log",
        action="store_true",
        help="no line per HTTP request (uvicorn's access log)",
    )
    g = p.add_argument_group("security and limits (docs/server.md#security)")
    g.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every endpoint but /health; repeatable. "
        "Prefer KVSNAP_API_KEY (comma-separated): arguments show in `ps`",
    )
    g.add_argument(
        "--admin-api-key",
        action="append",
        metavar="KEY",
        help="only these keys may DELETE /v1/cache/prefix and see every request in /v1/status; "
        "repeatable; or KVSNAP_ADMIN_API_KEY",
    )
    g.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=8 * 2**20,
        help="larger request bodies get 413 (default: 8 MiB)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=64,
        help="requests waiting beyond --max-batch-size before new ones get 429 (default: 64)",
    )
    g.add_argument(
        "--no-request-prefix-cache",
        action="store_true",
        help="never keep request prompts for reuse; only warm prompts are cached",
    )
    g.add_argument(
        "--max-messages",
        type=positive_int,
        default=2048,
        help="chat requests with more messages get 400 before anything is rendered (default: 2048)",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=512,
        help="most open client connections; at the cap a new one replaces the one waiting longest "
        "for its request head or body (default: 512; lowered to stay below the open-files limit)",
    )
    g.add_argument(
        "--header-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection whose request head (request line and headers) is not complete in "
        "this time (default: 10)",
    )
    g.add_argument(
        "--body-timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="close a connection whose request body is not complete this long after its head, "
        "however it trickles (default: 60)",
    )
    g.add_argument(
        "--write-timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="close a connection whose client has read none of its response for this long (the "
        "server's send buffer full the whole time), a streamed answer above all (default: 60)",
    )
    g.add_argument(
        "--cached-tokens-granularity",
        type=positive_int,
        default=128,
        help="with API keys, partial matches on prefixes shared between clients report "
        "cached_tokens in these steps (default: 128, as OpenAI; 1 = exact; exact without keys)",
    )
    c = p.add_argument_group("conversations that survive restarts (docs/conversations.md)")
    c.add_argument(
        "--persist-requests",
        action="store_true",
        help="write the request prefixes the cache keeps behind into --kv-snapshots, so the next "
        "turn of a conversation hits after a restart or a crash. Off by default: it writes "
        "clients' prompt state to disk (docs/server.md#security)",
    )
    c.add_argument(
        "--persist-max-gb",
        type=positive_number("GB"),
        metavar="GB",
        help="disk budget for persisted conversations; the least recently used go first "
        "(default: 20)",
    )
    c.add_argument(
        "--persist-flush-timeout",
        type=positive_float,
        metavar="SECONDS",
        help="at shutdown (SIGTERM), write the queued prefixes for at most this long (default: 5)",
    )
    f = p.add_argument_group("a fleet sharing conversations (docs/fleet.md)")
    f.add_argument(
        "--shared-tier",
        metavar="URL|DIR",
        help="with --persist-requests, write persisted conversations behind to a tier every "
        "replica shares (redis://HOST:PORT/DB, rediss:// for TLS, or a mounted folder) and "
        "fetch a conversation from it on a local miss when that is sooner than prefilling. "
        f"The password comes from the URL or ${PASSWORD_ENV}; set ${SECRET_ENV} on every "
        "replica so the tier holds no secret",
    )
    f.add_argument(
        "--shared-tier-budget",
        type=positive_float,
        metavar="SECONDS",
        help="the most a request waits on the tier before it prefills instead (default: 10)",
    )
    f.add_argument(
        "--shared-tier-queue-mb",
        type=positive_number("MB"),
        metavar="MB",
        help="bound on the bytes queued to write behind; past it the oldest are dropped "
        "(default: 1024)",
    )
    add_kv_options(p)
    p.set_defaults(run=cmd_serve)


# mlx_lm.server's flags that `kvsnap serve` has not, and what to do instead.
MLX_LM_ONLY_FLAGS = {
    "--chat-template": "kvsnap serve renders the model's own chat template, the one its "
    "snapshots are keyed on; put yours in the model folder's tokenizer_config.json "
    "(chat_template) or chat_template.jinja, then rebuild the snapshots",
    "--use-default-chat-template": "drop it: kvsnap serve renders the model's own chat "
    "template, the one its snapshots are keyed on",
    "--adapter-path": "kvsnap serve loads no adapter; fuse it into the model (mlx_lm.fuse) and "
    "serve the fused folder",
    "--draft-model": "kvsnap serve has no speculative decoding; drop it",
    "--num-draft-tokens": "kvsnap serve has no speculative decoding; drop it",
    "--trust-remote-code": "drop it: kvsnap serve runs no code from the model folder",
    "--decode-concurrency": "use --continuous-batching --max-batch-size N",
    "--prompt-concurrency": "use --continuous-batching --max-batch-size N",
    "--prompt-cache-size": "use --cache-memory-mb MB, the prefix cache's budget",
    "--prompt-cache-bytes": "use --cache-memory-mb MB, the prefix cache's budget",
    "--pipeline": "kvsnap serve is one process; serve a sharded model with `mlx.launch ... "
    "kvsnap mlx-lm serve --model M --kv-snapshots DIR --pipeline` (docs/distributed.md)",
}


def foreign_flag_hint(unknown: list[str]) -> str:
    """What to do instead of each mlx_lm.server flag among ``unknown`` (`--flag` or
    `--flag=value`), as the tail of the usage error; "" when there is none."""
    flags = dict.fromkeys(a.split("=", 1)[0] for a in unknown if a.startswith("--"))
    hints = [
        f"{f} is mlx_lm.server's: {MLX_LM_ONLY_FLAGS[f]}" for f in flags if f in MLX_LM_ONLY_FLAGS
    ]
    return "; " + "; ".join(hints) if hints else ""


def served_model(args) -> str:
    """The model to serve, given as `serve MODEL` or as mlx_lm.server users type it, `serve
    --model MODEL`; a KvsnapError when neither is given, or both name different models."""
    positional, flag = args.model, args.model_flag
    if positional is None and flag is None:
        names = args.served_model_name or []
        hint = (
            f" (--served-model-name took {' '.join(names)}: it takes every name up to the next "
            f"flag, so give the model before it)"
            if len(names) > 1
            else ""
        )
        raise KvsnapError(
            "no model given; name it as `kvsnap serve ORG/NAME|DIR` or `kvsnap serve --model "
            f"ORG/NAME|DIR`{hint}"
        )
    if positional is not None and flag is not None and positional != flag:
        raise KvsnapError(
            f"two models given: {positional!r} (positional) and --model {flag!r}; give one of "
            f"the two"
        )
    return positional if positional is not None else flag


def persist_options(args):
    """``--persist-requests`` and its settings as ``PersistOptions``, None when off; a
    UsageError for flags that contradict each other."""
    from kvsnap.runtime.persist import options

    conflicts = []
    if args.no_request_prefix_cache:
        conflicts.append(
            "persists the request prefixes the cache keeps, and --no-request-prefix-cache keeps "
            "none"
        )
    persist = options.persist_options(
        args.persist_requests,
        args.persist_max_gb,
        args.persist_flush_timeout,
        has_store=bool(args.kv_snapshots),
        conflicts=conflicts,
    )
    tier = shared_tier_options(args, persist is not None)
    if persist is not None:
        persist.shared_tier = tier
    return persist


def shared_tier_options(args, persisting: bool):
    """``--shared-tier`` and its settings as ``TierOptions`` (checked, nothing contacted),
    None when off; a UsageError naming the flag and the fix."""
    from kvsnap.runtime.persist import options
    from kvsnap.store.tier_backends import fleet_secret_from_env, open_backend

    given = [
        (flag, value)
        for flag, value in (
            ("--shared-tier-budget", args.shared_tier_budget),
            ("--shared-tier-queue-mb", args.shared_tier_queue_mb),
        )
        if value is not None
    ]
    if not args.shared_tier:
        if given:
            raise UsageError(f"{given[0][0]} needs --shared-tier URL|DIR; add it or drop the flag")
        return None
    if not persisting:
        raise UsageError(
            "--shared-tier shares what --persist-requests writes; add --persist-requests "
            "(and --kv-snapshots DIR, the local store it writes first)"
        )
    budget = args.shared_tier_budget or options.DEFAULT_TIER_BUDGET_S
    if budget > 600:
        raise UsageError(f"--shared-tier-budget {budget:g} must be at most 600 seconds")
    fleet_secret_from_env()  # a too-short secret fails here, not at the first request
    open_backend(args.shared_tier, budget).close()
    return options.TierOptions(
        spec=args.shared_tier,
        budget_s=budget,
        queue_bytes=int((args.shared_tier_queue_mb or 1024) * 2**20),
    )


LOG_LEVELS = ("debug", "info", "warning", "error")


def bounded_float(low: float, high: float, low_open: bool = False):
    """An argparse type: a number in [low, high] ((low, high] with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"{text} is outside {bracket}{low}, {high}]")
        return value

    return parse


def comma_list(text: str) -> list[str]:
    """An argparse type: comma-separated values, blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return value


def chat_template_args(text: str) -> dict:
    """``--chat-template-args``: a JSON object, or a KvsnapError naming the flag, the value
    and the fix."""
    example = "--chat-template-args '{\"enable_thinking\": false}'"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvsnapError(
            f"--chat-template-args {text!r}: not JSON ({exc.msg} at character {exc.pos}); give "
            f"a JSON object, e.g. {example}"
        ) from None
    if not isinstance(value, dict):
        raise KvsnapError(
            f"--chat-template-args {text!r}: a JSON {type(value).__name__}, not an object; give "
            f"an object of template variables, e.g. {example}"
        )
    return value


def log_level(args) -> int:
    """--log-level, else -v's debug, else info; set on the root logger (kvsnap's lines and,
    through it, uvicorn's)."""
    name = args.log_level or ("debug" if args.verbose else "info")
    level = getattr(logging, name.upper())
    logging.getLogger().setLevel(level)
    return level


def positive_number(unit: str):
    """An argparse type: a finite number above 0, the error naming ``unit``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {unit}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text} must be a positive number of {unit}")
        return value

    return parse


positive_float = positive_number("seconds")


def cmd_serve(args) -> int:
    from kvsnap.runtime.sharding.launch import refuse_sharded

    # Continuous batching, persistence and re-warm each decide per process; ranks would diverge.
    refuse_sharded(
        "kvsnap serve",
        "serve a sharded model with `mlx.launch ... kvsnap mlx-lm serve --model M "
        "--kv-snapshots DIR [--pipeline]`, which starts every rank warm (docs/distributed.md)",
    )
    from kvsnap.http.agent_recorder import AgentRecorder
    from kvsnap.http.connections import (
        ConnectionGuard,
        effective_max_connections,
        raise_open_files_limit,
    )
    from kvsnap.http.guard import Auth
    from kvsnap.http.listen import bind_socket, make_server, uvicorn_log_config
    from kvsnap.http.server import create_app
    from kvsnap.http.watch import exit_when_warm_up_fails, is_loopback
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.runtime.engine.engine import Engine
    from kvsnap.runtime.model.loading import resolve_model
    from kvsnap.store.opening import check_store_folder
    from kvsnap.store.remote import check_kv_snapshots, resolve_kv_snapshots

    args.model = served_model(args)
    level = log_level(args)
    template_args = chat_template_args(args.chat_template_args)
    check_kv_snapshots(args.kv_snapshots)  # an unknown scheme fails before the model is resolved
    auth = Auth.from_flags(args.api_key, args.admin_api_key)
    if args.max_queued_requests < 0:
        raise KvsnapError(f"--max-queued-requests {args.max_queued_requests} must be 0 or more")
    sock = bind_socket(args.host, args.port)  # a busy port fails now, not after the model loads
    source = resolve_model(args.model, args.revision)
    if not auth.enabled and not is_loopback(args.host):
        log.warning(
            "[kvsnap] serving on %s without API keys: anyone who can reach this port can use and "
            "clear the cache; set KVSNAP_API_KEY",
            args.host,
        )
    if args.kv_snapshots and "://" not in args.kv_snapshots:
        # a file or another folder is refused before the model loads (store.opening's policy)
        try:
            check_store_folder(args.kv_snapshots)
        except StoreError as exc:
            raise KvsnapError(f"--kv-snapshots {args.kv_snapshots}: {exc} (or oci://…)") from None
    persist_options(args)  # contradicting flags fail before the model loads
    prompts = load_warm_prompts(args.warm_prompts) if args.warm_prompts else None
    # a file that is not a list of entries fails now, not on the first request
    recorder = AgentRecorder(Path(args.record_agents)) if args.record_agents else None
    for problem in prompts.problems if prompts else []:
        log.warning("[kvsnap] skipped warm prompt %s", problem)
    # a remote URL (oci://…) is pulled into a local cache folder first
    args.kv_snapshots = resolve_kv_snapshots(args.kv_snapshots)
    engine = Engine(engine_config(args, source.path, prompts))
    server_config = serve_config(args, source, auth, template_args)
    engine.start()  # load the model on the main thread, before the port opens
    warn_without_openblas()
    # After the load: importing mlx-lm sets the open-files limit itself (2048, hard 4096).
    max_connections = effective_max_connections(args.max_connections, raise_open_files_limit())
    guard = ConnectionGuard(
        max_connections=max_connections,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        write_timeout_s=args.write_timeout,
    )
    server = make_server(
        create_app(engine, server_config, recorder),
        guard,
        log_level=level,
        log_config=uvicorn_log_config(),
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=5,
    )
    exit_when_warm_up_fails(engine, server)
    log.info(
        "[kvsnap] listening on http://%s:%d (at most %d connections)",
        args.host,
        args.port,
        max_connections,
    )
    server.run(sockets=[sock])
    if engine.failed:
        print(f"kvsnap serve: error: warm-up failed: {engine.failed}", file=sys.stderr)
        return EXIT_BAD
    return EXIT_OK


def warn_without_openblas() -> None:
    """Once mlx is loaded: on Linux without OpenBLAS, CPU matmuls are several times slower."""
    from kvsnap.blas import openblas_warning

    warning = openblas_warning()
    if warning:
        log.warning("[kvsnap] %s", warning)


def engine_config(args, model_dir: Path, prompts):
    """The engine's settings from the serve flags (``args.kv_snapshots`` already a local folder)."""
    from kvsnap.runtime.engine.engine import EngineConfig
    from kvsnap.runtime.model.loading import default_digest_cache

    return EngineConfig(
        model=str(model_dir),
        settings=kv_settings(args),
        warm_prompts=prompts,
        warm_prompts_file=args.warm_prompts,
        snapshots=args.kv_snapshots,
        write_back=not args.no_write_back,
        warm_prompts_concurrency=args.warm_prompts_concurrency,
        cache_memory_mb=args.cache_memory_mb,
        continuous_batching=args.continuous_batching,
        max_batch_size=args.max_batch_size if args.continuous_batching else 1,
        digest_cache=default_digest_cache(),
        persist=persist_options(args),
    )


def serve_config(args, source, auth, template_args: dict | None = None):
    """The HTTP layer's settings: the served name, limits, keys and request defaults."""
    from kvsnap.http.context import SamplingDefaults
    from kvsnap.http.limits import context_length
    from kvsnap.http.server import ServerConfig

    model_dir = source.path
    config_json = json.loads((model_dir / "config.json").read_text())
    names = args.served_model_name or []
    name = (
        (names[0] if names else None)
        or source.repo_id
        or Path(args.model).expanduser().name
        or model_dir.name
    )
    max_batch = args.max_batch_size if args.continuous_batching else 1
    return ServerConfig(
        served_model_name=name,
        more_model_names=tuple(names[1:]),
        model_aliases=(args.model, str(model_dir)),
        default_max_tokens=args.max_tokens,
        context_length=context_length(config_json),
        auth=auth,
        max_request_bytes=args.max_request_bytes,
        max_inflight=max_batch + args.max_queued_requests,
        request_prefix_cache=not args.no_request_prefix_cache,
        cached_tokens_granularity=args.cached_tokens_granularity,
        max_messages=args.max_messages,
        sampling=SamplingDefaults(args.temp, args.top_p, args.top_k, args.min_p),
        chat_template_args=template_args or {},
        reasoning_parser=args.reasoning_parser,
        allowed_origins=tuple(args.allowed_origins or ()),
    )


def add_vllm_mlx(sub) -> None:
    p = sub.add_parser(
        "vllm-mlx",
        help="run vllm-mlx's own server warm from a store: kvsnap vllm-mlx serve MODEL [its flags] "
        "--kv-snapshots DIR",
        description="Run vllm-mlx's own server (installed beside kvsnap) with the store's "
        "snapshots of MODEL in its prefix cache before it accepts requests. "
        "Every argument but --kv-snapshots goes to `vllm-mlx serve` unchanged; `kvsnap vllm-mlx "
        "serve --help` shows both. See docs/vllm-mlx.md.",
    )
    p.add_argument(
        "vllm_mlx_args",
        nargs=argparse.REMAINDER,
        metavar="serve MODEL [vllm-mlx flags] --kv-snapshots DIR",
    )
    p.set_defaults(run=cmd_vllm_mlx)


def cmd_vllm_mlx(args) -> int:
    from kvsnap.integrations.vllm_mlx.launcher import main as vllm_mlx_main
    from kvsnap.runtime.sharding.launch import refuse_sharded

    refuse_sharded(
        "kvsnap vllm-mlx",
        "vllm-mlx has no sharded mode; serve a sharded model with `mlx.launch ... kvsnap "
        "mlx-lm serve --model M --kv-snapshots DIR [--pipeline]` (docs/distributed.md)",
    )

    # vllm-mlx logs through the root logger: give its lines a time, level and source, like `serve`.
    logging.basicConfig(
        force=True,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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


def add_mlx_lm(sub) -> None:
    p = sub.add_parser(
        "mlx-lm",
        help="run mlx-lm's own server warm from a store: "
        "kvsnap mlx-lm serve --model MODEL [its flags] --kv-snapshots DIR",
        description="Run mlx_lm.server with the store's snapshots of MODEL in its prompt "
        "cache before the port opens. Every argument but --kv-snapshots and --warm-prompts "
        "goes to mlx_lm.server unchanged; `kvsnap mlx-lm serve --help` shows both. "
        "See docs/mlx-lm.md.",
    )
    p.add_argument(
        "mlx_lm_args",
        nargs=argparse.REMAINDER,
        metavar="serve --model MODEL [mlx_lm.server flags] --kv-snapshots DIR",
    )
    p.set_defaults(run=cmd_mlx_lm)


def cmd_mlx_lm(args) -> int:
    from kvsnap.integrations.mlx_lm.launcher import main as mlx_lm_main

    rc = mlx_lm_main(args.mlx_lm_args)
    if args.mlx_lm_args[:1] == ["serve"]:
        # As for vllm-mlx: a thread that ran mlx work ending in interpreter finalization
        # can abort the process; mlx_lm.server has already shut down cleanly here.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    return rc
