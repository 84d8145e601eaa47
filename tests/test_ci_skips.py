"""CI runs what it claims: under CI=true a skipped test fails unless tests/allowed_skips.txt lists
it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.skips import ALLOWED_SKIPS, read_allowed_skips, skip_allowed

TESTS = Path(__file__).resolve().parent
SAMPLE = """
import pytest

def test_passes():
    pass

def test_needs_a_tool():
    pytest.skip("frobnicate is not installed")

@pytest.fixture
def tool():
    pytest.skip("the tool fixture cannot start")

def test_through_a_fixture(tool):
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_known_bug():
    assert False
"""


def _run_pytest(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    if ci is not None:
        env["CI"] = ci
    # `-p conftest` loads the project's conftest (and its hooks) for a test file outside tests/.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "conftest",
        "-p",
        "no:cacheprovider",
        "-rfEs",
        "test_sample.py",
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_in_ci_a_skip_not_on_the_list_fails_the_run(tmp_path):
    r = _run_pytest(tmp_path, "true")
    assert r.returncode == 1, r.stdout + r.stderr
    assert (
        "skipped under CI=true, and not on allowed_skips.txt: frobnicate is not installed"
        in r.stdout
    ), r.stdout
    assert "not on allowed_skips.txt: the tool fixture cannot start" in r.stdout, r.stdout
    assert (
        "1 passed" in r.stdout
        and "1 xfailed" in r.stdout
        and "skipped" not in r.stdout.splitlines()[-1]
    ), r.stdout


def test_outside_ci_a_skip_stays_a_skip(tmp_path):
    r = _run_pytest(tmp_path, None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 2 skipped, 1 xfailed" in r.stdout, r.stdout


def test_in_ci_a_module_level_skip_fails_too(tmp_path):
    (tmp_path / "test_module.py").write_text(
        'import pytest\npytest.skip("the module needs frobnicate", allow_module_level=True)\n'
    )
    env = {
        **os.environ,
        "CI": "true",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "conftest",
        "-p",
        "no:cacheprovider",
        "test_module.py",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert (
        r.returncode != 0 and "not on allowed_skips.txt: the module needs frobnicate" in r.stdout
    ), r.stdout + r.stderr


def test_allowed_entries_match_their_node_and_reason_only():
    entries = [("tests/test_x.py::test_y", "vllm-mlx is installed")]
    assert skip_allowed(
        "tests/test_x.py::test_y", "vllm-mlx is installed in this environment", entries
    )
    assert skip_allowed("tests/test_x.py::test_y[dense]", "vllm-mlx is installed here", entries)
    assert not skip_allowed("tests/test_x.py::test_y", "npm is not installed", entries)
    assert not skip_allowed("tests/test_x.py::test_yz", "vllm-mlx is installed", entries)


def test_a_malformed_line_names_the_file_and_the_line(tmp_path):
    bad = tmp_path / "allowed_skips.txt"
    bad.write_text("# fine\ntests/test_x.py::test_y | a reason\ntests/test_x.py::test_z\n")
    with pytest.raises(
        pytest.UsageError,
        match=r"allowed_skips.txt:3: 'tests/test_x.py::test_z' is not 'NODE_ID \| REASON FRAGMENT'",
    ):
        read_allowed_skips(bad)


def test_every_allowed_skip_names_an_existing_test():
    entries = read_allowed_skips(ALLOWED_SKIPS)
    assert len(entries) <= 5, "the list of allowed skips must stay short"
    for node, _ in entries:
        path, _, name = node.partition("::")
        assert name and f"def {name}(" in (TESTS.parent / path).read_text(), (
            f"{node} is not a test; update {ALLOWED_SKIPS}"
        )
