"""The codec must work under both mlx-lm minors kvsnap supports (0.31.x and 0.32.x).

The suite itself runs under whatever mlx-lm the environment has; this test reruns the codec
and equivalence tests in a subprocess with the other minor shadowing it on PYTHONPATH
(installed once, --no-deps, into a cached folder). Skipped only when PyPI is unreachable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsnap.key import mlx_lm_minor

OTHER = {"0.32": "0.31.3", "0.31": "0.32.2"}


def _cache_root() -> Path:
    return Path(os.environ.get("KVSNAP_TEST_CACHE") or Path.home() / ".cache" / "kvsnap-tests")


def _install(version: str) -> Path:
    target = _cache_root() / f"mlx-lm-{version}"
    if (target / "mlx_lm").is_dir():
        return target
    tmp = target.with_name(target.name + ".partial")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(tmp),
            f"mlx-lm=={version}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot install mlx-lm=={version} from the package index: "
            f"{r.stderr.strip().splitlines()[-1:]}"
        )
    tmp.rename(target)
    return target


def test_codec_and_equivalence_under_the_other_mlx_lm_minor():
    mine = mlx_lm_minor()
    if mine not in OTHER:
        pytest.skip(f"mlx-lm {mine} is outside the supported range")
    version = OTHER[mine]
    target = _install(version)
    root = Path(__file__).resolve().parents[3]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(target), str(root)]),
        "KVSNAP_EXPECT_MLX_LM": version,
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/snapshot/test_codec.py",
            "tests/snapshot/test_equivalence.py",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout
