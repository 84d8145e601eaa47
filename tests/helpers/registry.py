"""A real docker-registry on 127.0.0.1 (tests/store/conftest.py holds its fixtures) and a
raw push that writes an artifact kvsnap would never write."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from kvsnap.store.oci import (
    EMPTY_CONFIG,
    OCI_MANIFEST,
    Reference,
    RegistryClient,
)
from kvsnap.store.oci import BytesOpener as _Opener
from kvsnap.tools.serverproc import free_port

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


UPLOAD_RE = re.compile(
    r'"PUT /v2/(\S+)/blobs/uploads/\S*digest=(sha256(?::|%3A)[0-9a-f]{64})\S* HTTP/1\.[01]" 201'
)


class Registry:
    """A `docker-registry serve CONFIG` process on 127.0.0.1 with its storage folder and access
    log."""

    def __init__(self, tmp: Path, htpasswd: Path | None = None, auth_yaml: str = ""):
        self.tmp = tmp
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.root = tmp / "storage"
        self.log_path = tmp / "registry.log"
        auth = (
            f"auth:\n  htpasswd:\n    realm: kvsnap-test\n    path: {htpasswd}\n"
            if htpasswd
            else auth_yaml
        )
        config = tmp / "config.yml"
        config.write_text(
            f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: "
            f"{self.root}\nhttp:\n  addr: {self.host}\n{auth}"
        )
        cmd = [REGISTRY_BIN, "serve", str(config)]
        if os.path.exists("/usr/bin/timeout"):
            # never outlives a stuck session; a session-scoped registry lives as long as the
            # suite (CI allows 90 minutes): 30 minutes killed it mid-run on a loaded machine
            cmd = ["/usr/bin/timeout", "-k", "5", "6000", *cmd]
        with open(self.log_path, "wb") as log:
            # Its own process group, so stop() kills the registry and not only the `timeout`
            # wrapper.
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"docker-registry exited with {self.proc.returncode}:\n{self.log()[-2000:]}"
                )
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=1).status_code in (200, 401):
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"docker-registry not answering on {self.host} after 20 "
                    f"s:\n{self.log()[-2000:]}"
                )
            time.sleep(0.1)

    def ref(self, repo: str, tag: str = "v1") -> str:
        return f"oci://{self.host}/{repo}:{tag}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def uploads(self, since: int = 0) -> list[str]:
        """Digests of the blob uploads the registry completed since a log offset (its own access
        log)."""
        with open(self.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return [m.group(2).replace("%3A", ":") for m in UPLOAD_RE.finditer(text)]

    def blob_data(self, digest: str) -> Path:
        hexd = digest.split(":", 1)[1]
        return self.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def manifest(self, repo: str, tag: str, auth=None) -> httpx.Response:
        return httpx.get(
            f"http://{self.host}/v2/{repo}/manifests/{tag}",
            headers={"Accept": OCI_MANIFEST},
            auth=auth,
            timeout=10,
        )

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _push_raw(ref: Reference, files: dict[str, bytes]) -> None:
    """Push an artifact as-is, bypassing every local check (what a broken or hostile pusher could
    do)."""
    from kvsnap.store.oci import Layer, artifact_manifest

    with RegistryClient(ref, push=True) as client:
        client.upload_blob(EMPTY_CONFIG["digest"], 2, lambda: _Opener(b"{}"))
        layers = []
        for title, data in files.items():
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            if not client.blob_exists(digest):
                client.upload_blob(digest, len(data), lambda data=data: _Opener(data))
            layers.append(Layer(title, digest, len(data)))
        client.put_manifest(ref.tag, artifact_manifest(layers))
