"""Shared fixtures: demo models made once per session, real files, no network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# pytest-xdist's workers set COLUMNS=80 and LINES=24; the CLIs under test read COLUMNS as the
# user's chosen width (a piped `kvsnap ls` would cut its lines there), as in a serial run.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

from kvsnap.blas import preload_openblas  # noqa: E402

preload_openblas()

from helpers.models import DemoModels  # noqa: E402
from helpers.skips import ALLOWED_SKIPS, in_ci, read_allowed_skips, skip_allowed  # noqa: E402
from helpers.stores import AGENTS, build_store  # noqa: E402

if os.environ.get("KVSNAP_EXPECT_MLX_LM"):
    # Set by tests/integrations/mlx_lm/test_minors.py: prove the subprocess really runs the
    # other mlx-lm.
    from importlib.metadata import version as _version

    assert _version("mlx-lm") == os.environ["KVSNAP_EXPECT_MLX_LM"], _version("mlx-lm")


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

_ALLOWED_KEY = pytest.StashKey[list]()


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
    # a malformed list stops the run at once, CI or not
    config.stash[_ALLOWED_KEY] = read_allowed_skips()


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


# --- the store most archive, shipping and registry tests read or copy


@pytest.fixture(scope="module")
def lm(demo_models):
    """The dense demo model, loaded (one copy per session: DemoModels keeps it)."""
    return demo_models.load("dense")


@pytest.fixture(scope="module")
def built(request, lm, tmp_path_factory) -> Path:
    """A store built once per module by the dense demo model, from the module's AGENTS if it has
    some, else helpers.stores.AGENTS: tests read it or work on a copy."""
    agents = getattr(request.module, "AGENTS", AGENTS)
    return build_store(lm, tmp_path_factory.mktemp("built") / "snaps", agents)
