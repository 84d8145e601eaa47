"""Anthropic Messages and OpenAI Responses on a real `kvsnap serve`, driven by the official
`anthropic` and `openai` SDKs.

The demo models answer with one fixed tool call (tests/helpers/tool_models.py): a Qwen3-style
template with single-token markers after a think block, and a Llama-3-style one whose
markers span two tokens. The Qwen3 server starts from a store built from agent entries (an
Anthropic body and a Responses body, as the clients send them), so the agents' first
requests must read their prefix from it; the Llama-3 server has API keys and records the
agents it serves (`--record-agents`), and that file must build.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from helpers.cli import build_args, run_kvsnap
from helpers.tool_models import CALL, LLAMA3_MODEL, QWEN3_MODEL, THOUGHT, TOOLS, make_tool_model

from kvsnap.tools.serverproc import serving

SYSTEM = "You are a weather assistant. Answer with a tool call when a city is named."
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "strict": False,
        **{k: t["function"][k] for k in ("name", "description", "parameters")},
    }
    for t in TOOLS
] + [{"type": "web_search", "external_web_access": False}]
DEVELOPER = "You are a coding agent. Keep answers short."


def _system(tag: str) -> list:
    return [
        {"type": "text", "text": BILLING.format(tag)},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
    ]


def _claude_messages(env: str) -> list:
    """A user turn of reminder blocks and the prompt, then the environment as a system
    message, as Claude Code sends them."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>be careful</system-reminder>"},
                {"type": "text", "text": "Weather in Paris?"},
            ],
        },
        {"role": "system", "content": f"# Environment\nWorking directory: {env}"},
    ]


def _codex_input(env: str) -> list:
    return [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": DEVELOPER}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": f"<environment_context>{env}</environment_context>"}
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather in Paris?"}],
        },
    ]


AGENTS = [
    {
        "name": "claude-code",
        "anthropic": {
            "system": _system("0b8"),
            "tools": ANTHROPIC_TOOLS,
            "messages": _claude_messages("/tmp/a"),
            "max_tokens": 32000,
            "stream": True,
        },
    },
    {
        "name": "codex",
        "responses": {
            "input": _codex_input("/tmp/a"),
            "tools": RESPONSES_TOOLS,
            "stream": True,
            "store": False,
        },
    },
]


def _warm_lengths(model) -> dict:
    from transformers import AutoTokenizer

    from kvsnap.prompts import parse_warm_prompts, warm_prefix

    tok = AutoTokenizer.from_pretrained(str(model))
    entries = parse_warm_prompts(AGENTS).entries
    return {e.name: len(warm_prefix(tok, e).tokens) for e in entries}


@pytest.fixture(scope="module")
def qwen3(demo_models, tmp_path_factory):
    """Started from a store `kvsnap build` made of the two agent entries."""
    tmp = tmp_path_factory.mktemp("agents-qwen3")
    model = make_tool_model(demo_models.root, "qwen3-agents", QWEN3_MODEL)
    agents = tmp / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    build = run_kvsnap(*build_args(agents, model, tmp / "store"), env=env, timeout=600)
    assert build.returncode == 0, build.stderr
    assert "anthropic body: system" in build.stdout + build.stderr  # where it cut
    argv = [
        "--warm-prompts",
        str(agents),
        "--kv-snapshots",
        str(tmp / "store"),
        "--served-model-name",
        "qwen3-agents",
        "--reasoning-parser",
        "auto",
    ]
    with serving(model, argv, tmp / "serve.log", env, 600) as server:
        server.warm = _warm_lengths(model)
        yield server


KEY_A, KEY_B = "agent-key-aaaa-1111", "agent-key-bbbb-2222"


@pytest.fixture(scope="module")
def llama3(demo_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents-llama3")
    model = make_tool_model(demo_models.root, "llama3-agents", LLAMA3_MODEL)
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache"), "KVSNAP_API_KEY": f"{KEY_A},{KEY_B}"}
    argv = ["--served-model-name", "llama3-agents", "--record-agents", str(tmp / "recorded.json")]
    with serving(model, argv, tmp / "serve.log", env, 600) as server:
        server.model, server.recorded, server.tmp = model, tmp / "recorded.json", tmp
        yield server


def _anthropic(server, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, timeout=120, max_retries=0)


def _openai(server, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=120, max_retries=0)


def _cached(server, key: str | None = None) -> int:
    return server.status(key)["tokens"]["cached"]


def test_claude_code_first_request_after_a_build_reads_the_agent_prefix_from_the_store(qwen3):
    """The first request, with another billing hash and another folder than the entry, reuses
    the whole warm prefix (system + tools): usage says so, /v1/status counts the same, and
    the answer's blocks are the think block and the call."""
    warm = qwen3.warm["claude-code"]
    assert warm > 100
    status = qwen3.status()
    assert status["warmup"]["from_snapshots"] == 2 and status["warmup"]["prefilled"] == 0
    before = _cached(qwen3)
    client = _anthropic(qwen3)
    msg = client.messages.create(
        model="qwen3-agents",
        max_tokens=32000,  # beyond the context: a cap, as agents send it
        system=_system("fff"),
        tools=ANTHROPIC_TOOLS,
        messages=_claude_messages("/home/someone/else"),
        thinking={"type": "adaptive"},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "high"}},
        extra_query={"beta": "true"},
        extra_headers={"anthropic-beta": "claude-code-20250219,unknown-beta-2099"},
    )
    assert msg.usage.cache_read_input_tokens == warm
    assert _cached(qwen3) - before == warm
    count = client.messages.count_tokens(
        model="qwen3-agents",
        system=_system("fff"),
        tools=ANTHROPIC_TOOLS,
        messages=_claude_messages("/home/someone/else"),
    )
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == count.input_tokens
    assert msg.usage.cache_creation_input_tokens == 0
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == THOUGHT
    assert msg.content[1].name == CALL["name"] and msg.content[1].input == CALL["arguments"]
    assert msg.stop_reason == "tool_use"


@pytest.mark.parametrize("which", ["qwen3", "llama3"])
def test_a_streamed_tool_use_round_trip_hits_the_cached_prefix(which, request):
    server = request.getfixturevalue(which)
    key = KEY_A if which == "llama3" else "none"
    client = _anthropic(server, key)
    name = f"{which}-agents"
    with client.messages.stream(
        model=name,
        max_tokens=64,
        system=_system("abc"),
        tools=ANTHROPIC_TOOLS,
        messages=_claude_messages("/w"),
    ) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds  # the call's input as an input_json_delta
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.input == CALL["arguments"] and first.stop_reason == "tool_use"
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    turn = _claude_messages("/w") + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": [{"type": "text", "text": "sunny"}],
                }
            ],
        },
    ]
    second = client.messages.create(
        model=name, max_tokens=64, system=_system("abc"), tools=ANTHROPIC_TOOLS, messages=turn
    )
    # the tool_result turn rendered and reused (at least) the first request's prompt
    assert second.usage.cache_read_input_tokens >= (prompt // 128) * 128
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > prompt


def test_codex_first_request_reads_its_prefix_and_the_call_comes_back_as_a_function_call(qwen3):
    warm = qwen3.warm["codex"]
    client = _openai(qwen3)
    before = _cached(qwen3)
    resp = client.responses.create(
        model="qwen3-agents",
        input=_codex_input("/somewhere/else"),
        tools=RESPONSES_TOOLS,
        store=False,
        parallel_tool_calls=True,
        reasoning={"summary": "auto"},
        prompt_cache_key="thread-1",
        include=["reasoning.encrypted_content"],
    )
    assert resp.usage.input_tokens_details.cached_tokens == warm
    assert _cached(qwen3) - before == warm
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "function_call"]
    call = resp.output[1]
    assert call.name == CALL["name"] and json.loads(call.arguments) == CALL["arguments"]
    # the next turn, streamed: the call and its output render and reuse the first prompt
    turn = _codex_input("/somewhere/else") + [
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    events = list(
        client.responses.create(
            model="qwen3-agents", input=turn, tools=RESPONSES_TOOLS, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.usage.input_tokens_details.cached_tokens >= resp.usage.input_tokens - 1


def test_stop_sequences_and_max_tokens_end_the_answer_as_each_api_says(qwen3):
    client = _anthropic(qwen3)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    stopped = client.messages.create(
        model="qwen3-agents", max_tokens=64, messages=ask, stop_sequences=["city"]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "city"
    cut = client.messages.create(model="qwen3-agents", max_tokens=2, messages=ask)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    incomplete = _openai(qwen3).responses.create(
        model="qwen3-agents", input="Weather in Paris?", max_output_tokens=2
    )
    assert incomplete.status == "incomplete"
    assert incomplete.incomplete_details.reason == "max_output_tokens"


def test_errors_come_back_in_each_apis_shape_naming_the_field(llama3):
    url = llama3.url
    headers = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
    image = {
        "model": "llama3-agents",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
    }
    r = httpx.post(f"{url}/v1/messages", json=image, headers=headers)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].type" in body["error"]["message"]
    r = httpx.post(f"{url}/v1/messages", json={**image, "max_tokens": "lots"}, headers=headers)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/messages", json=image, headers={"x-api-key": "wrong-key-123456"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        _anthropic(llama3, KEY_A).messages.create(
            model="claude-opus-9", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    auth = {"Authorization": f"Bearer {KEY_A}"}
    r = httpx.post(
        f"{url}/v1/responses",
        json={"model": "llama3-agents", "input": "hi", "previous_response_id": "resp_1"},
        headers=auth,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(
        f"{url}/v1/responses",
        json={"model": "llama3-agents", "input": "hi", "tools": [{"type": "teleport"}]},
        headers=auth,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type"


def test_recorded_agents_are_deduplicated_kept_apart_per_key_and_build(llama3):
    """Two requests of one agent differing only in the billing hash and the later messages
    are one entry; the same agent under another key is another; the file builds."""
    for key, tag in ((KEY_A, "111"), (KEY_A, "222"), (KEY_B, "333")):
        _anthropic(llama3, key).messages.create(
            model="llama3-agents",
            max_tokens=4,
            system=_system(tag),
            tools=ANTHROPIC_TOOLS,
            messages=_claude_messages(tag),
        )
    _openai(llama3, KEY_A).responses.create(
        model="llama3-agents", input=_codex_input("x"), tools=RESPONSES_TOOLS, max_output_tokens=4
    )
    chat = {
        "model": "llama3-agents",
        "max_tokens": 4,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
    }
    r = httpx.post(
        f"{llama3.url}/v1/chat/completions",
        json=chat,
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    entries = json.loads(llama3.recorded.read_text())
    names = [e["name"] for e in entries]
    assert [e["messages"] for e in entries if e["name"].startswith("chat-")] == [
        chat["messages"][:1]
    ]
    assert len([n for n in names if n.startswith("anthropic-")]) == 2, names
    assert len({n.split("-")[1] for n in names if n.startswith("anthropic-")}) == 2  # per key
    assert any(n.startswith("responses-") for n in names)
    assert all("messages" not in e.get("anthropic", {}) for e in entries)  # no conversation kept
    store = llama3.tmp / "store"
    env = {"KVSNAP_CACHE_DIR": str(llama3.tmp / "cache")}
    build = run_kvsnap(*build_args(llama3.recorded, llama3.model, store), env=env, timeout=600)
    assert build.returncode == 0, build.stderr


def test_an_agent_conversation_survives_a_restart_with_persist_requests(demo_models, tmp_path):
    """Turn one on a server persisting requests; after a restart, turn two (the call and its
    result) reads turn one's prompt from the store."""
    model = make_tool_model(demo_models.root, "qwen3-agents", QWEN3_MODEL)
    store = tmp_path / "store"
    store.mkdir()
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["--served-model-name", "m", "--kv-snapshots", str(store), "--persist-requests"]
    ask = {"model": "m", "max_tokens": 64, "system": _system("a1"), "tools": ANTHROPIC_TOOLS}
    with serving(model, argv, tmp_path / "serve1.log", env, 600) as server:
        first = _anthropic(server).messages.create(**ask, messages=_claude_messages("/p"))
        prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    call = next(b for b in first.content if b.type == "tool_use")
    turn = _claude_messages("/p") + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    with serving(model, argv, tmp_path / "serve2.log", env, 600) as server:
        second = _anthropic(server).messages.create(**ask, messages=turn)
    assert second.usage.cache_read_input_tokens >= prompt - 1  # all but the prompt's last token
