"""Issue 24: content pulled from a registry is hostile -- a real docker-registry on 127.0.0.1.

A forged block under an existing name is reported and never installed; a killed pull resumes
from what it staged; stale stage folders are cleaned.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import run_kvsnap
from kvsnap.store.local import MANIFEST
from kvsnap.store.oci import Reference, pull
from test_archive import AGENTS, build_store, store_files
from test_oci import _push_raw, no_ambient_credentials, registry  # noqa: F401  (fixtures)
from test_shipping_installs import forged_copy


@pytest.fixture(scope="module")
def lm(demo_models):
    return demo_models.load("dense")


@pytest.fixture(scope="module")
def built(lm, tmp_path_factory) -> Path:
    return build_store(lm, tmp_path_factory.mktemp("ship-registry") / "snaps", AGENTS)


@pytest.fixture()
def store(built, tmp_path) -> Path:
    dest = tmp_path / "store"
    shutil.copytree(built, dest)
    return dest


def test_regression_pull_never_overwrites_a_good_block_with_a_forged_one(registry, store, tmp_path):  # noqa: F811
    """A registry artifact carrying other bytes under an existing block's name: reported, not installed."""
    block = sorted((store / "blocks").iterdir())[0]
    forged = forged_copy(block)
    ref = Reference.parse(registry.ref("ship/forged-block"))
    _push_raw(ref, {f"blocks/{block.name}": forged, MANIFEST: (store / MANIFEST).read_bytes()})
    before = {k: v for k, v in store_files(store).items() if k != MANIFEST}
    report = pull(ref, store)
    assert report.kept == [f"blocks/{block.name}"] and f"blocks/{block.name}" not in report.downloaded
    assert {k: v for k, v in store_files(store).items() if k != MANIFEST} == before
    r = run_kvsnap("pull", str(ref), store)
    assert r.returncode == 0 and "not installed" in r.stdout and block.name in r.stdout, r.stdout + r.stderr
    assert block.read_bytes() == before[f"blocks/{block.name}"]
