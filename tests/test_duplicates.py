"""No copied code in the package: pylint's similarity checker finds no block of 6+ lines twice
(scripts/check_duplicates.sh runs the same check by hand).

pylint's similarity pass takes one to three minutes on 2 cores, longer on a busy machine: no
timeout (a slow machine is not a failure) and marked slow, out of the quick loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_similarity(*paths: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "pylint",
        "--disable=all",
        "--enable=duplicate-code",
        "--min-similarity-lines=6",
        "--score=n",
        *paths,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_the_package_has_no_duplicated_block():
    r = run_similarity("kvsnap")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_check_sees_a_copied_block(tmp_path):
    block = "".join(f"    total += value * {i} - {i * 7}\n" for i in range(8))
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text(
            f"def {name}(value):\n    total = 0\n{block}    return total\n"
        )
    r = run_similarity(str(tmp_path / "a.py"), str(tmp_path / "b.py"))
    assert r.returncode != 0 and "duplicate-code" in r.stdout, r.stdout + r.stderr
