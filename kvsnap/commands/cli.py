"""The `kvsnap` command. Heavy imports (mlx, mlx-lm) happen inside the subcommands that need them.

Exit codes: 0 success; 1 a check found bad files (verify), or some warm-prompt entries
were invalid or failed to build (build: the valid ones are still built and the table
says which); 2 a usage or input error, printed as one line on stderr naming the problem
and the fix; 141 the reader of the output closed it early (`kvsnap ls S --json | head`): the
command stops quietly, as a shell tool killed by SIGPIPE does.

Each subcommand's flags and implementation live together in kvsnap/commands/; this module
only assembles the parser, in `kvsnap --help` order, and dispatches.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import sys

from kvsnap import __version__
from kvsnap.commands import build, serve, store, tools, transfer
from kvsnap.commands.common import EXIT_BAD, EXIT_OK, EXIT_PIPE_CLOSED, EXIT_USAGE
from kvsnap.commands.serve_options import foreign_flag_hint
from kvsnap.errors import KvsnapError

__all__ = ["EXIT_BAD", "EXIT_OK", "EXIT_PIPE_CLOSED", "EXIT_USAGE", "build_parser", "main"]

log = logging.getLogger("kvsnap")

# Each adds one subcommand's parser, wired to its function; the order is `kvsnap --help`'s.
SUBCOMMANDS = (
    tools.add_demo_model,
    build.add_build,
    serve.add_serve,
    tools.add_bench_serve,
    tools.add_quickstart,
    store.add_ls,
    store.add_inspect,
    store.add_verify,
    store.add_gc,
    store.add_migrate,
    transfer.add_push,
    transfer.add_pull,
    transfer.add_pack,
    transfer.add_unpack,
    serve.add_vllm_mlx,
    serve.add_mlx_lm,
)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations anywhere: `--chat-template x` was taken as `--chat-template-args x`.
    parser = argparse.ArgumentParser(
        prog="kvsnap",
        description="Persistent, shippable warm prefix caches for LLM serving on MLX.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"kvsnap {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    for command_parser in sub.choices.values():
        command_parser.allow_abbrev = False
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        status = run(argv)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at exit
    except BrokenPipeError:
        if not stdout_is_a_pipe():  # a terminal or a file cannot be closed by a reader
            raise
        # The Python docs' recipe: stdout onto devnull, so the interpreter's final flush of the
        # unwritten rest cannot raise again ("Exception ignored ... BrokenPipeError").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    return status


def stdout_is_a_pipe() -> bool:
    """Whether stdout is a pipe or a socket: the only outputs a reader can close early."""
    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError):  # no file descriptor: pytest's capture, a closed stream
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def run(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The command's own usage and name: the top level's lists none of the command's flags.
        getattr(args, "command_parser", parser).error(
            f"unrecognized arguments: {' '.join(unknown)}"
            + (foreign_flag_hint(unknown) if args.command == "serve" else "")
        )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s"
        if args.command == "serve"
        else "%(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call drowns the output
    if not args.command:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.run(args)
    except KvsnapError as exc:
        print(f"kvsnap {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"kvsnap {args.command}: interrupted", file=sys.stderr)
        return 130
