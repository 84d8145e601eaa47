"""`kvsnap serve`'s options, declared once: ``SERVE_OPTIONS``, one ``Option`` per flag (flags,
type, default, help, the default docs/server.md's and docs/cli.md's tables write, the config field
it fills). The parser is built from it (``add_options``), and so are the config objects
(``config_fields``); tests/commands/test_serve_options.py checks the docs' tables against it."""

from __future__ import annotations

import argparse
from typing import Callable

from kvsnap.commands.common import KV_OPTIONS, MODEL_HELP, REVISION_HELP, port_number, positive_int
from kvsnap.commands.serve_checks import chat_template_args
from kvsnap.http.tool_calls import REASONING_PARSERS
from kvsnap.integrations.common.argv import positive_number
from kvsnap.integrations.common.options import (
    KV_SNAPSHOTS,
    PERSIST_FLUSH_TIMEOUT,
    PERSIST_MAX_GB,
    PERSIST_REQUESTS,
    WARM_PROMPTS,
    Option,
)
from kvsnap.store.tier_backends import PASSWORD_ENV, SECRET_ENV

LOG_LEVELS = ("debug", "info", "warning", "error")


def bounded_float(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
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


def threads_or_auto(text: str) -> int | None:
    """An argparse type: ``auto`` (None) or a thread count, 0 or more."""
    if text.strip().lower() == "auto":
        return None
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither auto nor a whole number of threads (0: OpenBLAS's own count)"
        ) from None


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return value


positive_float = positive_number("seconds")


def batch_slots(args) -> int:
    """Requests decoding at once: --max-batch-size with --continuous-batching, else 1."""
    return args.max_batch_size if args.continuous_batching else 1


# The config objects an option's ``fills`` names ("CONFIG.FIELD"), as "module:class".
CONFIG_OBJECTS = (
    ("engine", "kvsnap.runtime.engine.types:EngineConfig"),
    ("server", "kvsnap.http.config:ServerConfig"),
    ("sampling", "kvsnap.http.config:SamplingDefaults"),
    ("guard", "kvsnap.http.connections:ConnectionGuard"),
    ("uvicorn", "uvicorn:Config"),
    ("kv", "kvsnap.key:KVSettings"),
)

DEFAULTS_GROUP = "request defaults, for a request that leaves the field out (mlx_lm.server's flags)"
LOGGING_GROUP = "logging"
SECURITY_GROUP = "security and limits (docs/server.md#security)"
FLEET_GROUP = "a fleet sharing conversations (docs/fleet.md)"

# In --help order; a row with ``fills`` is copied into that config field by config_fields.
SERVE_OPTIONS = (
    Option(("model",), nargs="?", help=MODEL_HELP),
    Option(
        ("--model",),
        dest="model_flag",
        metavar="MODEL",
        help="the model, as mlx_lm.server takes it: the same as the positional MODEL",
    ),
    Option(("--revision",), metavar="REV", doc_default="main", help=REVISION_HELP),
    Option(
        ("--host",),
        default="127.0.0.1",
        doc_default="127.0.0.1",
        help="bind address (default: 127.0.0.1)",
    ),
    Option(
        ("--port",), type=port_number, default=8000, doc_default="8000", help="port (default: 8000)"
    ),
    Option(
        ("--continuous-batching",),
        action="store_true",
        doc_default="off",
        fills="engine.continuous_batching",
        help="batch concurrent requests (mlx-lm BatchGenerator); without it requests run one at a "
        "time",
    ),
    WARM_PROMPTS,
    KV_SNAPSHOTS,
    Option(
        ("--no-write-back",),
        action="store_true",
        doc_default="off",
        fills="engine.write_back",
        convert=lambda value, args: not value,
        help="never write prefilled warm prompts back to the store",
    ),
    Option(
        ("--warm-prompts-concurrency",),
        type=positive_int,
        default=1,
        doc_default="1",
        fills="engine.warm_prompts_concurrency",
        help="at most N warm-prompt prefills at once (default: 1)",
    ),
    Option(
        ("--cache-memory-mb",),
        type=float,
        default=2048.0,
        doc_default="2048",
        fills="engine.cache_memory_mb",
        help="prefix cache budget in MiB: pinned snapshots load up to it, the rest on first hit "
        "(default: 2048)",
    ),
    Option(
        ("--max-batch-size",),
        type=positive_int,
        default=8,
        doc_default="8",
        fills="engine.max_batch_size",
        convert=lambda value, args: batch_slots(args),
        help="most requests decoding at once (default: 8)",
    ),
    Option(
        ("--decode-blas-threads",),
        metavar="N",
        type=threads_or_auto,
        default=None,
        doc_default="auto",
        fills="engine.decode_blas_threads",
        help="OpenBLAS threads for a batch step that only decodes (Linux CPU; default: auto, "
        "the cores other processes leave idle; 0: OpenBLAS's own count): on busy cores a "
        "decode step's thin matmuls wait for each thread's wake-up",
    ),
    Option(
        ("--max-tokens",),
        type=positive_int,
        default=256,
        doc_default="256",
        fills="server.default_max_tokens",
        help="default max_tokens of a request (default: 256; mlx_lm.server's is 512)",
    ),
    Option(
        ("--temp",),
        type=bounded_float(0.0, 2.0),
        default=0.0,
        group=DEFAULTS_GROUP,
        doc_default="0.0",
        fills="sampling.temperature",
        help="default temperature; 0 is greedy (default: 0.0)",
    ),
    Option(
        ("--top-p",),
        type=bounded_float(0.0, 1.0, low_open=True),
        default=1.0,
        group=DEFAULTS_GROUP,
        doc_default="1.0",
        fills="sampling.top_p",
        help="default nucleus sampling top_p; 1 is off (default: 1.0)",
    ),
    Option(
        ("--top-k",),
        type=non_negative_int,
        default=0,
        group=DEFAULTS_GROUP,
        doc_default="0",
        fills="sampling.top_k",
        help="default top_k: sample among the K most likely tokens; 0 is off (default: 0)",
    ),
    Option(
        ("--min-p",),
        type=bounded_float(0.0, 1.0),
        default=0.0,
        group=DEFAULTS_GROUP,
        doc_default="0.0",
        fills="sampling.min_p",
        help="default min_p (relative to the most likely token); 0 is off (default: 0.0)",
    ),
    Option(
        ("--chat-template-args",),
        metavar="JSON",
        default="{}",
        group=DEFAULTS_GROUP,
        doc_default="`{}`",
        fills="server.chat_template_args",
        convert=lambda text, args: chat_template_args(text),
        help="a JSON object of chat template variables, e.g. '{\"enable_thinking\": false}'; a "
        "request's chat_template_kwargs override it key by key (default: {})",
    ),
    Option(
        ("--record-agents",),
        metavar="FILE",
        doc_default="off",
        help="append each new distinct agent prefix this server answers (Anthropic system + "
        "tools, Responses instructions + developer items + tools, chat's leading system "
        "messages + tools) to FILE as a warm-prompt entry, for `kvsnap build FILE`; "
        "deduplicated, one entry per API key, at most 64 (docs/agents.md)",
    ),
    Option(
        ("--reasoning-parser",),
        choices=REASONING_PARSERS,
        doc_default="off",
        fills="server.reasoning_parser",
        help="split <think>...</think> out of chat answers into reasoning_content: auto (the "
        "tokenizer's think markers), qwen3, or deepseek_r1 (reasoning from the first token); "
        "tool calls need no flag (default: off, think blocks stay in content)",
    ),
    Option(
        ("--served-model-name",),
        nargs="+",
        metavar="NAME",
        doc_default="the hub id, else the folder name",
        # the first name is served_model_name, chosen with the model source (serve_config)
        fills="server.more_model_names",
        convert=lambda names, args: tuple((names or [])[1:]),
        help="model ids clients send, one or more (vLLM's flag); answers name the first; a "
        "request without model, or with mlx-lm's default_model, gets it too (default: the hub "
        "id, else the model folder's name)",
    ),
    Option(
        ("--allowed-origins",),
        type=comma_list,
        metavar="ORIGINS",
        doc_default="none (no CORS)",
        fills="server.allowed_origins",
        convert=lambda origins, args: tuple(origins or ()),
        help="comma-separated browser origins answered with CORS headers (preflights too), e.g. "
        "https://app.example, or * for any (mlx_lm.server's flag; default: none, no CORS)",
    ),
    Option(
        ("--log-level",),
        type=str.lower,
        choices=LOG_LEVELS,
        group=LOGGING_GROUP,
        doc_default="info (debug with `-v`)",
        help="least severe lines logged, kvsnap's and uvicorn's (default: info; debug with -v)",
    ),
    Option(
        ("--no-access-log",),
        action="store_true",
        group=LOGGING_GROUP,
        doc_default="off",
        fills="uvicorn.access_log",
        convert=lambda value, args: not value,
        help="no line per HTTP request (uvicorn's access log)",
    ),
    Option(
        ("--api-key",),
        action="append",
        metavar="KEY",
        group=SECURITY_GROUP,
        doc_default="none (open)",
        help="require `Authorization: Bearer KEY` on every endpoint but /health; repeatable. "
        "Prefer KVSNAP_API_KEY (comma-separated): arguments show in `ps`",
    ),
    Option(
        ("--admin-api-key",),
        action="append",
        metavar="KEY",
        group=SECURITY_GROUP,
        doc_default="none",
        help="only these keys may DELETE /v1/cache/prefix and see every request in /v1/status; "
        "repeatable; or KVSNAP_ADMIN_API_KEY",
    ),
    Option(
        ("--max-request-bytes",),
        type=positive_int,
        default=8 * 2**20,
        group=SECURITY_GROUP,
        doc_default="8 MiB",
        fills="server.max_request_bytes",
        help="larger request bodies get 413 (default: 8 MiB)",
    ),
    Option(
        ("--max-queued-requests",),
        type=int,
        default=64,
        group=SECURITY_GROUP,
        doc_default="64",
        fills="server.max_inflight",
        convert=lambda queued, args: batch_slots(args) + queued,
        help="requests waiting beyond --max-batch-size before new ones get 429 (default: 64)",
    ),
    Option(
        ("--no-request-prefix-cache",),
        action="store_true",
        group=SECURITY_GROUP,
        doc_default="off",
        fills="server.request_prefix_cache",
        convert=lambda value, args: not value,
        help="never keep request prompts for reuse; only warm prompts are cached",
    ),
    Option(
        ("--max-messages",),
        type=positive_int,
        default=2048,
        group=SECURITY_GROUP,
        doc_default="2048",
        fills="server.max_messages",
        help="chat requests with more messages get 400 before anything is rendered (default: 2048)",
    ),
    Option(
        ("--max-connections",),
        type=positive_int,
        default=512,
        group=SECURITY_GROUP,
        doc_default="512",
        # lowered at start to stay below the open-files limit (cmd_serve)
        fills="guard.max_connections",
        help="most open client connections; at the cap a new one replaces the one waiting longest "
        "for its request head or body (default: 512; lowered to stay below the open-files limit)",
    ),
    Option(
        ("--header-timeout",),
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        group=SECURITY_GROUP,
        doc_default="10",
        fills="guard.header_timeout_s",
        help="close a connection whose request head (request line and headers) is not complete in "
        "this time (default: 10)",
    ),
    Option(
        ("--body-timeout",),
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        group=SECURITY_GROUP,
        doc_default="60",
        fills="guard.body_timeout_s",
        help="close a connection whose request body is not complete this long after its head, "
        "however it trickles (default: 60)",
    ),
    Option(
        ("--write-timeout",),
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        group=SECURITY_GROUP,
        doc_default="60",
        fills="guard.write_timeout_s",
        help="close a connection whose client has read none of its response for this long (the "
        "server's send buffer full the whole time), a streamed answer above all (default: 60)",
    ),
    Option(
        ("--cached-tokens-granularity",),
        type=positive_int,
        default=128,
        group=SECURITY_GROUP,
        doc_default="128",
        fills="server.cached_tokens_granularity",
        help="with API keys, partial matches on prefixes shared between clients report "
        "cached_tokens in these steps (default: 128, as OpenAI; 1 = exact; exact without keys)",
    ),
    PERSIST_REQUESTS,
    PERSIST_MAX_GB,
    PERSIST_FLUSH_TIMEOUT,
    Option(
        ("--shared-tier",),
        metavar="URL|DIR",
        group=FLEET_GROUP,
        doc_default="off",
        help="with --persist-requests, write persisted conversations behind to a tier every "
        "replica shares (redis://HOST:PORT/DB, rediss:// for TLS, or a mounted folder) and "
        "fetch a conversation from it on a local miss when that is sooner than prefilling. "
        f"The password comes from the URL or ${PASSWORD_ENV}; set ${SECRET_ENV} on every "
        "replica so the tier holds no secret",
    ),
    Option(
        ("--shared-tier-budget",),
        type=positive_float,
        metavar="SECONDS",
        group=FLEET_GROUP,
        doc_default="10",
        help="the most a request waits on the tier before it prefills instead (default: 10)",
    ),
    Option(
        ("--shared-tier-queue-mb",),
        type=positive_number("MB"),
        metavar="MB",
        group=FLEET_GROUP,
        doc_default="1024",
        help="bound on the bytes queued to write behind; past it the oldest are dropped "
        "(default: 1024)",
    ),
    *KV_OPTIONS,
)


# mlx_lm.server's flags that `kvsnap serve` has not, and what to do instead.
MLX_LM_ONLY_FLAGS = (
    (
        "--chat-template",
        "kvsnap serve renders the model's own chat template, the one its "
        "snapshots are keyed on; put yours in the model folder's tokenizer_config.json "
        "(chat_template) or chat_template.jinja, then rebuild the snapshots",
    ),
    (
        "--use-default-chat-template",
        "drop it: kvsnap serve renders the model's own chat "
        "template, the one its snapshots are keyed on",
    ),
    (
        "--adapter-path",
        "kvsnap serve loads no adapter; fuse it into the model (mlx_lm.fuse) and "
        "serve the fused folder",
    ),
    ("--draft-model", "kvsnap serve has no speculative decoding; drop it"),
    ("--num-draft-tokens", "kvsnap serve has no speculative decoding; drop it"),
    ("--trust-remote-code", "drop it: kvsnap serve runs no code from the model folder"),
    ("--decode-concurrency", "use --continuous-batching --max-batch-size N"),
    ("--prompt-concurrency", "use --continuous-batching --max-batch-size N"),
    ("--prompt-cache-size", "use --cache-memory-mb MB, the prefix cache's budget"),
    ("--prompt-cache-bytes", "use --cache-memory-mb MB, the prefix cache's budget"),
    (
        "--pipeline",
        "kvsnap serve is one process; serve a sharded model with `mlx.launch ... "
        "kvsnap mlx-lm serve --model M --kv-snapshots DIR --pipeline` (docs/distributed.md)",
    ),
)


def foreign_flag_hint(unknown: list[str]) -> str:
    """What to do instead of each mlx_lm.server flag among ``unknown`` (`--flag` or
    `--flag=value`), as the tail of the usage error; "" when there is none."""
    instead = dict(MLX_LM_ONLY_FLAGS)
    flags = dict.fromkeys(a.split("=", 1)[0] for a in unknown if a.startswith("--"))
    hints = [f"{f} is mlx_lm.server's: {instead[f]}" for f in flags if f in instead]
    return "; " + "; ".join(hints) if hints else ""
