"""`logprobs` and `top_logprobs` on `kvsnap serve`, in OpenAI's shapes, against a real
mlx_lm.server on the same demo model and prompt, greedy: the same tokens, the same
log-probabilities within float tolerance, streamed and not, on both endpoints and on both of
kvsnap's decode paths (one request at a time, and continuous batching)."""

from __future__ import annotations

import sys

import httpx
import pytest
from helpers.mlx_lm_route import _launch

from kvsnap.tools.serverproc import serving

PROMPT = [{"role": "user", "content": "Review the server code, then list the steps."}]
N_GEN = 8
TOP = 5


@pytest.fixture(scope="module")
def reference(demo_models, tmp_path_factory):
    """mlx_lm.server's greedy answer with top-5 log-probabilities, per token: (id, logprob,
    {id: logprob} of the top 5)."""
    tmp = tmp_path_factory.mktemp("mlx-lm-logprobs")
    model = str(demo_models.path("dense"))
    server = _launch([sys.executable, "-m", "mlx_lm", "server", "--model", model], tmp / "log")
    try:
        server.wait_ready(180)
        body = {"messages": PROMPT, "max_tokens": N_GEN, "temperature": 0, "logprobs": True}
        url = f"{server.url}/v1/chat/completions"
        chosen = httpx.post(url, json=body, timeout=120).json()
        # with top_logprobs, mlx_lm.server's entry is the first of an unsorted top (not always
        # the chosen token): the chosen ones come from a request without
        body["top_logprobs"] = TOP
        tops = httpx.post(url, json=body, timeout=120).json()
    finally:
        server.stop()
    return [
        (t["id"], t["logprob"], {x["id"]: x["logprob"] for x in top["top_logprobs"]})
        for t, top in zip(
            chosen["choices"][0]["logprobs"]["content"], tops["choices"][0]["logprobs"]["content"]
        )
    ]


@pytest.fixture(scope="module", params=["sequential", "batched"])
def kvsnap_server(request, demo_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"logprobs-{request.param}")
    args = ["--continuous-batching"] if request.param == "batched" else []
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    with serving(demo_models.path("dense"), args, tmp / "serve.log", env, 600) as server:
        yield server


def _check_entry(entry: dict, want: tuple, tokenizer) -> None:
    """One chat ``logprobs.content`` entry against mlx_lm.server's for the same position."""
    token_id, logprob, top = want
    assert entry["logprob"] == pytest.approx(logprob, abs=1e-3)
    assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    assert entry["token"] == tokenizer.decode([token_id])
    got_top = [t["logprob"] for t in entry["top_logprobs"]]
    assert got_top == sorted(got_top, reverse=True)
    assert got_top == pytest.approx(sorted(top.values(), reverse=True), abs=1e-3)
    assert entry["top_logprobs"][0]["logprob"] == pytest.approx(logprob, abs=1e-3)  # greedy


def test_chat_logprobs_equal_mlx_lm_servers(kvsnap_server, reference, demo_models):
    """The openai client, not streamed and streamed: each token's log-probability and its top 5
    are mlx_lm.server's."""
    from openai import OpenAI

    tokenizer = demo_models.load("dense").tokenizer
    client = OpenAI(base_url=f"{kvsnap_server.url}/v1", api_key="none")
    kwargs = dict(
        model="dense",
        messages=PROMPT,
        max_tokens=N_GEN,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
    )
    whole = client.chat.completions.create(**kwargs)
    entries = [e.model_dump() for e in whole.choices[0].logprobs.content]
    assert len(entries) == len(reference) == N_GEN
    for entry, want in zip(entries, reference):
        _check_entry(entry, want, tokenizer)
    assert "".join(e["token"] for e in entries) == whole.choices[0].message.content

    streamed, text = [], ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            streamed += [e.model_dump() for e in choice.logprobs.content]
    assert text == whole.choices[0].message.content
    assert streamed == entries


def test_completions_logprobs_in_the_legacy_shape(kvsnap_server, reference, demo_models):
    """`logprobs: N` on /v1/completions: tokens, token_logprobs, top_logprobs (text to
    logprob) and text_offset, streamed or not; the values mlx_lm.server's for the same prompt
    tokens."""
    tokenizer = demo_models.load("dense").tokenizer
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    body = {"model": "dense", "prompt": list(prompt), "max_tokens": N_GEN, "temperature": 0}
    url = f"{kvsnap_server.url}/v1/completions"
    r = httpx.post(url, json={**body, "logprobs": TOP}, timeout=120).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([w[1] for w in reference], abs=1e-3)
    assert lp["tokens"] == [tokenizer.decode([w[0]]) for w in reference]
    for top, want in zip(lp["top_logprobs"], reference):
        # texts alike (parts of one character) share a key, the likeliest's value
        assert 0 < len(top) <= TOP
        assert max(top.values()) == pytest.approx(max(want[2].values()), abs=1e-3)
        for value in top.values():
            assert any(value == pytest.approx(v, abs=1e-3) for v in want[2].values())
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets
    assert "".join(lp["tokens"]) == choice["text"]

    plain = httpx.post(url, json={**body, "logprobs": 0}, timeout=120).json()
    assert plain["choices"][0]["logprobs"]["top_logprobs"] == [None] * N_GEN
    assert httpx.post(url, json=body, timeout=120).json()["choices"][0]["logprobs"] is None

    merged: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", url, json={**body, "logprobs": TOP, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                part = httpx.Response(200, content=line[6:]).json()["choices"][0]["logprobs"]
                for key in merged:
                    merged[key] += part[key] if part else []
    assert merged == lp


def test_logprobs_are_checked(kvsnap_server):
    url = kvsnap_server.url
    chat = {"model": "dense", "messages": PROMPT, "max_tokens": 1}
    for bad in ({"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}):
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, **bad}, timeout=60)
        assert r.status_code == 400, r.text
    completion = {"model": "dense", "prompt": "hi", "max_tokens": 1, "logprobs": 21}
    assert httpx.post(f"{url}/v1/completions", json=completion, timeout=60).status_code == 400
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()
    assert r["choices"][0]["logprobs"] is None
