"""A registry's redirects and slow answers are hostile -- tiny HTTP servers on 127.0.0.1.

Two servers on two ports are two origins: the registry, and a host it redirects blobs to.
Credentials (Basic, or a Bearer token) go only to the registry's own scheme, host and port.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import httpx
import pytest
from helpers.cli import run_kvsnap

from kvsnap.store.oci import (
    Credentials,
    Reference,
    RegistryAuthError,
    RegistryClient,
    RegistryError,
)

BASIC = "Basic " + base64.b64encode(b"alice:s3cret-pw").decode()
CREDS = Credentials("alice", "s3cret-pw", "the test")
BLOB = b"hello blob"
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


class Server:
    """A loopback HTTP server whose answers come from ``handle(handler)``; it records every
    request."""

    def __init__(self, handle: Callable[[BaseHTTPRequestHandler], None]):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                handle(self)

            do_HEAD = do_GET

            def log_message(self, *args):
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.host = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def answer(
    h: BaseHTTPRequestHandler, status: int, body: bytes = b"", headers: dict | None = None
) -> None:
    h.send_response(status)
    for name, value in (headers or {}).items():
        h.send_header(name, value)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)


@pytest.fixture()
def servers():
    started: list[Server] = []

    def start(handle):
        started.append(Server(handle))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def redirecting_registry(start, storage: Server) -> Server:
    """Asks for Basic credentials, then redirects blob GETs to ``storage`` (as registries backed by
    S3 do)."""

    def handle(h):
        if h.headers.get("Authorization") != BASIC:
            return answer(h, 401, b"{}", {"WWW-Authenticate": 'Basic realm="registry"'})
        answer(h, 307, headers={"Location": f"http://{storage.host}/data{h.path}"})

    return start(handle)


@pytest.mark.parametrize("challenge", ["basic", "bearer"])
def test_regression_registry_credentials_never_reach_a_redirect_target(
    servers, challenge, tmp_path
):
    """CVE-2020-15157's pattern: a blob redirected to another host that answers 401 once got the
    Basic credentials."""

    def storage_handle(h):
        if h.path.startswith("/token"):
            return answer(h, 200, b'{"token": "stolen"}', {"Content-Type": "application/json"})
        www = (
            'Basic realm="storage"'
            if challenge == "basic"
            else f'Bearer realm="http://{storage.host}/token",service="s"'
        )
        answer(h, 401, b"{}", {"WWW-Authenticate": www})

    storage = servers(storage_handle)
    registry = redirecting_registry(servers, storage)
    ref = Reference.parse(f"oci://{registry.host}/team/snaps:v1")
    with RegistryClient(ref, credentials=CREDS) as client, pytest.raises(RegistryAuthError) as err:
        client.download_blob(
            DIGEST, len(BLOB), (tmp_path / "out").open("wb"), "blocks/x.safetensors"
        )
    assert storage.host in str(err.value) and "answered HTTP 401" in str(err.value)
    # one GET, no credentials, no token request
    assert [auth for _, _, auth in storage.seen] == [None]
    assert any(auth == BASIC for _, _, auth in registry.seen)  # the registry itself did get them


def test_a_redirect_to_a_host_that_serves_the_blob_is_followed_without_credentials(
    servers, tmp_path
):
    storage = servers(lambda h: answer(h, 200, BLOB))
    registry = redirecting_registry(servers, storage)
    ref = Reference.parse(f"oci://{registry.host}/team/snaps:v1")
    out = tmp_path / "out"
    with RegistryClient(ref, credentials=CREDS) as client, out.open("wb") as fh:
        client.download_blob(DIGEST, len(BLOB), fh, "blocks/x.safetensors")
    assert out.read_bytes() == BLOB and [auth for _, _, auth in storage.seen] == [None]


def test_a_redirect_from_https_to_plain_http_is_refused():
    """Never downgrade: an https registry redirecting to http:// is an error, nothing is sent
    there."""
    sent: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(str(request.url))
        if request.url.scheme == "https":
            return httpx.Response(307, headers={"Location": f"http://{request.url.host}/data/x"})
        return httpx.Response(200, content=BLOB)

    ref = Reference.parse("oci://registry.example.com/team/snaps:v1")
    with RegistryClient(ref, credentials=CREDS, transport=httpx.MockTransport(handle)) as client:
        with pytest.raises(
            RegistryError, match=r"from https to plain http \(http://registry.example.com:80\)"
        ):
            client.download_blob(DIGEST, len(BLOB), open("/dev/null", "wb"), "blocks/x.safetensors")
    assert all(url.startswith("https://") for url in sent)


# --- deadlines: a registry that trickles ------------------------------------------------------


def trickle(h: BaseHTTPRequestHandler, headers_too: bool, stop: threading.Event) -> None:
    """An answer one byte a second (the headers too, if asked): every read makes progress, none
    ends."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4000\r\n\r\n"
    body = b'{"schemaVersion": 2' + b" " * 4000
    data = head + body if headers_too else body
    if not headers_too:
        h.wfile.write(head)
    for i in range(len(data)):
        if stop.wait(0.5 if i else 0):
            return
        try:
            h.wfile.write(data[i : i + 1])
            h.wfile.flush()
        except OSError:
            return


@pytest.fixture()
def stop_trickle():
    stop = threading.Event()
    yield stop
    stop.set()


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "headers"])
def test_regression_a_trickling_registry_hits_the_request_deadline(
    servers, stop_trickle, headers_too
):
    """Once: a registry sending a byte every few seconds never timed out (httpx bounds each read,
    not the request)."""
    from kvsnap.store.oci import RegistryUnreachableError
    from kvsnap.store.oci.deadlines import Deadlines

    server = servers(lambda h: trickle(h, headers_too, stop_trickle))
    ref = Reference.parse(f"oci://{server.host}/team/snaps:v1")
    deadlines = Deadlines(total_s=1.0, idle_s=5.0, min_rate=1e9)
    outcome: dict = {}

    def fetch() -> None:
        with RegistryClient(ref, deadlines=deadlines) as client:
            try:
                client.get_manifest()
            except RegistryUnreachableError as exc:
                outcome["error"] = exc

    t0 = time.monotonic()
    # In a thread, bounded here: without the deadline the trickle would hold it for ~30 min.
    worker = threading.Thread(target=fetch, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the request outlived its 1 s deadline while bytes trickled in"
    assert re.search(r"within its deadline of 1 s .*--registry-timeout", str(outcome["error"]))
    assert time.monotonic() - t0 < 4  # the idle timeout (5 s) never fired: bytes kept coming


def test_serve_from_a_trickling_registry_stops_at_its_deadline(
    servers, stop_trickle, demo_models, tmp_path
):
    """`serve --kv-snapshots oci://…` once hung at start; the deadline comes from the
    environment."""
    server = servers(lambda h: trickle(h, False, stop_trickle))
    env = {
        **os.environ,
        "KVSNAP_REGISTRY_TIMEOUT": "1",
        "KVSNAP_CACHE_DIR": str(tmp_path / "cache"),
        "DOCKER_CONFIG": str(tmp_path / "none"),
    }
    t0 = time.monotonic()
    r = run_kvsnap(
        "serve",
        demo_models.path("dense"),
        "--port",
        "9",
        "--kv-snapshots",
        f"oci://{server.host}/team/snaps:v1",
        env=env,
        timeout=60,
    )
    assert r.returncode == 2 and "deadline of 1 s" in r.stderr, (r.returncode, r.stderr[-2000:])
    assert time.monotonic() - t0 < 30


def test_deadlines_from_the_environment_are_checked():
    from kvsnap.errors import UsageError
    from kvsnap.store.oci.deadlines import Deadlines

    assert Deadlines.from_env(
        {"KVSNAP_REGISTRY_TIMEOUT": "7", "KVSNAP_REGISTRY_MIN_RATE": "1024"}
    ) == Deadlines(total_s=7, min_rate=1024)
    with pytest.raises(
        UsageError, match=r"\$KVSNAP_REGISTRY_IDLE_TIMEOUT is 'soon'; give a positive number"
    ):
        Deadlines.from_env({"KVSNAP_REGISTRY_IDLE_TIMEOUT": "soon"})
    assert Deadlines(total_s=10, min_rate=100).seconds_for(1000) == 20


# --- declared sizes ------------------------------------------------------------------------------


def artifact_server(
    servers, layers: list[dict], blob: Callable[[BaseHTTPRequestHandler], None]
) -> Server:
    import json

    from kvsnap.store.oci import ARTIFACT_TYPE, EMPTY_CONFIG, OCI_MANIFEST, TITLE

    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": EMPTY_CONFIG,
        "layers": [
            {
                "mediaType": "application/octet-stream",
                "digest": layer["digest"],
                "size": layer["size"],
                "annotations": {TITLE: layer["title"]},
            }
            for layer in layers
        ],
    }
    body = json.dumps(doc).encode()

    def handle(h):
        if "/manifests/" in h.path:
            return answer(h, 200, body, {"Content-Type": OCI_MANIFEST})
        blob(h)

    return servers(handle)


@pytest.mark.parametrize(
    "title, size", [("manifest.json", 10**12), ("blocks/" + "a" * 32 + ".safetensors", 10**15)]
)
def test_regression_an_oversize_declared_layer_is_refused_before_any_download(
    servers, tmp_path, title, size
):
    """Once: a manifest layer declared 10^12 bytes streamed 1.1 GB before anything was checked."""
    from kvsnap.store.oci import pull

    server = artifact_server(
        servers,
        [{"title": title, "digest": DIGEST, "size": size}],
        lambda h: answer(h, 200, b"x" * 1000),
    )
    with pytest.raises(
        RegistryError,
        match=rf"layer {title} declares {size} bytes, over .*refusing it before downloading "
        rf"anything",
    ):
        pull(f"oci://{server.host}/team/snaps:v1", tmp_path / "dest")
    assert [p for _, p, _ in server.seen if "/blobs/" in p] == [] and not (
        tmp_path / "dest"
    ).exists()


def test_a_blob_sent_larger_than_declared_is_refused_from_its_length(servers, tmp_path):
    """A registry answering with a Content-Length over the declared size: refused before the body
    is read."""
    server = artifact_server(servers, [], lambda h: answer(h, 200, b"x" * 5000))
    ref = Reference.parse(f"oci://{server.host}/team/snaps:v1")
    from kvsnap.store.oci import DigestMismatchError

    with (
        RegistryClient(ref) as client,
        pytest.raises(DigestMismatchError, match=r"sent as 5000 bytes, not the 10"),
    ):
        client.download_blob(
            DIGEST, len(BLOB), (tmp_path / "out").open("wb"), "blocks/x.safetensors"
        )
