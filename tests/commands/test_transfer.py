"""`kvsnap pack` / `unpack` as a user runs them: `--json` output, and the byte bar on a terminal
only (push and pull's `--json`: tests/store/oci/test_registry.py, next to the registry)."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

from helpers.cli import run_kvsnap
from helpers.stores import store_files


def test_pack_and_unpack_json_print_one_object_with_the_documented_fields(built, tmp_path):
    archive = tmp_path / "snaps.tar.gz"
    r = run_kvsnap("pack", built, "-o", archive, "--json")
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    packed = json.loads(r.stdout)
    assert packed == {
        "store": str(built),
        "archive": str(archive),
        "files": packed["files"],
        "bytes": sum((built / rel).stat().st_size for rel in store_files(built)),
    }
    assert sorted(packed["files"]) == sorted(store_files(built))

    r = run_kvsnap("unpack", archive, tmp_path / "out", "--json")
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    unpacked = json.loads(r.stdout)
    assert unpacked == {
        "archive": str(archive),
        "store": str(tmp_path / "out"),
        "files": unpacked["files"],
        "bytes": packed["bytes"],
        "kept": [],
    }
    assert sorted(unpacked["files"]) == sorted(packed["files"])


def run_with_terminal_stderr(*args) -> tuple[subprocess.CompletedProcess, str]:
    """The CLI with stderr on a pseudo-terminal (stdout a pipe): what a user at a shell sees."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    env.pop("CI", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsnap", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
        env=env,
    )
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    stdout, _ = proc.communicate(timeout=120)
    os.close(leader)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""), seen.decode(
        errors="replace"
    )


def test_the_byte_bar_shows_on_a_terminal_and_never_in_a_pipe_or_with_json(built, tmp_path):
    r, terminal = run_with_terminal_stderr("pack", built, "-o", tmp_path / "a.tar")
    assert r.returncode == 0 and "packed" in r.stdout, r.stdout + terminal
    # rich's DownloadColumn and TransferSpeedColumn: bytes done of the total, and a rate
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal)
    assert re.search(r"pack .*\d/[\d.]+ [KM]iB [\d.]+ [kMG]?B/s", plain), plain

    r, terminal = run_with_terminal_stderr("pack", built, "-o", tmp_path / "b.tar", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["bytes"] > 0 and terminal == "", terminal

    piped = run_kvsnap("unpack", tmp_path / "a.tar", tmp_path / "out")
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert piped.stdout.startswith("unpacked ") and len(piped.stdout.splitlines()) == 1
