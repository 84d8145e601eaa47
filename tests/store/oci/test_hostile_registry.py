"""Content pulled from a registry is hostile -- a real docker-registry on 127.0.0.1.

A forged block under an existing name is reported and never installed; a killed pull resumes
from what it staged; stale stage folders are cleaned.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from helpers.cli import run_kvsnap
from helpers.registry import _push_raw
from helpers.stores import forged_copy, no_stage_dirs, store_files

from kvsnap.store.local import MANIFEST
from kvsnap.store.oci import Reference, pull

pytestmark = pytest.mark.usefixtures("no_ambient_credentials")


@pytest.fixture()
def store(built, tmp_path) -> Path:
    dest = tmp_path / "store"
    shutil.copytree(built, dest)
    return dest


def test_regression_pull_never_overwrites_a_good_block_with_a_forged_one(registry, store, tmp_path):
    """A registry artifact carrying other bytes under an existing block's name: reported, not
    installed."""
    block = sorted((store / "blocks").iterdir())[0]
    forged = forged_copy(block)
    ref = Reference.parse(registry.ref("ship/forged-block"))
    _push_raw(ref, {f"blocks/{block.name}": forged, MANIFEST: (store / MANIFEST).read_bytes()})
    before = {k: v for k, v in store_files(store).items() if k != MANIFEST}
    report = pull(ref, store)
    assert (
        report.kept == [f"blocks/{block.name}"] and f"blocks/{block.name}" not in report.downloaded
    )
    assert {k: v for k, v in store_files(store).items() if k != MANIFEST} == before
    r = run_kvsnap("pull", str(ref), store)
    assert r.returncode == 0 and "not installed" in r.stdout and block.name in r.stdout, (
        r.stdout + r.stderr
    )
    assert block.read_bytes() == before[f"blocks/{block.name}"]


def blob_gets(registry, since: int) -> list[str]:  # noqa: F811
    """Blob downloads the registry itself logged since a log offset."""
    with open(registry.log_path, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return re.findall(r'"GET /v2/\S+/blobs/(sha256:[0-9a-f]{64}) HTTP/1\.[01]" 200', text)


def test_regression_a_killed_pull_resumes_from_its_stage_and_downloads_only_what_is_missing(
    registry, built, tmp_path
):  # noqa: F811
    """Once: a killed pull left `.kvsnap-stage-*` forever, and the next pull downloaded everything
    again."""
    ref = registry.ref("ship/resume")
    assert run_kvsnap("push", built, ref).returncode == 0
    dest = tmp_path / "replica"
    killed = run_kvsnap(
        "pull", ref, dest, env={**os.environ, "KVSNAP_FAULT": "pull-staged-blob=kill"}
    )
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    stages = [p for p in tmp_path.iterdir() if p.name.startswith(".kvsnap-stage-replica-")]
    assert len(stages) == 1 and not dest.exists()
    staged = [str(p.relative_to(stages[0])) for p in stages[0].rglob("*") if p.is_file()]
    assert len(staged) == 1  # killed right after its first blob

    since = registry.log_size()
    report = pull(Reference.parse(ref), dest)
    assert report.resumed == staged and staged[0] not in report.downloaded
    total = len(store_files(built))
    assert len(report.downloaded) == total - 1
    assert len(blob_gets(registry, since)) == total - 1  # counted by the registry itself
    assert store_files(dest) == store_files(built) and no_stage_dirs(tmp_path)
    assert run_kvsnap("verify", dest).returncode == 0


def test_a_staged_file_that_does_not_match_its_blob_is_downloaded_again(registry, built, tmp_path):
    ref = registry.ref("ship/resume-bad")
    assert run_kvsnap("push", built, ref).returncode == 0
    dest = tmp_path / "replica"
    assert (
        run_kvsnap(
            "pull", ref, dest, env={**os.environ, "KVSNAP_FAULT": "pull-staged-blob=kill"}
        ).returncode
        == -signal.SIGKILL
    )
    (stage,) = [p for p in tmp_path.iterdir() if p.name.startswith(".kvsnap-stage-replica-")]
    (staged,) = [p for p in stage.rglob("*") if p.is_file()]
    data = staged.read_bytes()
    staged.write_bytes(data[:-1] + bytes([data[-1] ^ 0x01]))
    (stage / "junk.txt").write_text("not a store file")
    report = pull(Reference.parse(ref), dest)
    assert report.resumed == [] and len(report.downloaded) == len(store_files(built))
    assert store_files(dest) == store_files(built) and not (dest / "junk.txt").exists()
