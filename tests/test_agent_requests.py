"""Agent request bodies as kvsnap's chat (kvsnap/agent_requests.py), on the bodies Claude Code
and Codex CLI really send (tests/fixtures/agents/, recorded from the CLIs) and on hostile ones:
every block and item type they use converts, the shared prefix is cut where every request of
the agent agrees, a per-request system line never breaks it, and a bad field is refused with
its path. No model here; the renders use a real chat template through `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsnap.agent_requests import (
    anthropic_chat,
    anthropic_prefix,
    arguments_object,
    responses_chat,
    responses_prefix,
)
from kvsnap.chat import system_placements
from kvsnap.errors import MessageError
from kvsnap.prompts import parse_warm_prompts

FIXTURES = Path(__file__).parent / "fixtures" / "agents"


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_claude_code_bodies_convert_with_the_billing_line_dropped_and_the_system_message_kept():
    body = _fixture("claude_code_first")
    chat = anthropic_chat(body)
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "system"]  # the environment block stays in place
    assert "x-anthropic-billing-header" not in chat.messages[0]["content"]
    assert chat.messages[0]["content"].startswith(body["system"][1]["text"])
    assert len(chat.tools) == len(body["tools"]) == 12
    assert chat.tools[0]["function"]["parameters"] == body["tools"][0]["input_schema"]
    assert chat.template_kwargs == {"enable_thinking": True}  # thinking: adaptive


def test_a_billing_line_that_changes_per_prompt_leaves_the_prefix_unchanged():
    first = _fixture("claude_code_first")
    other = json.loads(json.dumps(first))
    other["system"][0]["text"] = (
        "x-anthropic-billing-header: cc_version=2.1.332.fff; cc_entrypoint=sdk-cli;"
    )
    assert anthropic_prefix(first, "a")[0] == anthropic_prefix(other, "a")[0]


def test_the_claude_code_tool_turn_becomes_an_assistant_call_and_a_tool_message():
    chat = anthropic_chat(_fixture("claude_code_tool_turn"))
    assistant, tool = chat.messages[-2], chat.messages[-1]
    call = assistant["tool_calls"][0]
    assert call["id"] == "toolu_rec_1" and call["function"]["name"] == "Read"
    assert isinstance(call["function"]["arguments"], dict)  # templates write it with tojson
    assert tool == {
        "role": "tool",
        "tool_call_id": "toolu_rec_1",
        "content": "1\thello from README\n2\t",
    }


def test_codex_bodies_convert_with_namespace_functions_and_the_hosted_tool_dropped():
    chat = responses_chat(_fixture("codex_tool_turn"))
    assert [m["role"] for m in chat.messages[:3]] == ["system", "system", "user"]
    names = [t["function"]["name"] for t in chat.tools]
    assert "spawn_agent" in names and "exec_command" in names
    assert chat.namespaces["spawn_agent"] == "multi_agent_v1"
    assert chat.dropped_tools == ("web_search",)
    call = chat.messages[-2]["tool_calls"][0]
    assert call["id"] == "call_rec_1" and call["function"]["arguments"] == {"cmd": "echo hi"}
    assert chat.messages[-1]["role"] == "tool" and chat.messages[-1]["tool_call_id"] == "call_rec_1"


def test_agent_entries_cut_the_prefix_every_request_shares():
    prompts = parse_warm_prompts(
        [
            {"name": "claude", "anthropic": _fixture("claude_code_first")},
            {"name": "codex", "responses": _fixture("codex_first")},
        ]
    )
    assert not prompts.problems
    claude, codex = prompts.entries
    assert [m["role"] for m in claude.messages] == ["system"] and len(claude.tools) == 12
    assert "12 tools" in claude.cut and "2 messages left out" in claude.cut
    # the two developer messages, not the <environment_context> user message
    assert [m["role"] for m in codex.messages] == ["system", "system"]
    assert "2 leading developer/system items" in codex.cut
    # every request of the agent (here in another folder) starts with the entry's messages
    request = responses_chat(_fixture("codex_other_folder"))
    assert request.messages[:2] == codex.messages and request.tools == codex.tools


def test_a_later_system_message_goes_to_the_user_turn_before_it_when_a_template_refuses_it():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "system", "content": "ENV"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "U2"},
    ]
    as_given, placed = system_placements(messages)
    assert as_given == messages
    # the first turns render the same on every later turn: ENV joins U1, not U2
    assert placed == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1\n\nENV"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "U2"},
    ]
    lead = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}]
    tries = system_placements([*lead, {"role": "user", "content": "U"}])
    assert tries[-1][0] == {"role": "system", "content": "A\n\nB"}


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"input_schema": {}}]},
            "tools[0].name",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
            "tool_choice.type",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "lots"}},
            "thinking.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}],
                    }
                ]
            },
            "messages[0].content[0].input",
        ),
    ],
)
def test_a_bad_anthropic_field_is_refused_with_its_path(body, where):
    with pytest.raises(MessageError) as info:
        anthropic_chat(body)
    assert info.value.where == where


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "teleport"}]}, "tools[0].type"),
        ({"input": "x", "instructions": 5}, "instructions"),
        ({"input": []}, "input"),
    ],
)
def test_a_bad_responses_field_is_refused_with_its_path(body, where):
    with pytest.raises(MessageError) as info:
        responses_chat(body)
    assert info.value.where == where


def test_an_agent_entry_with_nothing_shared_is_reported_not_built():
    prompts = parse_warm_prompts(
        [{"name": "x", "anthropic": {"messages": []}}, {"responses": {"input": "hi"}}]
    )
    assert not prompts.entries
    assert [p.index for p in prompts.problems] == [0, 1]
    assert "nothing to warm" in str(prompts.problems[0])
    with pytest.raises(MessageError):
        anthropic_prefix({"system": "s"}, "e") and responses_prefix([], "e")


def test_call_arguments_that_are_not_a_json_object_are_kept():
    assert arguments_object('{"a": 1}') == {"a": 1}
    assert arguments_object("not json") == {"input": "not json"}
    assert arguments_object("[1]") == {"input": [1]}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_anthropic_tool_choice_becomes_chats(choice, expected):
    body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": choice}
    assert anthropic_chat(body).tool_choice == expected


@pytest.mark.parametrize(
    ("thinking", "reasoning", "switch"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, {"effort": "high"}, True),
        ({"type": "adaptive"}, {"effort": "low"}, True),
        ({"type": "disabled"}, {"effort": "minimal"}, False),
        ({"type": "disabled"}, {"effort": "none"}, False),
        (None, {"summary": "auto"}, None),
    ],
)
def test_thinking_and_reasoning_effort_set_the_templates_switch(thinking, reasoning, switch):
    anthropic = {"messages": [{"role": "user", "content": "x"}], "thinking": thinking}
    responses = {"input": "x", "reasoning": reasoning}
    expected = {} if switch is None else {"enable_thinking": switch}
    assert anthropic_chat(anthropic).template_kwargs == expected
    assert responses_chat(responses).template_kwargs == expected


def test_anthropic_history_blocks_keep_their_meaning():
    """Thinking becomes the template's reasoning_content, redacted thinking is dropped, an
    errored tool result says so, a user turn's text after its tool results follows them."""
    chat = anthropic_chat(
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "plan", "signature": "s"},
                        {"type": "redacted_thinking", "data": "xx"},
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": "boom",
                            "is_error": True,
                        },
                        {"type": "text", "text": "and now?"},
                    ],
                },
            ]
        }
    )
    _, assistant, tool, user = chat.messages
    assert assistant["reasoning_content"] == "plan" and assistant["content"] == "calling"
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"}
    assert user == {"role": "user", "content": "and now?"}


def test_responses_history_items_keep_their_meaning():
    chat = responses_chat(
        {
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": "go"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "two"}],
                },
            ],
        }
    )
    system, user, assistant, first, second = chat.messages
    assert system == {"role": "system", "content": "be brief"}
    assert assistant["reasoning_content"] == "plan"
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]  # one turn, two calls
    assert (first["content"], second["content"]) == ("one", "two")
