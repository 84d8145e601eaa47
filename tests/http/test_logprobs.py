"""`logprobs` and `top_logprobs` on `kvsnap serve`, in OpenAI's shapes, against a real
mlx_lm.server on the same demo model and prompt, greedy: the same tokens, the same
log-probabilities within float tolerance, streamed and not, on both endpoints and on both of
kvsnap's decode paths (one request at a time, and continuous batching). A sampled, seeded
answer (temperature > 0, where the chosen token is not always the likeliest) against the
demo model's own log-softmax over the tokens it sampled; unit tests of the engine's
``token_logprob`` and the OpenAI shapes."""

from __future__ import annotations

import sys

import httpx
import pytest
from helpers.mlx_lm_route import _launch

from kvsnap.http.logprobs import chat_logprobs, completion_logprobs, token_bytes_of
from kvsnap.runtime.engine.types import TokenLogprob
from kvsnap.tools.serverproc import serving

PROMPT = [{"role": "user", "content": "Review the server code, then list the steps."}]
N_GEN = 8
TOP = 5
SEED = 20240601


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
    _check_top_tokens(entry["top_logprobs"], top, tokenizer)


def _check_top_tokens(got: list, want: dict, tokenizer) -> None:
    """Each top_logprobs entry names its own token (text and bytes): one of ``want``'s ids
    ({id: logprob}) decodes to it and has its value."""
    texts = {i: tokenizer.decode([i]) for i in want}
    for t in got:
        assert bytes(t["bytes"]).decode("utf-8", "replace") == t["token"]
        assert any(
            texts[i] == t["token"] and v == pytest.approx(t["logprob"], abs=1e-3)
            for i, v in want.items()
        ), (t, want)
    assert len({t["token"] for t in got}) > 1  # the entries are not one token's


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


def test_a_sampled_tokens_logprob_is_its_own(kvsnap_server, demo_models):
    """temperature > 0, seeded: each entry's logprob is the model's log-softmax at the token it
    sampled (the demo model run here over the prompt and those tokens), not the likeliest
    token's, and its top_logprobs are that position's most likely tokens, each its own; the
    same seed gives the same answer again."""
    import mlx.core as mx

    lm = demo_models.load("dense")
    tokenizer = lm.tokenizer
    prompt = list(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True))
    body = {
        "model": "dense",
        "messages": PROMPT,
        "max_tokens": N_GEN,
        "temperature": 1.0,
        "seed": SEED,
        "logprobs": True,
        "top_logprobs": TOP,
    }
    url = f"{kvsnap_server.url}/v1/chat/completions"
    answer = httpx.post(url, json=body, timeout=120).json()
    entries = answer["choices"][0]["logprobs"]["content"]
    assert len(entries) == answer["usage"]["completion_tokens"] > 0

    # the demo vocabulary's bytes are one id's each (its texts are not: pieces of a character)
    token_bytes = token_bytes_of(tokenizer)
    by_bytes = {token_bytes(i): i for i in range(len(tokenizer.vocab))}
    assert len(by_bytes) == len(tokenizer.vocab)
    ids = [by_bytes[bytes(e["bytes"])] for e in entries]
    logits = lm.model(mx.array([prompt + ids]))[0, len(prompt) - 1 :].astype(mx.float32)
    rows = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()

    not_top = 0
    for e, token, row in zip(entries, ids, rows):
        assert e["logprob"] == pytest.approx(row[token], abs=1e-3)
        ranked = sorted(range(len(row)), key=lambda i: -row[i])
        not_top += ranked[0] != token and row[ranked[0]] - row[token] > 0.01
        want = {i: row[i] for i in ranked[: 4 * TOP]}  # ties at the cut: any of them may show
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(
            [row[i] for i in ranked[:TOP]], abs=1e-3
        )
        _check_top_tokens(e["top_logprobs"], want, tokenizer)
    assert not_top > 0, "the seed sampled only the likeliest tokens: the test would not bite"
    again = httpx.post(url, json=body, timeout=120).json()
    assert again["choices"][0]["logprobs"]["content"] == entries


def test_token_logprob_is_the_chosen_tokens_value():
    """The engine's entry for a token that is not the likeliest: its own value; the top most
    likely first."""
    import mlx.core as mx

    from kvsnap.runtime.engine.sampling import token_logprob

    logits = mx.array([0.5, 3.0, 1.0, 2.0, -1.0])
    logprobs = logits - mx.logsumexp(logits)
    want = logprobs.tolist()
    entry = token_logprob(logprobs, 2, 3)
    assert entry.token == 2
    assert entry.logprob == pytest.approx(want[2])
    assert [i for i, _ in entry.top] == [1, 3, 2]
    assert [v for _, v in entry.top] == pytest.approx([want[1], want[3], want[2]])
    assert token_logprob(logprobs, 4, 0) == TokenLogprob(4, pytest.approx(want[4]))


# token ids of a made-up vocabulary: two whole tokens, and two pieces of one 3-byte character
PIECES = {1: b" the", 2: b" a", 3: b"\xe2", 4: b"\xe2\x80"}


def test_chat_top_logprobs_name_their_own_tokens():
    entries = [TokenLogprob(2, -1.5, ((1, -0.5), (2, -1.5), (3, -2.0)))]
    (entry,) = chat_logprobs(entries, PIECES.__getitem__)["content"]
    assert (entry["token"], entry["logprob"], entry["bytes"]) == (" a", -1.5, list(b" a"))
    assert [(t["token"], t["logprob"], t["bytes"]) for t in entry["top_logprobs"]] == [
        (" the", -0.5, list(b" the")),
        (" a", -1.5, list(b" a")),
        ("\ufffd", -2.0, [0xE2]),
    ]


def test_completion_top_logprobs_of_texts_alike_keep_the_likeliest():
    """Two pieces of one character both read U+FFFD: the key holds the likelier one's value,
    whichever of them was chosen."""
    for chosen in (3, 4):
        entries = [TokenLogprob(chosen, -1.0, ((1, -0.2), (3, -1.0), (4, -1.1), (2, -3.0)))]
        lp = completion_logprobs(entries, PIECES.__getitem__)
        assert lp["top_logprobs"] == [{" the": -0.2, "\ufffd": -1.0, " a": -3.0}]
        assert lp["tokens"] == ["\ufffd"] and lp["token_logprobs"] == [-1.0]
