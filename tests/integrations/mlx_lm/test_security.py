"""`kvsnap mlx-lm serve` loads only the model it was started with.

mlx_lm.server loads whatever a request's ``model``, ``adapters`` and ``draft_model`` name
from the server's disk. A real `kvsnap mlx-lm serve` on 127.0.0.1 (tiny local models)
refuses those fields, reads nothing for them and keeps answering; ``--allow-request-models``
gives upstream's behaviour back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from helpers.cli import run_kvsnap
from helpers.mlx_lm_route import AGENTS, SYSTEMS, _kvsnap_mlx_lm, _launch

LOADERS = ("model", "adapters", "draft_model")


def _python_pid(server) -> int:
    """The server's Python process (under_hard_limit starts it as ``timeout``'s child)."""
    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0]) if children else pid


def _bytes_read(server) -> int:
    """Bytes the server's process has read so far (``rchar``: files and sockets alike)."""
    for line in Path(f"/proc/{_python_pid(server)}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/PID/io")


def _weights_bytes(model: str) -> int:
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


def _post(server, **fields) -> httpx.Response:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEMS["reviewer"]},
            {"role": "user", "content": "Please review the server code."},
        ],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        **fields,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def _answer(resp: httpx.Response) -> tuple[list[int], int]:
    assert resp.status_code == 200, resp.text
    data = resp.json()
    ids = [t["id"] for t in data["choices"][0]["logprobs"]["content"]]
    return ids, data["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def local(demo_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-lm-security")
    agents = root / "agents.json"
    agents.write_text(json.dumps(AGENTS[:1]))
    served = str(demo_models.path("dense"))
    r = run_kvsnap(
        "build", agents, "--model", served, "--out", root / "snaps", "--for", "mlx-lm", "--json"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (entry,) = json.loads(r.stdout)["entries"]
    adapter = root / "adapter"
    adapter.mkdir()
    return SimpleNamespace(
        root=root,
        served=served,
        other=str(demo_models.path("hybrid")),
        adapter=str(adapter),
        store=str(root / "snaps"),
        n_tokens=entry["n_tokens"],
    )


def _env(tmp_path: Path) -> dict:
    """Offline, with an empty Hugging Face cache: mlx-lm's /v1/models scans it (and fails on
    a machine that has none)."""
    (tmp_path / "hf").mkdir()
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_CACHE": str(tmp_path / "hf"),
    }


def test_request_fields_that_load_another_model_are_refused_and_nothing_is_loaded(local, tmp_path):
    # Served as typed with a trailing slash: /v1/models lists another spelling, the resolved path.
    served = local.served + "/"
    server = _launch(
        _kvsnap_mlx_lm(served, "--kv-snapshots", local.store),
        tmp_path / "guarded.log",
        _env(tmp_path),
    )
    try:
        server.wait_ready(180)
        first = _answer(_post(server))
        assert first[1] == local.n_tokens
        (listed,) = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
        assert listed != served and listed == str(Path(served).resolve())
        missing = str(local.root / "no-such-model")
        before = _bytes_read(server)
        messages = {}
        for field, value in (
            ("model", local.other),
            ("model", missing),
            ("adapters", local.adapter),
            ("adapters", missing),
            ("draft_model", local.other),
            ("draft_model", missing),
        ):
            resp = _post(server, **{field: value})
            assert resp.status_code == 400, (field, value, resp.text)
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == field, error
            said = error["message"]
            assert f"'{field}'" in said and "--allow-request-models" in said, said
            assert json.dumps(value) in said and "to load" in said, said
            # The same words whether the path exists or not: no answer tells which paths exist.
            messages.setdefault(field, set()).add(said.replace(json.dumps(value), "PATH"))
        assert all(len(m) == 1 for m in messages.values()), messages
        # Six refusals read far less than one load of the other model's weights would.
        assert _bytes_read(server) - before < _weights_bytes(local.other) // 4
        # The served model, however a request names it, answers without a reload: the warm
        # entry (keyed by the loaded model) still hits, and the tokens are the first answer's.
        for fields in (
            {"model": served},
            {"model": listed},
            {"model": "default_model"},
            {"adapters": None, "draft_model": "default_model"},
        ):
            ids, cached = _answer(_post(server, **fields))
            assert ids == first[0] and cached >= local.n_tokens, (fields, cached)
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()[-3000:]


def _raw_post(server, head: str, body: bytes) -> tuple[int, dict]:
    """A POST written by hand (headers no client library would send); the client's side is
    then shut for writing, so a server reading "to the end" gets the body."""
    import socket

    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_a_body_of_unknown_length_cannot_carry_another_model_past_the_check(local, tmp_path):
    """``Content-Length: -1``: the check read no body and passed the request on, and mlx-lm read
    "to the end of the stream", a body naming another model, which it loaded and answered
    with. A negative length is refused; no length at all is mlx-lm's own 411."""
    server = _launch(_kvsnap_mlx_lm(local.served), tmp_path / "length.log", _env(tmp_path))
    try:
        server.wait_ready(180)
        _answer(_post(server))
        body = json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": local.other}
        ).encode()
        before = _bytes_read(server)
        status, answer = _raw_post(server, "Content-Length: -1\r\n", body)
        assert status == 400, answer
        assert answer["error"]["code"] == "invalid_content_length", answer
        assert "Content-Length -1" in answer["error"]["message"], answer
        chunked = hex(len(body))[2:].encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
        status, answer = _raw_post(server, "Transfer-Encoding: chunked\r\n", chunked)
        assert status == 411, answer
        assert _bytes_read(server) - before < _weights_bytes(local.other) // 4
        _answer(_post(server))  # still serving, the served model
    finally:
        server.stop()


def test_allow_request_models_gives_mlx_lm_servers_own_behaviour_back(local, tmp_path):
    server = _launch(
        _kvsnap_mlx_lm(local.served, "--allow-request-models"),
        tmp_path / "upstream.log",
        _env(tmp_path),
    )
    try:
        server.wait_ready(180)
        _answer(_post(server))
        before = _bytes_read(server)
        _answer(_post(server, model=local.other))
        assert _bytes_read(server) - before >= _weights_bytes(local.other)
        missing = _post(server, model=str(local.root / "no-such-model"))
        assert missing.status_code == 404 and "error" in missing.json(), missing.text
    finally:
        server.stop()


def test_no_model_is_refused_at_start_unless_request_models_are_allowed(tmp_path):
    r = run_kvsnap("mlx-lm", "serve", "--port", "1", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "add --model MODEL" in r.stderr and "--allow-request-models" in r.stderr, r.stderr
