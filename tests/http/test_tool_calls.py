"""Tool calls and reasoning on a real `kvsnap serve`, driven by real clients.

The models answer with one fixed tool call (tests/helpers/tool_models.py forces it through
their weights): a Qwen3-style template whose markers are single tokens, after a think block,
and a Llama-3-style one whose markers span two tokens each. The call must come back as
OpenAI's ``tool_calls`` (whole and streamed, the marked text never as content), with
``finish_reason: "tool_calls"``; the next turn, with the call and the tool's answer, must
render and reuse the warm prefix; ``--reasoning-parser`` must split the think block out.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers.tool_models import (
    CALL,
    LLAMA3_MODEL,
    QWEN3_MODEL,
    THOUGHT,
    TOOLS,
    make_tool_model,
)
from openai import OpenAI

from kvsnap.tools.serverproc import serving

SYSTEM = "You are a weather assistant. Answer with a tool call when a city is named."
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"}]
CALL_TURN = {"id": "call_1", "type": "function", "function": CALL}
AGENTS = [{"name": "weather", "messages": [{"role": "system", "content": SYSTEM}], "tools": TOOLS}]


def _serve(demo_models, tmp_path_factory, name, spec, args=()):
    tmp = tmp_path_factory.mktemp(name)
    model = make_tool_model(demo_models.root, name, spec)
    agents = tmp / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    argv = ["--warm-prompts", str(agents), "--served-model-name", name, *args]
    return serving(model, argv, tmp / "serve.log", env, 600)


@pytest.fixture(scope="module")
def qwen3(demo_models, tmp_path_factory):
    with _serve(demo_models, tmp_path_factory, "qwen3-tools", QWEN3_MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def qwen3_reasoning(demo_models, tmp_path_factory):
    args = ["--reasoning-parser", "auto", "--continuous-batching"]
    with _serve(demo_models, tmp_path_factory, "qwen3-think", QWEN3_MODEL, args) as server:
        yield server


@pytest.fixture(scope="module")
def llama3(demo_models, tmp_path_factory):
    with _serve(demo_models, tmp_path_factory, "llama3-tools", LLAMA3_MODEL) as server:
        yield server


def _client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)


def _check_call(call) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == CALL["name"]
    assert json.loads(call.function.arguments) == CALL["arguments"]


def _prompt_length(model: Path, messages: list) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    text = tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    return len(tok.encode(text, add_special_tokens=False))


def _stream(client: OpenAI, model: str, **kw) -> tuple[list, str]:
    """The streamed deltas and the finish reason."""
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=ASK, stream=True, **kw):
        for choice in chunk.choices:
            deltas.append(choice.delta)
            finish = choice.finish_reason or finish
    return deltas, finish


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_a_generated_call_comes_back_as_tool_calls(name, request):
    """Non-streamed: message.tool_calls with an id, the name and JSON arguments; no marker
    text in content (Qwen3's think block stays there: no --reasoning-parser)."""
    server = request.getfixturevalue(name)
    answer = _client(server).chat.completions.create(
        model=f"{name}-tools", messages=ASK, tools=TOOLS, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    _check_call(call)
    want = f"<think>{THOUGHT}</think>" if name == "qwen3" else None
    assert choice.message.content == want
    assert answer.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_a_streamed_call_comes_as_tool_call_deltas(name, request):
    """Streamed: one delta.tool_calls entry (index, id, name, arguments), the call's text never
    in a content delta, and finish_reason "tool_calls"."""
    server = request.getfixturevalue(name)
    deltas, finish = _stream(_client(server), f"{name}-tools", tools=TOOLS, temperature=0)
    assert finish == "tool_calls"
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0
    _check_call(calls[0])
    content = "".join(d.content or "" for d in deltas)
    assert content == (f"<think>{THOUGHT}</think>" if name == "qwen3" else "")


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_the_next_turn_renders_the_call_and_hits_the_cached_prefix(name, request):
    """The assistant's tool_calls (arguments as OpenAI's JSON string) and the tool's answer
    render in the next turn, which reuses at least the warm system-and-tools prefix."""
    server = request.getfixturevalue(name)
    client = _client(server)
    first = client.chat.completions.create(model=f"{name}-tools", messages=ASK, tools=TOOLS)
    (call,) = first.choices[0].message.tool_calls
    turn = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    second = client.chat.completions.create(model=f"{name}-tools", messages=turn, tools=TOOLS)
    # the template was handed the arguments as an object, as the model wrote them: the
    # Llama-3 template's tojson would quote a string twice
    as_written = [*turn[:2], {"role": "assistant", "content": "", "tool_calls": [CALL_TURN]}]
    model = request.getfixturevalue("demo_models").root / f"{name}-tools"
    assert second.usage.prompt_tokens == _prompt_length(model, as_written + turn[3:])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].finish_reason == "tool_calls"


def test_without_tools_or_with_tool_choice_none_the_text_stays_content(qwen3):
    """No tools, or tool_choice "none": nothing is parsed, the answer is the model's text."""
    url = f"{qwen3.url}/v1/chat/completions"
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        body = {"model": "qwen3-tools", "messages": ASK, **extra}
        answer = httpx.post(url, json=body, timeout=120).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert "tool_calls" not in choice["message"]
        assert f"<tool_call>{json.dumps(CALL)}</tool_call>" in choice["message"]["content"]


def test_a_tool_choice_out_of_shape_is_a_400(qwen3):
    url = f"{qwen3.url}/v1/chat/completions"
    for choice in ("sometimes", {"type": "function", "function": {"name": "nope"}}):
        body = {"model": "qwen3-tools", "messages": ASK, "tools": TOOLS, "tool_choice": choice}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tool_choice"


def test_reasoning_parser_splits_the_think_block(qwen3_reasoning):
    """--reasoning-parser auto: the think block is reasoning_content (whole and streamed), not
    content; the call still comes back."""
    client = _client(qwen3_reasoning)
    answer = client.chat.completions.create(model="qwen3-think", messages=ASK, tools=TOOLS)
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert message.content is None
    _check_call(message.tool_calls[0])
    deltas, finish = _stream(client, "qwen3-think", tools=TOOLS)
    assert finish == "tool_calls"
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == THOUGHT
    assert not "".join(d.content or "" for d in deltas)
    without_tools = client.chat.completions.create(model="qwen3-think", messages=ASK)
    message = without_tools.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert message.content == f"<tool_call>{json.dumps(CALL)}</tool_call>"
