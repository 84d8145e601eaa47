"""The command line both routes share: kvsnap's own options taken out of an upstream server's
arguments, and the upstream ``main`` run in this process as if from its own command line."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from kvsnap.errors import UsageError

OPTION = "--kv-snapshots"
WARM_OPTION = "--warm-prompts"


def split_argv(
    argv: Sequence[str],
    option: str = OPTION,
    what: str = "a directory, e.g. --kv-snapshots ./snaps",
) -> tuple[str | None, list[str]]:
    """Take ``OPTION VALUE`` (or ``OPTION=VALUE``) out; the rest go upstream in order."""
    found: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg == option:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise UsageError(f"{option} needs {what}")
            value, i = argv[i + 1], i + 2
        elif arg.startswith(option + "="):
            value, i = arg[len(option) + 1 :], i + 1
        else:
            rest.append(arg)
            i += 1
            continue
        if not value:
            raise UsageError(f"{option} needs {what}")
        if found is not None:
            raise UsageError(f"{option} given twice ({found!r} and {value!r}); give it once")
        found = value
    return found, rest


MAX_PORT = 65535


def port_problem(text: str) -> str | None:
    """Why ``text`` is not a TCP port (0 to 65535; 0: a free one), or None. Every kvsnap
    command taking --port checks it: a socket takes 99999 as 34463, and -5 fails as a host."""
    try:
        value = int(text)
    except ValueError:
        return f"{text!r} is not a port number; give one from 0 to {MAX_PORT}"
    if not 0 <= value <= MAX_PORT:
        return f"{value} is not a port number; give one from 0 to {MAX_PORT}"
    return None


def positive_number(unit: str) -> Callable[[str], float]:
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


def check_port(args: Sequence[str]) -> None:
    """A UsageError for an upstream server's ``--port VALUE`` (or ``--port=VALUE``) that is not
    a port, before anything is imported or loaded."""
    end = list(args).index("--") if "--" in args else len(args)
    for i, arg in enumerate(args[:end]):
        if arg == "--port" and i + 1 < end:
            value = args[i + 1]
        elif arg.startswith("--port="):
            value = arg[len("--port=") :]
        else:
            continue
        problem = port_problem(value)
        if problem:
            raise UsageError(f"--port {problem}")


def serve_args(argv: Sequence[str], usage: str, route: str, directly: str) -> list[str] | int:
    """The arguments of ``kvsnap ROUTE serve ARGS``, or an exit status when ``argv`` only asks
    for the usage (printed here: 0 for ``-h``/``--help``, 2 for nothing). Another subcommand is
    a UsageError naming how to run it upstream: ``directly`` with ``{}`` for the subcommand; so
    is a ``--port`` that is not a port."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage, end="")
        return 0 if argv else 2
    if argv[0] != "serve":
        raise UsageError(
            f"`kvsnap {route} {argv[0]}` is not supported: only `serve` takes {OPTION}; run "
            f"`{directly.format(argv[0])} ...` directly"
        )
    check_port(argv[1:])
    return list(argv[1:])


def asks_help(args: Sequence[str]) -> bool:
    """Whether the upstream server's arguments ask for its help."""
    return any(a in ("-h", "--help") for a in args)


def run_main(main: Callable[[], object], argv: list[str]) -> int:
    """``main()`` with ``sys.argv`` set to ``argv`` (restored after); its exit status is
    returned."""
    saved = sys.argv
    sys.argv = list(argv)
    try:
        main()
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0
