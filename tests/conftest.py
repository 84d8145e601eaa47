"""Shared fixtures: demo models made once per session, real files, no network."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kvsnap.blas import preload_openblas  # noqa: E402

preload_openblas()

if os.environ.get("KVSNAP_EXPECT_MLX_LM"):
    # Set by test_mlx_lm_minors.py: prove the subprocess really runs the other mlx-lm.
    from importlib.metadata import version as _version

    assert _version("mlx-lm") == os.environ["KVSNAP_EXPECT_MLX_LM"], _version("mlx-lm")

LONG_SYSTEM = (
    "You are a meticulous code reviewer for a python and rust server. Always read the tests first, "
    "then check every function and class for error handling, return values and file paths. "
    "Explain each fix briefly, list the steps, and never answer without checking the data. "
) * 3

# name -> (arch, template, quantize_bits)
MODEL_SPECS = {
    "dense": ("dense", "chatml", None),
    "hybrid": ("hybrid", "chatml", None),
    "sliding": ("sliding", "chatml", None),
    "dense-q4": ("dense", "chatml", 4),
    "mistral": ("dense", "mistral", None),
    "default-system": ("dense", "default-system", None),
}


class DemoModels:
    """Makes each demo model on first use and keeps one loaded copy per name."""

    def __init__(self, root: Path):
        self.root = root
        self._loaded = {}

    def path(self, name: str) -> Path:
        from kvsnap.demo import DemoSpec, make_demo_model

        arch, template, bits = MODEL_SPECS[name]
        return make_demo_model(self.root / name, DemoSpec(arch=arch, template=template, quantize_bits=bits))

    def load(self, name: str, **settings):
        from kvsnap.key import KVSettings
        from kvsnap.modeling import load_model

        key = (name, tuple(sorted(settings.items())))
        if key not in self._loaded:
            self._loaded[key] = load_model(self.path(name), KVSettings(**settings))
        return self._loaded[key]


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory) -> DemoModels:
    return DemoModels(tmp_path_factory.mktemp("models"))


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch):
    """Keep the weight-digest cache out of the user's home."""
    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "kvsnap-cache"))
    return tmp_path / "kvsnap-cache"


def run_kvsnap(*args, env=None, cwd=None, timeout=300):
    import subprocess

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvsnap", *map(str, args)], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout)
