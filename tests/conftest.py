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
        from kvsnap.tools.demo import DemoSpec, make_demo_model

        arch, template, bits = MODEL_SPECS[name]
        return make_demo_model(
            self.root / name, DemoSpec(arch=arch, template=template, quantize_bits=bits)
        )

    def load(self, name: str, **settings):
        from kvsnap.key import KVSettings
        from kvsnap.runtime.model.loading import load_model

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


# --- CI runs what it claims: a skip fails the run unless tests/allowed_skips.txt lists it
# ----------

ALLOWED_SKIPS = Path(__file__).with_name("allowed_skips.txt")
_ALLOWED_KEY = pytest.StashKey[list]()


def in_ci(environ=os.environ) -> bool:
    return environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def read_allowed_skips(path: Path = ALLOWED_SKIPS) -> list[tuple[str, str]]:
    """(node id, reason fragment) pairs from lines ``NODE_ID | REASON FRAGMENT``; ``#`` starts a
    comment."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        node, sep, reason = (part.strip() for part in line.partition(" | "))
        if not (sep and node and reason):
            raise pytest.UsageError(
                f"{path}:{number}: {line!r} is not 'NODE_ID | REASON FRAGMENT'; fix the line"
            )
        entries.append((node, reason))
    return entries


def skip_allowed(nodeid: str, reason: str, entries: list[tuple[str, str]]) -> bool:
    """A node id matches itself and its parametrized variants; the reason must contain the
    fragment."""
    return any(
        (nodeid == node or nodeid.startswith(node + "[")) and fragment in reason
        for node, fragment in entries
    )


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_unallowed_skip(report, config) -> None:
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if skip_allowed(report.nodeid, reason, config.stash[_ALLOWED_KEY]):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true, and not on {ALLOWED_SKIPS.name}: {reason}\n"
        f"Install what the test needs in .ci/run, or add '{report.nodeid} | <reason fragment>' "
        f"with a why to tests/{ALLOWED_SKIPS.name}."
    )


def pytest_configure(config):
    config.stash[_ALLOWED_KEY] = (
        read_allowed_skips()
    )  # a malformed list stops the run at once, CI or not


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_unallowed_skip(report, item.config)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail_unallowed_skip(report, collector.config)
    return report


def run_kvsnap(*args, env=None, cwd=None, timeout=300):
    import subprocess

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvsnap", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )
