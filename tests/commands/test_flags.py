"""Flags as the real `kvsnap` command line takes them (issue 39): ports checked in every
command taking --port, no option prefixes (argparse's abbreviations) with a hint for
mlx_lm.server's flags kvsnap serve has not, several --served-model-name, and quickstart's
--port, --help and one-line usage errors."""

from __future__ import annotations

import json
import socket

import pytest
from helpers.cli import no_traceback, run_kvsnap

from kvsnap.commands.cli import build_parser

MISSING = "/nonexistent/model"


def _usage_error(r, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    no_traceback(r)
    last = r.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, last
    return last


# --- 9. ports ------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["99999", "-5", "65536", "http"])
@pytest.mark.parametrize(
    "argv",
    [
        ["serve", MISSING],
        ["mlx-lm", "serve", "--model", MISSING],
        ["vllm-mlx", "serve", MISSING, "--continuous-batching"],
        ["quickstart", "--dir", "{tmp}"],
    ],
    ids=["serve", "mlx-lm", "vllm-mlx", "quickstart"],
)
def test_regression_a_port_outside_0_65535_is_a_usage_error_naming_the_port(argv, port, tmp_path):
    """`--port 99999` listened on 34463 (99999 mod 65536) and logged 99999; `--port -5` blamed
    --host. Every command taking --port now refuses it first, naming the value."""
    argv = [a.replace("{tmp}", str(tmp_path / "demo")) for a in argv]
    r = run_kvsnap(*argv, "--port", port, timeout=120)
    last = _usage_error(r, "--port", port, "0 to 65535")
    assert "--host" not in last
    assert not (tmp_path / "demo").exists()  # refused before any work


def test_port_zero_and_65535_are_ports():
    parser = build_parser()
    assert parser.parse_args(["serve", "m", "--port", "65535"]).port == 65535
    assert parser.parse_args(["quickstart", "--port", "0"]).port == 0


# --- 10. no option prefixes ----------------------------------------------------------------------


def test_regression_chat_template_is_not_taken_as_chat_template_args(tmp_path):
    """`--chat-template x` (mlx_lm.server's flag) was taken as `--chat-template-args x`, an
    abbreviation, and refused as bad JSON; now it is an unknown flag, with what to do
    instead."""
    r = run_kvsnap("serve", MISSING, "--chat-template", "{{ messages }}")
    last = _usage_error(r, "unrecognized arguments: --chat-template", "tokenizer_config.json")
    assert "--chat-template-args" not in last


@pytest.mark.parametrize(
    "flag, advice",
    [
        ("--prompt-cache-bytes=100", "--cache-memory-mb"),
        ("--decode-concurrency", "--max-batch-size"),
        ("--adapter-path", "mlx_lm.fuse"),
        ("--pipeline", "kvsnap mlx-lm serve"),
    ],
)
def test_mlx_lm_server_flags_serve_has_not_say_what_to_do_instead(flag, advice):
    r = run_kvsnap("serve", MISSING, flag)
    _usage_error(r, "unrecognized arguments", flag.split("=")[0] + " is mlx_lm.server's", advice)


def test_no_parser_takes_a_prefix_of_a_flag():
    parser = build_parser()
    assert parser.allow_abbrev is False
    subparsers = next(a for a in parser._actions if a.choices and "serve" in a.choices).choices
    assert subparsers and all(p.allow_abbrev is False for p in subparsers.values())
    for argv in (
        ["serve", "m", "--served", "x"],
        ["ls", "--js", "d"],
        ["build", "a", "--mod", "m", "--model", "m", "--out", "o"],
    ):
        _, unknown = parser.parse_known_args(argv)
        assert unknown and unknown[0].startswith("--"), (argv, unknown)


# --- 11. several served names ---------------------------------------------------------------------


def test_served_model_name_takes_several_names_and_a_model_after_them_is_explained():
    args = build_parser().parse_args(["serve", "m", "--served-model-name", "a", "b/c"])
    assert args.served_model_name == ["a", "b/c"]
    r = run_kvsnap("serve", "--served-model-name", "a", "b", MISSING)
    _usage_error(r, "no model given", "give the model before it")


# --- 14. quickstart ----------------------------------------------------------------------------


def test_quickstart_help_says_it_starts_a_server():
    r = run_kvsnap("quickstart", "--help")
    assert r.returncode == 0 and "server" in r.stdout and "--port" in r.stdout, r.stdout
    r = run_kvsnap("--help")
    entry = r.stdout.split("quickstart", 1)[1].split("\n    ls ", 1)[0]
    assert "server" in entry, r.stdout


def test_regression_quickstart_usage_errors_are_one_line_not_a_traceback(tmp_path):
    """`--dir` naming a file was a FileExistsError traceback (exit 1)."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    r = run_kvsnap("quickstart", "--dir", afile)
    _usage_error(r, "kvsnap quickstart: error: --dir", "is a file")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_kvsnap("quickstart", "--dir", tmp_path / "q", "--port", port)
    _usage_error(r, f"127.0.0.1:{port}", "already in use")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_quickstart_serves_on_the_port_given(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_kvsnap(
        "quickstart", "--dir", tmp_path, "--port", port, env={"KVSNAP_CACHE_DIR": str(tmp_path)}
    )
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((tmp_path / "quickstart.json").read_text())
    assert record["url"] == f"http://127.0.0.1:{port}" and record["ok"], record
