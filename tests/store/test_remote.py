"""The remote-store seam (kvsnap/store/remote.py): a URL scheme picks the module that ships a store.

A folder stays a folder; ``oci://`` goes to kvsnap.store.oci
(tests/store/oci/test_registry.py covers it against a real registry); an unknown scheme is a
one-line usage error naming the value, the known schemes and the fix, before anything slow
runs; a new scheme is one module plus one row in ``BACKENDS`` (shown here with a real
``copy://`` backend written to a temp folder).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import MappingProxyType

import pytest
from helpers.cli import run_kvsnap

from kvsnap.errors import UsageError
from kvsnap.store import remote
from kvsnap.store.local import MANIFEST, Store

PASSWORD = "hunter2-seam"


def one_line_usage_error(r: subprocess.CompletedProcess, command: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvsnap {command}: error: "), r.stderr[-2000:]
    return lines[0]


def test_folders_stay_as_they_are(tmp_path):
    for value in (None, "", "./snaps", str(tmp_path), "relative/dir:with-colon"):
        assert remote.resolve_kv_snapshots(value) == value
        remote.check_kv_snapshots(value)  # no error, nothing imported


@pytest.mark.parametrize(
    "value",
    [
        "s3://bucket/snaps",
        "ftp://host/snaps",
        "HTTPS://host/x",
        f"s3://key:{PASSWORD}@bucket/snaps",
    ],
)
def test_an_unknown_scheme_names_the_value_the_known_schemes_and_the_fix(value):
    scheme = value.split("://")[0].lower()
    for call in (
        lambda: remote.resolve_kv_snapshots(value),
        lambda: remote.check_kv_snapshots(value),
    ):
        with pytest.raises(UsageError) as exc:
            call()
        message = str(exc.value)
        assert (
            f"--kv-snapshots '{remote.redact(value)}'" in message
            and f"no remote store backend for {scheme}://" in message
        )
        assert (
            "it knows oci://" in message
            and "give oci://HOST[:PORT]/REPO:TAG, or a local folder" in message
        )
        assert PASSWORD not in message


def test_push_and_pull_need_a_remote_url():
    with pytest.raises(
        UsageError,
        match=r"push to 'registry.example.com/team/snaps:v1' is not a remote store URL; give one "
        r"of oci://",
    ):
        remote.push("snaps", "registry.example.com/team/snaps:v1")
    with pytest.raises(
        UsageError, match=r"pull from 's3://b/x': kvsnap has no remote store backend for s3://"
    ):
        remote.pull("s3://b/x", "dest")


def test_the_seam_imports_no_backend_until_a_remote_url_is_used(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        from kvsnap.store import remote
        remote.resolve_kv_snapshots({str(tmp_path)!r})
        try:
            remote.resolve_kv_snapshots("s3://bucket/x")
        except Exception as exc:
            assert type(exc).__name__ == "UsageError", exc
        heavy = ("httpx", "mlx", "mlx_lm")
        loaded = sorted(
            m for m in sys.modules
            if m.startswith("kvsnap.store.oci") or m.split(".")[0] in heavy
        )
        assert not loaded, loaded
        remote.backend_for("oci://127.0.0.1/x/y:v1", "--kv-snapshots")
        assert "kvsnap.store.oci" in sys.modules
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


COPY_BACKEND = '''
"""A backend for copy:///ABSOLUTE/PATH: the whole contract of a remote store module."""
import shutil
from pathlib import Path
from types import SimpleNamespace

CACHE = Path(__file__).parent / "copy-cache"


def _source(url):
    return Path(url[len("copy://"):])


def fetch(url):
    dest = CACHE / _source(url).name
    shutil.copytree(_source(url), dest, dirs_exist_ok=True)
    return dest


def push(root, url, plain_http=None):
    shutil.copytree(root, _source(url), dirs_exist_ok=True)
    return SimpleNamespace(
        ref=url, manifest_digest="-", uploaded=["manifest.json"], skipped=[], uploaded_bytes=0
    )


def pull(url, dest, plain_http=None):
    shutil.copytree(_source(url), dest, dirs_exist_ok=True)
    return SimpleNamespace(
        ref=url, dest=Path(dest), manifest_digest="-", downloaded=["manifest.json"], present=[],
        downloaded_bytes=0,
    )
'''


def test_a_new_scheme_is_one_module_and_one_table_row(tmp_path, monkeypatch):
    (tmp_path / "kvsnap_copy_backend.py").write_text(COPY_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        remote, "BACKENDS", MappingProxyType({**remote.BACKENDS, "copy": "kvsnap_copy_backend"})
    )  # the one new row
    root = tmp_path / "snaps"
    root.mkdir()
    # the backend ships bytes; what a store holds is not its business
    (root / MANIFEST).write_text("{}")

    shared = tmp_path / "shared" / "snaps"
    pushed = remote.push(root, f"copy://{shared}")
    assert pushed.uploaded == [MANIFEST] and (shared / MANIFEST).read_bytes() == b"{}"
    local = remote.resolve_kv_snapshots(f"copy://{shared}")
    assert (
        Path(local) == tmp_path / "copy-cache" / "snaps"
        and Store.open(local, readonly=True).is_initialized()
    )
    pulled = remote.pull(f"copy://{shared}", tmp_path / "replica")
    assert pulled.dest == tmp_path / "replica" and (tmp_path / "replica" / MANIFEST).is_file()
    assert "copy://" in remote.known_schemes() and "oci://" in remote.known_schemes()


def test_cli_push_and_pull_refuse_an_unknown_scheme_in_one_line(tmp_path):
    line = one_line_usage_error(run_kvsnap("pull", "s3://bucket/snaps", tmp_path / "dest"), "pull")
    assert (
        "'s3://bucket/snaps'" in line
        and "no remote store backend for s3://" in line
        and "oci://" in line
    )
    assert not (tmp_path / "dest").exists()
    r = run_kvsnap("push", tmp_path, f"ftp://user:{PASSWORD}@host/snaps")
    line = one_line_usage_error(r, "push")
    assert "'ftp://***@host/snaps'" in line and PASSWORD not in r.stdout + r.stderr


def test_serve_refuses_an_unknown_scheme_before_loading_anything(tmp_path):
    """The model path does not exist: the scheme is checked first, so that is not what the error
    says."""
    line = one_line_usage_error(
        run_kvsnap(
            "serve", tmp_path / "no-model", "--kv-snapshots", "s3://bucket/snaps", timeout=120
        ),
        "serve",
    )
    assert "--kv-snapshots 's3://bucket/snaps'" in line and "it knows oci://" in line


def test_vllm_mlx_refuses_an_unknown_scheme_before_importing_vllm_mlx(tmp_path):
    r = run_kvsnap(
        "vllm-mlx",
        "serve",
        tmp_path,
        "--continuous-batching",
        "--kv-snapshots",
        "s3://bucket/snaps",
        timeout=120,
    )
    assert (
        r.returncode == 2
        and "no remote store backend for s3://" in r.stderr
        and "vllm-mlx is not installed" not in r.stderr
    ), r.stderr[-2000:]
