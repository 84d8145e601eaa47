"""What a new user trips on at the command line, tried as they would: real `kvsnap` processes,
real pipes, a real server on 127.0.0.1 with the tiny dense demo model.

A reader that closes the pipe early (`| head`) ends a command quietly; output into a pipe or
a file (CI logs, `| tee`) keeps whole rows; `serve --model M` works as in mlx_lm.server;
`bench-serve --system-prompt-file` takes any readable path and sends the file's prompt
without the trailing newline an editor adds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers.local_store import build, write_agents
from helpers.models import LONG_SYSTEM

from kvsnap.commands.common import EXIT_PIPE_CLOSED
from kvsnap.tools.serverproc import (
    ServerProcess,
    free_port,
    serving,
    under_hard_limit,
)

# Long enough that a table cut to 80 columns would wrap or elide every row.
LONG_NAME = "reviewer-of-the-rust-and-python-request-handlers"


@pytest.fixture(scope="module")
def dense(demo_models):
    return demo_models.load("dense")


@pytest.fixture(scope="module")
def model_dir(demo_models) -> Path:
    return demo_models.path("dense")


def kvsnap(*args, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """`kvsnap ARGS` in exactly ``env`` (conftest's run_kvsnap adds os.environ back, COLUMNS
    included, which would hide how output into a pipe is laid out)."""
    return subprocess.run(
        [sys.executable, "-m", "kvsnap", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def plain_env(tmp: Path) -> dict:
    """The environment of a CI job: no COLUMNS (rich would use it), a private digest cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_TERMINAL")}
    env["KVSNAP_CACHE_DIR"] = str(tmp / "digest-cache")
    return env


def named_agents(names: list[str]) -> list[dict]:
    """Agents with these names and short, distinct prompts (a long name costs no prefill)."""
    return [
        {"name": n, "messages": [{"role": "system", "content": f"You are agent {i}. Be brief."}]}
        for i, n in enumerate(names)
    ]


@pytest.fixture(scope="module")
def big_store(dense, tmp_path_factory) -> Path:
    """A store whose `ls --json` and `verify` print far more than a pipe holds (64 KiB)."""
    d = tmp_path_factory.mktemp("big-store")
    names = [f"agent-{i:02d}-" + "x" * 3000 for i in range(40)]
    build(dense, write_agents(d / "agents.json", named_agents(names)), d / "store")
    return d / "store"


@pytest.fixture(scope="module")
def long_store(dense, tmp_path_factory) -> Path:
    """A store under a long path, with long agent names."""
    d = tmp_path_factory.mktemp("a-store-under-a-rather-long-path-as-ci-workspaces-have")
    agents = write_agents(d / "agents.json", named_agents([f"{LONG_NAME}-{i}" for i in range(3)]))
    build(dense, agents, d / "store")
    return d / "store"


# --- a reader that closes the pipe early ---------------------------------------------------


def kvsnap_into_closed_pipe(args: list, env: dict, read_first_line: bool) -> tuple[int, str]:
    """Run `kvsnap ARGS | head -1` (or `| true` when not read_first_line): the exit status and
    what the command wrote on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsnap", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        bufsize=0,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        if read_first_line:
            assert proc.stdout.readline(), "the command printed nothing"
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace")
        return proc.wait(timeout=120), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("args", [["ls", "--json"], ["verify"]], ids=["ls-json", "verify"])
def test_a_pipe_closed_after_the_first_line_ends_the_command_quietly(big_store, tmp_path, args):
    rc, err = kvsnap_into_closed_pipe(
        [args[0], big_store, *args[1:]], plain_env(tmp_path), read_first_line=True
    )
    assert err == "", err
    assert rc == EXIT_PIPE_CLOSED


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "{store}", "--json"],
        ["ls", "{store}"],
        ["verify", "{store}"],
        ["gc", "{store}"],
        ["build", "{agents}", "--model", "{model}", "--out", "{tmp}/built"],
    ],
    ids=["ls-json", "ls-table", "verify", "gc", "build-table"],
)
def test_a_pipe_closed_before_any_output_ends_every_command_quietly(
    long_store, model_dir, tmp_path, args
):
    places = {
        "store": long_store,
        "agents": long_store.parent / "agents.json",
        "model": model_dir,
        "tmp": tmp_path,
    }
    argv = [a.format(**places) for a in args]
    rc, err = kvsnap_into_closed_pipe(argv, plain_env(tmp_path), read_first_line=False)
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, (
        err
    )
    assert rc == EXIT_PIPE_CLOSED, err


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(monkeypatch, tmp_path):
    """Only a reader of stdout can close it early: a BrokenPipeError from anything else (a
    socket, a child's stdin) while stdout is a file is a real failure, raised as it is."""
    from kvsnap.commands import cli, store

    def cmd_ls(args):
        raise BrokenPipeError(32, "Broken pipe (a socket)")

    monkeypatch.setattr(store, "cmd_ls", cmd_ls)
    with open(tmp_path / "out.txt", "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        with pytest.raises(BrokenPipeError, match="a socket"):
            cli.main(["ls", str(tmp_path)])


# --- output into a pipe or a file keeps whole rows -------------------------------------------


def row_with(out: str, text: str) -> str:
    rows = [line for line in out.splitlines() if text in line]
    assert rows, f"no line holds {text!r}:\n{out}"
    return rows[0]


def test_build_and_ls_print_whole_rows_into_a_pipe(long_store, model_dir, tmp_path):
    env = plain_env(tmp_path)
    out_dir = tmp_path / "a-build-folder-whose-path-alone-is-longer-than-forty-chars" / "store"
    built = kvsnap(
        "build", long_store.parent / "agents.json", "--model", model_dir, "--out", out_dir, env=env
    )
    assert built.returncode == 0, built.stderr
    assert "…" not in built.stdout, built.stdout
    header = row_with(built.stdout, "agent")
    assert re.search(
        r"agent .*status .*tokens .*reused .*prefilled .*coverage .*written .*seconds", header
    )
    assert str(out_dir) in built.stdout
    for i in range(3):
        assert re.search(
            rf"{LONG_NAME}-{i} .* \d+\.\d KiB .* \d+\.\d\d ",
            row_with(built.stdout, f"{LONG_NAME}-{i}"),
        )

    listed = kvsnap("ls", out_dir, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "…" not in listed.stdout, listed.stdout
    assert str(out_dir) in listed.stdout
    assert re.search(
        r"key .*agent .*tokens .*size .*model .*created", row_with(listed.stdout, "created")
    )
    for i in range(3):
        assert re.search(
            rf"{LONG_NAME}-{i} .* \d+\.\d KiB .* \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ",
            row_with(listed.stdout, f"{LONG_NAME}-{i}"),
        )


def test_columns_still_sets_the_width_of_piped_output(long_store, tmp_path):
    env = {**plain_env(tmp_path), "COLUMNS": "60"}
    listed = kvsnap("ls", long_store, env=env)
    assert listed.returncode == 0, listed.stderr
    assert max(len(line) for line in listed.stdout.splitlines()) <= 60, listed.stdout


# --- serve --model M, as mlx_lm.server takes it ----------------------------------------------


def test_serve_takes_the_model_as_a_flag_or_as_the_positional():
    from kvsnap.commands.cli import build_parser
    from kvsnap.commands.serve_checks import served_model

    parser = build_parser()
    assert served_model(parser.parse_args(["serve", "--model", "org/m"])) == "org/m"
    assert served_model(parser.parse_args(["serve", "org/m", "--port", "9"])) == "org/m"
    assert served_model(parser.parse_args(["serve", "org/m", "--model", "org/m"])) == "org/m"


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["serve"],
            r"no model given; name it as `kvsnap serve ORG/NAME\|DIR` or `kvsnap serve --model",
        ),
        (
            ["serve", "org/a", "--model", "org/b"],
            r"two models given: 'org/a' \(positional\) and --model 'org/b'; give one of the two",
        ),
    ],
    ids=["neither", "two-different"],
)
def test_serve_without_a_model_or_with_two_says_how_to_name_it(tmp_path, argv, says):
    proc = kvsnap(*argv, "--port", free_port(), env=plain_env(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsnap serve: error: "), proc.stderr
    assert re.search(says, lines[0]), lines[0]


@pytest.mark.parametrize(
    "argv, command, flag",
    [
        (["verify", "S", "--yes"], "verify", "--yes"),
        (["serve", "org/m", "--modle", "org/m"], "serve", "--modle"),
        (["gc", "S", "--force"], "gc", "--force"),
    ],
    ids=["verify", "serve", "gc"],
)
def test_a_flag_a_command_does_not_take_is_named_with_that_commands_usage(
    tmp_path, argv, command, flag
):
    """A mistyped flag after a command got the top level's usage ("usage: kvsnap [-h]
    [--version] [-v] COMMAND ...", none of the command's flags) and "kvsnap: error"."""
    proc = kvsnap(*argv, env=plain_env(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"usage: kvsnap {command} "), proc.stderr
    assert f"kvsnap {command}: error: unrecognized arguments: {flag}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", ["", " "])
@pytest.mark.parametrize("command", ["serve", "build"])
def test_an_empty_model_is_named_not_taken_for_the_current_folder(
    model_dir, tmp_path, command, value
):
    """``--model ""`` was the current folder (``Path("")`` is "."): run from a model's folder
    it loaded that, and elsewhere the error named "." rather than the empty value."""
    shutil.copytree(model_dir, tmp_path / "here")
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps([{"name": "a", "messages": [{"role": "system", "content": "x"}]}]))
    extra = (
        ["--port", str(free_port())] if command == "serve" else [agents, "--out", tmp_path / "o"]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvsnap", command, *map(str, extra), "--model", value],
        capture_output=True,
        text=True,
        env=plain_env(tmp_path),
        cwd=tmp_path / "here",
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = proc.stderr.strip().splitlines()[-1]
    assert said.startswith(f"kvsnap {command}: error: model {value!r} is empty; give "), said


def test_serve_dash_dash_model_starts_a_real_server(model_dir, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "kvsnap", "serve", "--model", str(model_dir), "--port", str(port)]
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            under_hard_limit(cmd, 300),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=plain_env(tmp_path),
        )
    server = ServerProcess(
        proc=proc,
        url=f"http://127.0.0.1:{port}",
        log_path=log_path,
        launched_at=time.perf_counter(),
    )
    try:
        server.wait_ready(120)
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [model_dir.name]
    finally:
        server.stop()


# --- bench-serve --system-prompt-file --------------------------------------------------------


@pytest.fixture(scope="module")
def warm_server(model_dir, tmp_path_factory):
    """A server warm from one agent's system prompt, keeping no request prefix: what a request
    reuses is that warm prefix, and nothing else."""
    tmp = tmp_path_factory.mktemp("bench-serve")
    agents = write_agents(
        tmp / "agents.json",
        [{"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]}],
    )
    args = [
        "--warm-prompts",
        agents,
        "--no-request-prefix-cache",
        "--cached-tokens-granularity",
        "1",
    ]
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    with serving(model_dir, args, tmp / "serve.log", env, 600) as server:
        yield server


def bench(server, prompt_file: str, tmp: Path, shell: bool = False) -> dict:
    """One measured request through `kvsnap bench-serve`: its row (prompt and cached tokens)."""
    argv = [
        sys.executable,
        "-m",
        "kvsnap",
        "bench-serve",
        "--url",
        server.url,
        "--prompts",
        "short",
        "--concurrency",
        "1",
        "--repetitions",
        "1",
        "--max-tokens",
        "2",
        "--format",
        "json",
        "--system-prompt-file",
        prompt_file,
    ]
    if shell:  # the argument is shell syntax, e.g. <(cat FILE)
        cmd = [shutil.which("bash") or "bash", "-c", " ".join(argv[:-1]) + " " + prompt_file]
    else:
        cmd = argv
    proc = subprocess.run(cmd, capture_output=True, text=True, env=plain_env(tmp), timeout=180)
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(proc.stdout)
    return row


def test_bench_serve_takes_a_process_substitution_and_a_fifo(warm_server, tmp_path):
    prompt = tmp_path / "system.txt"
    prompt.write_text(LONG_SYSTEM)
    plain = bench(warm_server, str(prompt), tmp_path)
    substituted = bench(warm_server, f"<(cat {prompt})", tmp_path, shell=True)
    assert substituted["prompt_tokens_mean"] == plain["prompt_tokens_mean"]

    fifo = tmp_path / "system.fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"cat {prompt} > {fifo}"])
    try:
        through_fifo = bench(warm_server, str(fifo), tmp_path)
    finally:
        writer.wait(30)
    assert through_fifo["prompt_tokens_mean"] == plain["prompt_tokens_mean"]


def test_bench_serve_drops_one_trailing_newline_so_the_warm_prefix_hits(
    warm_server, dense, tmp_path
):
    from kvsnap.prompts import parse_warm_prompts, warm_prefix

    entry = parse_warm_prompts(
        [{"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]}]
    ).entries[0]
    warm = len(warm_prefix(dense.tokenizer, entry).tokens)
    exact, edited = tmp_path / "exact.txt", tmp_path / "edited.txt"
    exact.write_text(LONG_SYSTEM)
    edited.write_text(LONG_SYSTEM + "\n")  # as an editor saves it
    as_is, with_newline = (
        bench(warm_server, str(exact), tmp_path),
        bench(warm_server, str(edited), tmp_path),
    )
    assert as_is["cached_tokens_mean"] == warm
    assert with_newline["prompt_tokens_mean"] == as_is["prompt_tokens_mean"]
    assert with_newline["cached_tokens_mean"] == warm


def test_bench_serve_says_what_is_wrong_with_a_system_prompt_path(tmp_path):
    (tmp_path / "folder").mkdir()
    # An empty file (a `<(...)` whose command failed) was run as "no system prompt" in silence.
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "newline.txt").write_text("\n")
    (tmp_path / "blank.txt").write_text(" \r\n\t\n")
    for path, says in (
        (tmp_path / "missing.txt", r"missing.txt: no such file; check the path"),
        (tmp_path / "folder", r"folder: is a folder; give a text file"),
        (tmp_path / "empty.txt", r"empty.txt: holds no text; give the system prompt"),
        (tmp_path / "newline.txt", r"newline.txt: holds no text; give the system prompt"),
        (tmp_path / "blank.txt", r"blank.txt: holds no text; give the system prompt"),
    ):
        proc = kvsnap(
            "bench-serve",
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--system-prompt-file",
            path,
            env=plain_env(tmp_path),
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert re.search(r"kvsnap bench-serve: error: --system-prompt-file .*" + says, proc.stderr)
