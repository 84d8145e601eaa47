"""What every subcommand shares: exit codes, the KV options build and serve must agree on, output
helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Iterator

from kvsnap.integrations.common.options import Option, add_options, config_fields
from kvsnap.key import DEFAULT_PREFILL_STEP, KVSettings

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2
# What a shell reports for a program killed by SIGPIPE: the reader (`| head`) closed the pipe.
EXIT_PIPE_CLOSED = 141
# Rows printed to a file or pipe (CI logs, `| tee`) are never wrapped or cut below this width.
UNWRAPPED_WIDTH = 10_000

MODEL_HELP = (
    "hub id (org/name, from the Hugging Face cache as mlx-lm resolves it) or local mlx-lm "
    "model folder"
)
REVISION_HELP = "hub revision: branch, tag or commit (default: main); only with a hub id"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (a socket would take 99999 as 34463)."""
    from kvsnap.integrations.common.argv import port_problem

    problem = port_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return int(text)


KV_GROUP = "KV cache settings (build and serve must agree)"
# The KV options of build, serve and verify --model, declared once (docs/cli.md's KV table).
KV_OPTIONS = (
    Option(
        ("--kv-bits",),
        type=int,
        choices=(2, 3, 4, 5, 6, 8),
        group=KV_GROUP,
        doc_default="off",
        fills="kv.kv_bits",
        help="quantize the KV cache to this many bits (default: off)",
    ),
    Option(
        ("--kv-group-size",),
        type=positive_int,
        default=64,
        group=KV_GROUP,
        doc_default="64",
        fills="kv.kv_group_size",
        help="KV quantization group size; must divide the head dim (default: 64)",
    ),
    Option(
        ("--quantized-kv-start",),
        type=int,
        default=0,
        group=KV_GROUP,
        doc_default="0",
        fills="kv.quantized_kv_start",
        help="quantize the KV once a prompt reaches this many tokens (default: 0)",
    ),
    Option(
        ("--max-kv-size",),
        type=positive_int,
        group=KV_GROUP,
        doc_default="none",
        fills="kv.max_kv_size",
        help="rotating KV cache of this many tokens for models without their own cache layout",
    ),
    Option(
        ("--prefill-step-size",),
        type=positive_int,
        group=KV_GROUP,
        doc_default=str(DEFAULT_PREFILL_STEP),
        fills="kv.prefill_step_size",
        convert=lambda value, args: value or DEFAULT_PREFILL_STEP,
        help="prefill chunk size (default: 512; recorded, not keyed)",
    ),
)


def add_kv_options(p: argparse.ArgumentParser) -> None:
    add_options(p, KV_OPTIONS)


def kv_settings(args: argparse.Namespace) -> KVSettings:
    return KVSettings(**config_fields(KV_OPTIONS, args, "kv"))


def console(stderr: bool = False):
    """A rich console for tables and notes. On a terminal it fits the window; written to a file
    or a pipe it prints whole rows (rich would cut them to 80 columns) unless COLUMNS is set.
    A reader that closes the pipe early raises BrokenPipeError, which `kvsnap` ends quietly."""
    from rich.console import Console

    class PipeAwareConsole(Console):
        def on_broken_pipe(self) -> None:
            # rich's own handler exits 1 (a failed check, for `kvsnap`); the CLI's handler
            # silences the rest and exits as a closed pipe does.
            raise BrokenPipeError

    out = PipeAwareConsole(stderr=stderr, highlight=False)
    if not out.is_terminal and not os.environ.get("COLUMNS"):
        out.width = UNWRAPPED_WIDTH
    return out


@contextlib.contextmanager
def byte_progress(description: str, quiet: bool = False) -> Iterator[dict]:
    """The ``on_bytes`` / ``on_total`` callbacks of a transfer, drawing bytes, rate and time left
    on stderr; none (an empty dict) with ``quiet`` (``--json``) or when stderr is not a
    terminal: a pipe or a CI log gets only the summary lines."""
    if quiet or not sys.stderr.isatty():
        yield {}
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=None)

        def on_total(n: int) -> None:
            bar.update(task, total=n)

        def on_bytes(n: int) -> None:
            bar.advance(task, n)

        yield {"on_bytes": on_bytes, "on_total": on_total}


def print_json(doc: dict) -> None:
    """What every ``--json`` prints: one JSON object on stdout."""
    print(json.dumps(doc, indent=1))


def table_title(text: str):
    """A table's title, printed whole: rich wraps a plain title at the table's width, splitting
    a long store path across lines. Plain text, never markup (paths come from users)."""
    from rich.text import Text

    return Text(text, no_wrap=True, overflow="ignore")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
