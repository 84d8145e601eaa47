"""kvsnap's command line run as a subprocess, the way a user runs it."""

from __future__ import annotations

import os
import resource
import subprocess
import sys


def kvsnap_argv(*args) -> list[str]:
    """The command line that runs kvsnap with ``args`` in this interpreter."""
    return [sys.executable, "-m", "kvsnap", *map(str, args)]


def build_args(agents, model, out, *extra) -> list:
    """``kvsnap build``'s arguments: ``agents`` on ``model`` into the store ``out``."""
    return ["build", agents, "--model", model, "--out", out, *extra]


def run_kvsnap(*args, env=None, cwd=None, timeout=300):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        kvsnap_argv(*args),
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "Error:" not in r.stderr.replace("error:", ""), r.stderr[
        -3000:
    ]


def run_kvsnap_in_1gib(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    """The CLI with 1 GiB of address space: an allocation bomb ends in seconds instead of taking
    the machine."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run(
        kvsnap_argv(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
    )
