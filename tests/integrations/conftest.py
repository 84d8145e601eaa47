"""Fixtures of the integration tests: vllm-mlx's cached venv and a world built in it."""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.cli import run_kvsnap
from helpers.vllm_mlx_route import (
    AGENTS,
    SERVER_DEPS,
    SPEC,
    VLLM_MLX,
    _cache_root,
    _pip,
    _venv_env,
    _venv_kvsnap,
    make_llama3_model,
)


@pytest.fixture(scope="session")
def vllm_mlx_python() -> Path:
    """The python of a cached venv holding vllm-mlx 0.6.0 and its text server's imports.

    kvsnap itself is not installed there: the tests put this checkout first on PYTHONPATH.
    """
    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "vllm-mlx-venv"
    marker = venv / ".kvsnap-spec"
    with open(root / ".vllm-mlx-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sessions never build it at once
        if not (marker.is_file() and marker.read_text() == SPEC):
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
            _pip(venv, "--no-deps", VLLM_MLX)
            _pip(venv, *SERVER_DEPS)
            marker.write_text(SPEC)
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def world(vllm_mlx_python, tmp_path_factory):
    """Demo models and one store, built in vllm-mlx's environment (mlx-lm 0.31)."""
    root = tmp_path_factory.mktemp("vllm-mlx-e2e")
    home = root / "build-home"
    home.mkdir()
    agents = root / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    models = {}
    for name, extra in {
        "dense": [],
        "hybrid": ["--arch", "hybrid"],
        "other": ["--seed", "7"],
    }.items():
        models[name] = root / name
        _venv_kvsnap(vllm_mlx_python, home, "demo-model", models[name], *extra)
        _venv_kvsnap(
            vllm_mlx_python, home, "build", agents, "--model", models[name], "--out", root / "snaps"
        )
    # weights and tokenizer files only: no store entry here
    models["llama3"] = make_llama3_model(root / "llama3")
    # One more, built under this suite's mlx-lm: foreign to vllm-mlx when the minors differ.
    r = run_kvsnap(
        "build",
        agents,
        "--model",
        models["dense"],
        "--out",
        root / "snaps",
        env={"KVSNAP_CACHE_DIR": str(home / "kvsnap-cache")},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((root / "snaps" / "manifest.json").read_text())
    n_tokens = {
        Path(rec["model_path"]).name: rec["entries"][0]["n_tokens"]
        for rec in manifest["records"].values()
    }
    venv_minor = subprocess.run(
        [str(vllm_mlx_python), "-c", "from kvsnap.key import mlx_lm_minor; print(mlx_lm_minor())"],
        capture_output=True,
        text=True,
        env=_venv_env(home),
        check=True,
    ).stdout.strip()
    return SimpleNamespace(
        root=root,
        python=vllm_mlx_python,
        models=models,
        store=root / "snaps",
        n_tokens=n_tokens,
        venv_minor=venv_minor,
    )
