"""A command-line option declared once (``Option``): its flags, type, default, help, the default
the docs' tables write, the config field it fills, and the upstream routes that take it too.
`kvsnap serve`'s parser and config objects are built from a tuple of them
(``kvsnap/commands/serve_options.py``); the rows both routes share are declared here, below the
command line, so that a route's launcher reads them without importing the CLI."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvsnap.integrations.common.argv import OPTION, WARM_OPTION, positive_number


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]  # ("--port",), or ("model",) for a positional
    help: str
    default: Any = None  # what the parser leaves when the flag is absent (None: argparse's)
    type: Callable[[str], Any] | None = None
    action: str | None = None  # "store_true", "append"
    dest: str | None = None
    metavar: str | None = None
    choices: Sequence[Any] | None = None
    nargs: str | None = None
    group: str = ""  # the --help section it is listed under ("": the command's own)
    doc_default: str = ""  # the default as the docs' option table writes it
    # "CONFIG.FIELD" (CONFIG one of serve_options.CONFIG_OBJECTS): the config field the value
    # fills; "": read by a start-up check or serve's orchestration instead
    fills: str = ""
    convert: Callable[[Any, Any], Any] | None = None  # (value, all the args) -> the field's value
    routes: tuple[str, ...] = ()  # the upstream routes (`kvsnap ROUTE serve`) that take it too
    needs: str = ""  # a route's error for the flag without its value: "--flag needs NEEDS"
    route_usage: tuple[tuple[str, str], ...] = ()  # (route, its lines in that route's usage)

    @property
    def flag(self) -> str:
        return self.flags[0]

    @property
    def name(self) -> str:
        """The attribute of the parsed arguments that holds the value."""
        return self.dest or self.flag.lstrip("-").replace("-", "_")

    def argparse_kwargs(self) -> dict[str, Any]:
        given = {
            "action": self.action,
            "type": self.type,
            "default": self.default,
            "dest": self.dest,
            "nargs": self.nargs,
            "choices": self.choices,
            "metavar": self.metavar,
            "help": self.help,
        }
        return {key: value for key, value in given.items() if value is not None}


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Every option on ``parser`` in order, each in its ``group`` (made on first use)."""
    groups: dict[str, Any] = {"": parser}
    for option in options:
        if option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        groups[option.group].add_argument(*option.flags, **option.argparse_kwargs())


def config_fields(options: Sequence[Option], args: Any, config: str) -> dict[str, Any]:
    """The fields of the config object ``config`` that ``options`` fill, from the parsed
    ``args``: ``{field: value}``, ready for the object's constructor."""
    fields = {}
    for option in options:
        owner, _, field = option.fills.partition(".")
        if owner == config:
            value = getattr(args, option.name)
            fields[field] = option.convert(value, args) if option.convert else value
    return fields


def route_options(route: str, options: Sequence[Option]) -> tuple[Option, ...]:
    """The options of ``options`` that ``kvsnap ROUTE serve`` takes out of upstream's args."""
    return tuple(option for option in options if route in option.routes)


def route_usage(route: str, options: Sequence[Option]) -> str:
    """The lines of ``route``'s usage that describe ``options``, in order."""
    return "".join(dict(option.route_usage)[route] for option in route_options(route, options))


PERSIST_GROUP = "conversations that survive restarts (docs/conversations.md)"

KV_SNAPSHOTS = Option(
    (OPTION,),
    metavar="DIR_OR_OCI",
    help="snapshot store to start warm from: a folder, or oci://HOST[:PORT]/REPO:TAG (pulled "
    "into a local cache first); prefilled warm prompts are written back when writable",
    fills="engine.snapshots",
    routes=("vllm-mlx", "mlx-lm"),
    needs="a directory, e.g. --kv-snapshots ./snaps",
    route_usage=(
        (
            "vllm-mlx",
            "  --kv-snapshots DIR   a store made by `kvsnap build --for vllm-mlx` run under the "
            "same mlx-lm\n"
            "                      minor as vllm-mlx (0.31.x for vllm-mlx 0.6), or "
            "oci://HOST/REPO:TAG\n"
            "                      to pull one first (see docs/deploy.md); needs "
            "--continuous-batching\n",
        ),
        (
            "mlx-lm",
            "  --kv-snapshots DIR   a store made by `kvsnap build --for mlx-lm`, or "
            "oci://HOST/REPO:TAG\n",
        ),
    ),
)
WARM_PROMPTS = Option(
    (WARM_OPTION,),
    metavar="FILE",
    help="warm-prompt file: these prefixes are warm before /health says ok",
    fills="engine.warm_prompts_file",
    routes=("vllm-mlx", "mlx-lm"),
    needs="a file, e.g. --warm-prompts agents.json",
    route_usage=(
        (
            "vllm-mlx",
            "  --warm-prompts FILE  with --kv-snapshots: warm exactly these entries (vllm-mlx's "
            "file shape or\n"
            "                      kvsnap's), each from its snapshot, or prefilled once and "
            "written back\n"
            "                      to the store when it is writable; vllm-mlx's own warm-up "
            "does not run\n",
        ),
        (
            "mlx-lm",
            "  --warm-prompts FILE  with --kv-snapshots: warm exactly these entries, each from "
            "its snapshot, or\n"
            "                      prefilled once on the loaded model and written back to the "
            "store\n"
            "                      when it is writable (the next start prefills nothing)\n",
        ),
    ),
)
PERSIST_REQUESTS = Option(
    ("--persist-requests",),
    action="store_true",
    group=PERSIST_GROUP,
    doc_default="off",
    help="write the request prefixes the cache keeps behind into --kv-snapshots, so the next "
    "turn of a conversation hits after a restart or a crash. Off by default: it writes "
    "clients' prompt state to disk (docs/server.md#security)",
    routes=("vllm-mlx",),
    route_usage=(
        (
            "vllm-mlx",
            "  --persist-requests  with --kv-snapshots: write the prefix entries vllm-mlx keeps "
            "behind into\n"
            "                      DIR, so the next turn of a conversation hits after a restart "
            "or a\n"
            "                      crash (off by default: it writes clients' prompt state to "
            "disk)\n",
        ),
    ),
)
PERSIST_MAX_GB = Option(
    ("--persist-max-gb",),
    type=positive_number("GB"),
    metavar="GB",
    group=PERSIST_GROUP,
    doc_default="20",
    help="disk budget for persisted conversations; the least recently used go first (default: 20)",
    routes=("vllm-mlx",),
    needs="a positive number, e.g. --persist-max-gb 5",
    route_usage=(
        (
            "vllm-mlx",
            "  --persist-max-gb GB  disk budget for those conversations, least recently used go "
            "first\n"
            "                      (default: 20)\n",
        ),
    ),
)
PERSIST_FLUSH_TIMEOUT = Option(
    ("--persist-flush-timeout",),
    type=positive_number("seconds"),
    metavar="SECONDS",
    group=PERSIST_GROUP,
    doc_default="5",
    help="at shutdown (SIGTERM), write the queued prefixes for at most this long (default: 5)",
    routes=("vllm-mlx",),
    needs="a positive number, e.g. --persist-flush-timeout 5",
    route_usage=(
        (
            "vllm-mlx",
            "  --persist-flush-timeout S\n"
            "                      at shutdown, write what is queued for at most S seconds "
            "(default: 5)\n",
        ),
    ),
)
# What `kvsnap serve` shares with the routes, in their usage's order.
ROUTE_OPTIONS = (
    KV_SNAPSHOTS,
    WARM_PROMPTS,
    PERSIST_REQUESTS,
    PERSIST_MAX_GB,
    PERSIST_FLUSH_TIMEOUT,
)
