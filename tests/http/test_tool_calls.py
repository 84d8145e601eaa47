"""Tool calls and reasoning on a real `kvsnap serve`, driven by real clients.

The models answer with one fixed tool call (tests/helpers/tool_models.py forces it through
their weights): a Qwen3-style template whose markers are single tokens, after a think block,
and a Llama-3-style one whose markers span two tokens each. The call must come back as
OpenAI's ``tool_calls`` (whole and streamed, the marked text never as content), with
``finish_reason: "tool_calls"``; the next turn, with the call and the tool's answer, must
render and reuse the warm prefix; ``--reasoning-parser`` must split the think block out.
Two more: one answering with two calls, the first in pieces (so ``max_tokens`` can cut it),
and a DeepSeek-R1-style one reasoning from its first token and calling with "parameters".
The AnswerSplitter's unit tests pin the same cases on mlx-lm's json_tools parser.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers.tool_models import (
    CALL,
    CALL_JSON,
    LLAMA3_MODEL,
    PAIR_CALLS,
    PAIR_CITY,
    PAIR_HEAD,
    PAIR_MODEL,
    PAIR_TAIL,
    PAIR_TIME_JSON,
    PAIR_TOOLS,
    PARAMETERS_CALL_JSON,
    QWEN3_MODEL,
    R1_MODEL,
    THOUGHT,
    TOOLS,
    make_tool_model,
)
from openai import OpenAI

from kvsnap.http.tool_calls import AnswerSplitter, OutputRules, output_rules
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


@pytest.fixture(scope="module")
def pair(demo_models, tmp_path_factory):
    with _serve(demo_models, tmp_path_factory, "qwen3-pair", PAIR_MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def r1(demo_models, tmp_path_factory):
    args = ["--reasoning-parser", "deepseek_r1"]
    with _serve(demo_models, tmp_path_factory, "llama3-r1", R1_MODEL, args) as server:
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


def _stream(client: OpenAI, model: str, messages=ASK, **kw) -> tuple[list, str]:
    """The streamed deltas and the finish reason."""
    deltas, finish = [], None
    stream = client.chat.completions.create(model=model, messages=messages, stream=True, **kw)
    for chunk in stream:
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


def _calls(calls) -> list:
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls]


def _streamed_calls(deltas) -> list:
    """The calls as a streaming client puts them together: the parts of each ``index`` joined
    (the openai SDK's accumulators and agent frameworks merge by index)."""
    merged: dict[int, dict] = {}
    for d in deltas:
        for c in d.tool_calls or []:
            call = merged.setdefault(c.index, {"ids": [], "name": "", "arguments": ""})
            call["ids"].append(c.id)
            call["name"] += c.function.name or ""
            call["arguments"] += c.function.arguments or ""
    return [merged[i] for i in sorted(merged)]


def test_two_calls_in_one_answer_come_back_as_two(pair):
    """Parallel calls: two message.tool_calls with their own ids; streamed, two entries with
    index 0 and 1 (one index for both would merge them into one call in every client)."""
    client = _client(pair)
    answer = client.chat.completions.create(
        model="qwen3-pair", messages=ASK, tools=PAIR_TOOLS, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert _calls(choice.message.tool_calls) == list(PAIR_CALLS)
    assert len({c.id for c in choice.message.tool_calls}) == 2

    deltas, finish = _stream(client, "qwen3-pair", tools=PAIR_TOOLS, temperature=0)
    assert finish == "tool_calls"
    assert [c.index for d in deltas for c in d.tool_calls or []] == [0, 1]
    merged = _streamed_calls(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in merged] == [
        (c["name"], c["arguments"]) for c in PAIR_CALLS
    ]
    assert [len(c["ids"]) for c in merged] == [1, 1] and merged[0]["ids"] != merged[1]["ids"]
    assert not "".join(d.content or "" for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_what_was_generated_with_finish_reason_length(pair, stream):
    """max_tokens inside a call's JSON: the text as generated, in content, with no end marker
    made up; after the JSON (or inside its end marker): the call, kept. Either way
    finish_reason is "length", never "tool_calls"."""
    client = _client(pair)
    base = dict(model="qwen3-pair", messages=ASK, tools=PAIR_TOOLS, temperature=0)
    # the chain: <tool_call> HEAD Lisbon TAIL </tool_call> <tool_ call> TIME </tool_c all> end
    cases = {
        2: (f"<tool_call>{PAIR_HEAD}", []),
        3: (f"<tool_call>{PAIR_HEAD}{PAIR_CITY}", []),
        4: (None, list(PAIR_CALLS[:1])),
        9: (None, list(PAIR_CALLS)),  # the second call cut inside its end marker
    }
    for max_tokens, (content, calls) in cases.items():
        if stream:
            deltas, finish = _stream(client, **base, max_tokens=max_tokens)
            text = "".join(d.content or "" for d in deltas) or None
            got = [
                {"name": c["name"], "arguments": json.loads(c["arguments"])}
                for c in _streamed_calls(deltas)
            ]
        else:
            choice = client.chat.completions.create(**base, max_tokens=max_tokens).choices[0]
            finish, text = choice.finish_reason, choice.message.content
            got = _calls(choice.message.tool_calls or [])
        assert (finish, text, got) == ("length", content, calls), max_tokens


def test_deepseek_r1_reasons_from_the_first_token_and_reads_parameters(r1):
    """--reasoning-parser deepseek_r1 on an answer that never opens <think>: the text before
    </think> is reasoning_content, whole and streamed; the call written with "parameters"
    (Llama-3.1's key) comes back with those as its arguments."""
    client = _client(r1)
    answer = client.chat.completions.create(model="llama3-r1", messages=ASK, tools=TOOLS)
    choice = answer.choices[0]
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    assert choice.message.content is None
    assert _calls(choice.message.tool_calls) == [CALL]
    assert choice.finish_reason == "tool_calls"

    deltas, finish = _stream(client, "llama3-r1", tools=TOOLS)
    assert finish == "tool_calls"
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == THOUGHT
    assert not "".join(d.content or "" for d in deltas)
    (call,) = _streamed_calls(deltas)
    assert (call["name"], json.loads(call["arguments"])) == (CALL["name"], CALL["arguments"])


# --- AnswerSplitter alone, on mlx-lm's json_tools parser (Qwen3's and Hermes' calls)


def _json_rules() -> OutputRules:
    from mlx_lm.tool_parsers import json_tools

    return OutputRules(
        tool_start="<tool_call>",
        tool_end="</tool_call>",
        tool_parser=json_tools.parse_tool_call,
        parser_name="json_tools",
    )


def _split(pieces, rules=None, tools=TOOLS, prompt_tail="") -> tuple[AnswerSplitter, list]:
    """The splitter fed ``pieces`` one at a time and finished, and every delta it gave."""
    splitter = AnswerSplitter(rules or _json_rules(), tools, None, prompt_tail)
    deltas = [d for piece in pieces for d in splitter.feed(piece)]
    return splitter, deltas + splitter.finish()


def test_splitter_a_call_cut_inside_its_json_is_content_as_written():
    written = f"<tool_call>{PAIR_HEAD}{PAIR_CITY}"
    splitter, deltas = _split(["<tool_call>", PAIR_HEAD, PAIR_CITY])
    assert splitter.tool_calls == []
    assert "".join(d.get("content", "") for d in deltas) == written
    assert splitter.message() == {"content": written}
    assert splitter.finish_reason("length") == "length"


@pytest.mark.parametrize("tail", ["", "\n", "<", "</tool_c"])
def test_splitter_a_call_cut_after_its_json_is_a_call_with_finish_reason_length(tail):
    """Cut after the JSON, inside the end marker or not: the call; "length" stays "length"."""
    pieces = ["<tool_call>", PAIR_HEAD, PAIR_CITY, PAIR_TAIL, tail]
    splitter, deltas = _split(pieces)
    assert [d for d in deltas if "content" in d] == []
    (call,) = splitter.message()["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == PAIR_CALLS[0]["arguments"]
    assert splitter.message()["content"] is None
    assert splitter.finish_reason("length") == "length"
    assert splitter.finish_reason("stop") == "tool_calls"


def test_splitter_numbers_parallel_calls():
    pieces = ["<tool_call>", PAIR_HEAD + PAIR_CITY + PAIR_TAIL, "</tool_call>\n"]
    pieces += ["<tool_", "call>", PAIR_TIME_JSON, "</tool_c", "all>"]
    splitter, deltas = _split(pieces, tools=PAIR_TOOLS)
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in streamed] == [0, 1]
    assert streamed[0]["id"] != streamed[1]["id"]
    calls = splitter.message()["tool_calls"]
    assert [c["function"]["name"] for c in calls] == [c["name"] for c in PAIR_CALLS]
    assert all("index" not in c for c in calls)
    assert splitter.finish_reason("stop") == "tool_calls"


def test_splitter_reads_parameters_as_arguments():
    splitter, _ = _split(["<tool_call>", PARAMETERS_CALL_JSON, "</tool_call>"])
    (call,) = splitter.message()["tool_calls"]
    assert call["function"]["name"] == CALL["name"]
    assert json.loads(call["function"]["arguments"]) == CALL["arguments"]


def test_splitter_deepseek_r1_answers_start_as_reasoning():
    """deepseek_r1: reasoning from the first token until </think>, with or without a <think>
    in the answer or the prompt; qwen3 (and no parser) leaves an unopened block in content."""
    from types import SimpleNamespace

    rules = _json_rules()
    tokenizer = SimpleNamespace(
        tool_call_start=rules.tool_start,
        tool_call_end=rules.tool_end,
        tool_parser=rules.tool_parser,
        init_kwargs={"tool_parser_type": "json_tools"},
    )
    r1 = output_rules(tokenizer, "deepseek_r1")
    for tail, pieces in (
        ("", [THOUGHT, "</think>", "\n\n", "Sunny."]),
        ("", ["<think>", THOUGHT, "</think>", "\n\n", "Sunny."]),
        ("<think>\n", [THOUGHT, "</think>", "\n\n", "Sunny."]),
    ):
        splitter, _ = _split(pieces, rules=r1, prompt_tail=tail)
        assert (splitter.reasoning.strip(), splitter.content.strip()) == (THOUGHT, "Sunny.")
    for parser in ("qwen3", None):
        splitter, _ = _split([THOUGHT, "</think>", "Sunny."], output_rules(tokenizer, parser))
        assert (splitter.reasoning, splitter.content) == ("", f"{THOUGHT}</think>Sunny.")
    splitter, _ = _split(["<tool_call>", CALL_JSON, "</tool_call>"], rules=r1)
    assert splitter.reasoning == "" and len(splitter.tool_calls) == 1
