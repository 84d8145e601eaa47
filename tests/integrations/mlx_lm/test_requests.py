"""`kvsnap mlx-lm serve` holds requests to kvsnap serve's rules (issue 39).

mlx_lm.server renders a request's ``chat_template_kwargs`` as they come (``chat_template``
included: an injected template renders, a nested loop hangs the server), hands a ``top_k``
of the vocabulary size to a sampler that raises in the batch (the generation thread dies
for good: every later request 404, /health 503), samples a temperature of 1e-39 uniformly,
and answers ``/v1/models`` with an empty 200 where the Hugging Face cache folder does not
exist. Real `kvsnap mlx-lm serve` on 127.0.0.1 with the tiny dense demo model.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from helpers.mlx_lm_route import _kvsnap_mlx_lm, _launch

NESTED_LOOPS = (
    "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
    "x{% endfor %}{% endfor %}{% endfor %}"
)


def _env(root: Path) -> dict:
    """Offline, with a Hugging Face cache folder that does not exist (a fresh machine)."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_CACHE": str(root / "no-hf-cache"),
    }


@pytest.fixture(scope="module")
def served(demo_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-lm-requests")
    model = str(demo_models.path("dense"))
    server = _launch(_kvsnap_mlx_lm(model), root / "server.log", _env(root))
    try:
        server.wait_ready(180)
        yield SimpleNamespace(url=server.url, model=model)
    finally:
        server.stop()


def _body(content: str = "Name three rivers.", **fields) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        **fields,
    }


def _post(server, body, timeout: float = 120) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(
            f"{server.url}/v1/chat/completions",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=timeout,
        )
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def _ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["choices"][0]["logprobs"]["content"]]


def _still_serving(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert _ids(_post(server, _body()))


def _refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_value", err
    return err["message"]


@pytest.mark.parametrize(
    "sampling",
    [
        {"top_k": 2**31 - 1, "temperature": 1.0},
        {"top_k": 10**30, "temperature": 0.7, "top_p": 0.9},
        {"top_p": 1e-50, "min_p": 5e-324, "temperature": 1.0},
    ],
)
def test_one_requests_sampling_values_do_not_kill_the_generation_thread(served, sampling):
    greedy = _body("Tell me about rivers and lakes.", max_tokens=24)
    alone = _ids(_post(served, greedy))
    answers: dict[str, httpx.Response | httpx.HTTPError] = {}

    def send(name: str, body: dict) -> None:
        try:
            answers[name] = _post(served, body)
        except httpx.HTTPError as exc:  # a server whose generation thread died drops it
            answers[name] = exc

    threads = [
        threading.Thread(target=send, args=("greedy", greedy)),
        threading.Thread(target=send, args=("sampled", _body("A story.", **sampling))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    sampled, other = answers["sampled"], answers["greedy"]
    assert isinstance(sampled, httpx.Response) and sampled.status_code == 200, sampled
    assert isinstance(other, httpx.Response) and _ids(other) == alone, other
    _still_serving(served)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1e-39}, {"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-50}],
)
def test_values_that_overflow_float32_answer_as_greedy(served, sampling):
    greedy = _ids(_post(served, _body()))
    for _ in range(3):
        assert _ids(_post(served, _body(**sampling))) == greedy


@pytest.mark.parametrize("field", ["min_p", "temperature", "top_p"])
def test_a_nan_sampling_value_is_refused(served, field):
    # Python's JSON reads NaN: mlx-lm's range checks let it through, and a NaN min_p raised
    # in the batch
    raw = _body().copy()
    raw.pop("temperature")
    text = httpx.Request("POST", "/", json=raw).content.decode()
    text = text[:-1] + f', "{field}": NaN}}'
    _refused(_post(served, text), field)
    _still_serving(served)


def test_an_injected_chat_template_is_refused_and_a_nested_loop_never_renders(served):
    injected = {"chat_template": "INJECTED {{ messages[0].content }}"}
    message = _refused(
        _post(served, _body(chat_template_kwargs=injected)), "chat_template_kwargs.chat_template"
    )
    assert "enable_thinking" in message  # what the model's template does read
    started = time.monotonic()
    looping = {"chat_template": NESTED_LOOPS}
    _refused(
        _post(served, _body(chat_template_kwargs=looping), timeout=30),
        "chat_template_kwargs.chat_template",
    )
    assert time.monotonic() - started < 10
    _refused(
        _post(served, _body(chat_template_kwargs={"bos_token": "x"})),
        "chat_template_kwargs.bos_token",
    )
    _refused(
        _post(served, _body(chat_template_kwargs={"enable_thinking": {"a": 1}})),
        "chat_template_kwargs.enable_thinking",
    )
    many = {"messages": [{"role": "user", "content": "x"}] * 2049}
    _refused(_post(served, {**_body(), **many}), "messages")
    # a variable the model's template reads is still the request's to set
    assert _ids(_post(served, _body(chat_template_kwargs={"enable_thinking": False})))
    _still_serving(served)


def test_models_lists_the_served_model_without_a_hugging_face_cache_folder(served):
    r = httpx.get(f"{served.url}/v1/models", timeout=10)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [str(Path(served.model).resolve())]


def test_the_model_may_come_first_without_model(demo_models, tmp_path):
    model = str(demo_models.path("dense"))
    cmd = [sys.executable, "-m", "kvsnap", "mlx-lm", "serve", model]
    server = _launch(cmd, tmp_path / "positional.log", _env(tmp_path))
    try:
        server.wait_ready(180)
        assert _ids(_post(server, _body()))
    finally:
        server.stop()
