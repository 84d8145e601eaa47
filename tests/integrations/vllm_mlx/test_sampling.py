"""`kvsnap vllm-mlx serve` holds each request's sampling values to kvsnap serve's rules (issue 39
items 1 and 5).

vllm-mlx 0.6 samples its whole text batch with the sampler of the request that made its batch
generator (a greedy request beside another key's sampled one samples too), takes a ``min_p``
outside [0, 1] or NaN into mlx-lm's ``apply_min_p``, which raises in the batch (every running
request 500s, and mlx's random state is left unusable: every later sampled request 500s), and
samples a temperature of 1e-39 at random. Real `kvsnap vllm-mlx serve --kv-snapshots` on
127.0.0.1 in vllm-mlx's cached environment, with the tiny dense demo model.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from helpers.vllm_mlx_route import AGENTS, _launch, _venv_kvsnap

from kvsnap.integrations.vllm_mlx.sampling import body_refusal, settled_min_p

# A min_p that passes every check but, in the fault server, makes mlx-lm's compiled
# apply_min_p raise inside the batch: a sampler failing whatever kvsnap settles.
FAULT_MIN_P = 0.375
FAULT_SERVER = f"""
import sys

import mlx_lm.sample_utils as sample_utils

real = sample_utils.apply_min_p


calls = [0]


def apply_min_p(logprobs, min_p, min_tokens_to_keep=1):
    if min_p == {FAULT_MIN_P}:  # from its 30th token on: the greedy request has joined by then
        calls[0] += 1
        min_p = 5.0 if calls[0] >= 30 else min_p
    return real(logprobs, min_p, min_tokens_to_keep)


sample_utils.apply_min_p = apply_min_p  # before kvsnap or vllm-mlx imports it by name
sys.argv[0] = "kvsnap"
from kvsnap.commands.cli import main

raise SystemExit(main())
"""


@pytest.fixture(scope="module")
def made(vllm_mlx_python, tmp_path_factory):
    """The dense demo model and a store for it, built in vllm-mlx's environment."""
    root = tmp_path_factory.mktemp("vllm-mlx-sampling")
    home = root / "home"
    home.mkdir()
    agents = root / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    model = root / "dense"
    _venv_kvsnap(vllm_mlx_python, home, "demo-model", model)
    _venv_kvsnap(vllm_mlx_python, home, "build", agents, "--model", model, "--out", root / "store")
    return SimpleNamespace(root=root, home=home, model=str(model), store=str(root / "store"))


def _serve(python: Path, made, name: str, program: list[str]):
    server = _launch(
        [
            str(python),
            *program,
            "vllm-mlx",
            "serve",
            made.model,
            "--continuous-batching",
            "--kv-snapshots",
            made.store,
        ],
        made.home,
        made.root / f"{name}.log",
    )
    server.wait_ready(180)
    return server


@pytest.fixture(scope="module")
def served(vllm_mlx_python, made):
    server = _serve(vllm_mlx_python, made, "server", ["-m", "kvsnap"])
    try:
        yield SimpleNamespace(url=server.url, model=made.model)
    finally:
        server.stop()


def _body(content: str = "Name three rivers.", **fields) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 0,
        **fields,
    }


def _post(server, body, path: str = "/v1/chat/completions") -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(
            server.url + path,
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=120,
        )
    return httpx.post(server.url + path, json={"model": server.model, **body}, timeout=120)


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _still_serving(server) -> None:
    """Greedy and sampled requests answer (a failed compiled filter left mlx's random state
    unusable: every sampled request 500'd after it)."""
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    _text(_post(server, _body()))
    # top_p and min_p: mlx-lm's compiled filters take mlx's random state as an input
    _text(_post(server, _body(temperature=0.8, top_p=0.9, min_p=0.05)))


def _running(server) -> bool:
    return bool(httpx.get(f"{server.url}/v1/status", timeout=10).json()["requests"])


def _beside(server, first: dict, then: dict) -> tuple[httpx.Response, httpx.Response]:
    """``first`` sent, and ``then`` once ``first`` is running in the batch: both answers."""
    answers: dict = {}

    def send(name: str, body: dict) -> None:
        try:
            answers[name] = _post(server, body)
        except httpx.HTTPError as exc:
            answers[name] = exc

    first_thread = threading.Thread(target=send, args=("first", first))
    first_thread.start()
    deadline = time.monotonic() + 60
    while not _running(server) and first_thread.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert first_thread.is_alive(), answers  # ``then`` must meet it in the batch
    send("then", then)
    first_thread.join(120)
    return answers["first"], answers["then"]


GREEDY = _body("Tell me about rivers and lakes.", max_tokens=24)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 5.0},
        {"top_k": 2**31 - 1, "temperature": 1.0},
        {"top_k": 10**30, "temperature": 0.7, "top_p": 0.9},
        {"top_p": 1e-50, "min_p": 5e-324, "temperature": 1.0},
    ],
)
def test_a_greedy_request_beside_another_keys_sampling_stays_greedy(served, sampling):
    alone = _text(_post(served, GREEDY))
    sampled, greedy = _beside(served, _body("A long story.", max_tokens=400, **sampling), GREEDY)
    assert isinstance(greedy, httpx.Response) and _text(greedy) == alone, greedy
    assert isinstance(sampled, httpx.Response) and sampled.status_code == 200, sampled
    _still_serving(served)


@pytest.mark.slow
def test_a_sampled_request_beside_a_greedy_one_samples(served):
    """The other way round: a sampled request joining a greedy batch sampled greedily."""
    greedy = _text(_post(served, GREEDY))
    # The demo model is peaked: one draw of 24 tokens at temperature 1 can equal greedy by
    # chance (it did, once in a full run); three that all do mean it sampled greedily.
    drawn = []
    for _ in range(3):
        _, sampled = _beside(
            served, _body("A long story.", max_tokens=400), {**GREEDY, "temperature": 1.0}
        )
        drawn.append(_text(sampled))
        if drawn[-1] != greedy:
            return
    raise AssertionError(f"three sampled answers all equal the greedy one: {drawn}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1e-39}, {"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-50}],
)
def test_values_that_overflow_float32_answer_as_greedy(served, sampling):
    greedy = _text(_post(served, _body()))
    for _ in range(3):
        assert _text(_post(served, _body(**sampling))) == greedy


def _raw(body: dict, field: str, literal: str) -> str:
    return json.dumps(body)[:-1] + f', "{field}": {literal}}}'


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, body, field, literal",
    [
        ("/v1/chat/completions", _body(), "min_p", "NaN"),
        ("/v1/chat/completions", _body(temperature=1.0), "min_p", "5"),
        ("/v1/chat/completions", _body(temperature=1.0), "min_p", "-0.5"),
        ("/v1/chat/completions", {**_body(), "temperature": 1.0}, "top_k", "NaN"),
        ("/v1/chat/completions", {"messages": _body()["messages"]}, "temperature", "Infinity"),
        ("/v1/completions", {"prompt": "Rivers", "max_tokens": 8}, "top_p", "NaN"),
        (
            "/v1/messages",
            {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
            "temperature",
            "NaN",
        ),
        (
            "/v1/responses",
            {"max_output_tokens": 8, "input": "Hi"},
            "top_p",
            "-Infinity",
        ),
    ],
)
def test_a_sampling_value_no_batch_can_take_is_refused_naming_its_field(
    served, path, body, field, literal
):
    r = _post(served, _raw({"model": served.model, **body}, field, literal), path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (
        field,
        "invalid_value",
        "invalid_request_error",
    ), error
    assert error["message"].startswith(f"{field}: "), error
    _still_serving(served)


@pytest.mark.slow
def test_a_sampler_that_raises_fails_its_own_request_alone(vllm_mlx_python, made, tmp_path):
    program = tmp_path / "fault_server.py"
    program.write_text(FAULT_SERVER)
    server = _serve(vllm_mlx_python, made, "fault", [str(program)])
    try:
        served = SimpleNamespace(url=server.url, model=made.model)
        alone = _text(_post(served, GREEDY))
        failing = _body("A long story.", max_tokens=400, temperature=1.0, min_p=FAULT_MIN_P)
        failed, greedy = _beside(served, failing, GREEDY)
        assert isinstance(failed, httpx.Response) and failed.status_code == 500, failed
        assert isinstance(greedy, httpx.Response) and _text(greedy) == alone, greedy
        _still_serving(served)
    finally:
        server.stop()
    assert "failed alone in its sampler" in server.log()


def test_body_checks_take_the_fields_each_route_reads():
    assert body_refusal("/v1/chat/completions", {"min_p": 1.5}) == (
        "min_p",
        "min_p: 1.5 is outside [0, 1]",
    )
    assert body_refusal("/v1/chat/completions", {"min_p": 0, "top_k": 10**30}) is None
    # vllm-mlx's /v1/responses reads no min_p or top_k; /v1/messages no min_p
    assert body_refusal("/v1/responses", {"min_p": float("nan"), "top_k": 5.0}) is None
    assert body_refusal("/v1/messages", {"min_p": 7}) is None
    assert body_refusal("/v1/messages", {"top_k": float("inf")})[0] == "top_k"
    assert body_refusal("/v1/embeddings", {"temperature": float("nan")}) is None
    assert body_refusal("/v1/chat/completions", ["not", "an", "object"]) is None
    assert [settled_min_p(v) for v in (float("nan"), -1.0, 0.25, 7.0)] == [0.0, 0.0, 0.25, 1.0]


def test_a_failed_row_sampler_leaves_mlx_random_state_usable():
    """A sampler raising inside mlx-lm's compiled apply_min_p left mlx's global random state
    a trace placeholder: every later draw on it raised (in vllm-mlx, every sampled request)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p

    from kvsnap.integrations.vllm_mlx.sampling import RowSampler

    logits = mx.random.normal((1, 50))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    row = RowSampler(lambda x: apply_min_p(x, 5.0))
    assert row(logprobs).item() == mx.argmax(logprobs, axis=-1).item()  # its row: greedy
    assert isinstance(row.error, ValueError)
    mx.eval(mx.random.categorical(logprobs))  # raised "eval an array without a primitive"
