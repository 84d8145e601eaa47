"""Issue 24: a registry's redirects and slow answers are hostile -- tiny HTTP servers on 127.0.0.1.

Two servers on two ports are two origins: the registry, and a host it redirects blobs to.
Credentials (Basic, or a Bearer token) go only to the registry's own scheme, host and port.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import httpx
import pytest

from kvsnap.store.oci import Credentials, Reference, RegistryAuthError, RegistryClient, RegistryError

BASIC = "Basic " + base64.b64encode(b"alice:s3cret-pw").decode()
CREDS = Credentials("alice", "s3cret-pw", "the test")
BLOB = b"hello blob"
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


class Server:
    """A loopback HTTP server whose answers come from ``handle(handler)``; it records every request."""

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
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def answer(h: BaseHTTPRequestHandler, status: int, body: bytes = b"", headers: dict | None = None) -> None:
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
    """Asks for Basic credentials, then redirects blob GETs to ``storage`` (as registries backed by S3 do)."""

    def handle(h):
        if h.headers.get("Authorization") != BASIC:
            return answer(h, 401, b"{}", {"WWW-Authenticate": 'Basic realm="registry"'})
        answer(h, 307, headers={"Location": f"http://{storage.host}/data{h.path}"})

    return start(handle)


@pytest.mark.parametrize("challenge", ["basic", "bearer"])
def test_regression_registry_credentials_never_reach_a_redirect_target(servers, challenge, tmp_path):
    """CVE-2020-15157's pattern: a blob redirected to another host that answers 401 once got the Basic credentials."""
    def storage_handle(h):
        if h.path.startswith("/token"):
            return answer(h, 200, b'{"token": "stolen"}', {"Content-Type": "application/json"})
        www = 'Basic realm="storage"' if challenge == "basic" else f'Bearer realm="http://{storage.host}/token",service="s"'
        answer(h, 401, b"{}", {"WWW-Authenticate": www})

    storage = servers(storage_handle)
    registry = redirecting_registry(servers, storage)
    ref = Reference.parse(f"oci://{registry.host}/team/snaps:v1")
    with RegistryClient(ref, credentials=CREDS) as client, pytest.raises(RegistryAuthError) as err:
        client.download_blob(DIGEST, len(BLOB), (tmp_path / "out").open("wb"), "blocks/x.safetensors")
    assert storage.host in str(err.value) and "answered HTTP 401" in str(err.value)
    assert [auth for _, _, auth in storage.seen] == [None]  # one GET, no credentials, no token request
    assert any(auth == BASIC for _, _, auth in registry.seen)  # the registry itself did get them


def test_a_redirect_to_a_host_that_serves_the_blob_is_followed_without_credentials(servers, tmp_path):
    storage = servers(lambda h: answer(h, 200, BLOB))
    registry = redirecting_registry(servers, storage)
    ref = Reference.parse(f"oci://{registry.host}/team/snaps:v1")
    out = tmp_path / "out"
    with RegistryClient(ref, credentials=CREDS) as client, out.open("wb") as fh:
        client.download_blob(DIGEST, len(BLOB), fh, "blocks/x.safetensors")
    assert out.read_bytes() == BLOB and [auth for _, _, auth in storage.seen] == [None]


def test_a_redirect_from_https_to_plain_http_is_refused():
    """Never downgrade: an https registry redirecting to http:// is an error, nothing is sent there."""
    sent: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(str(request.url))
        if request.url.scheme == "https":
            return httpx.Response(307, headers={"Location": f"http://{request.url.host}/data/x"})
        return httpx.Response(200, content=BLOB)

    ref = Reference.parse("oci://registry.example.com/team/snaps:v1")
    with RegistryClient(ref, credentials=CREDS, transport=httpx.MockTransport(handle)) as client:
        with pytest.raises(RegistryError, match=r"from https to plain http \(http://registry.example.com:80\)"):
            client.download_blob(DIGEST, len(BLOB), open("/dev/null", "wb"), "blocks/x.safetensors")
    assert all(url.startswith("https://") for url in sent)
