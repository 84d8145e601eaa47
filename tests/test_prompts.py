"""Warm-prompt files, the message normaliser and the token-level strict prefix."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap.chat import encode_prompt, normalize_messages, render_messages, request_tokens
from kvsnap.errors import MessageError, WarmPromptError
from kvsnap.prompts import load_warm_prompts, parse_entry, parse_warm_prompts, warm_prefix

SYSTEM = "You are a careful code reviewer. Check the tests first, then explain each fix briefly."

# --- file format and validation ---------------------------------------------------


def test_both_entry_shapes_parse():
    result = parse_warm_prompts(
        [
            [{"role": "system", "content": SYSTEM}],
            {
                "name": "planner",
                "messages": [{"role": "developer", "content": "Plan."}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "chat_template_kwargs": {"enable_thinking": False},
            },
        ]
    )
    assert not result.problems
    a, b = result.entries
    assert a.name == "agent-0" and a.messages[0]["role"] == "system"
    assert b.name == "planner" and b.messages[0]["role"] == "system"  # developer -> system
    assert b.tools[0]["function"]["name"] == "f" and b.chat_template_kwargs == {
        "enable_thinking": False
    }


def test_entry_ending_with_user_is_rejected_with_an_explanation():
    with pytest.raises(MessageError) as err:
        parse_entry([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}], 3)
    msg = str(err.value)
    assert "entries[3][1].role" in msg and "assistant turn the server does not know" in msg


def test_entry_may_end_with_assistant():
    e = parse_entry(
        [
            {"role": "system", "content": "x"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello."},
        ],
        0,
    )
    assert e.messages[-1]["role"] == "assistant"


@pytest.mark.parametrize(
    "raw,where,needle",
    [
        ("just text", "entries[0]", "list of messages or an object"),
        ([], "entries[0]", "empty"),
        ([{"role": "wizard", "content": "x"}], "entries[0][0].role", "unknown role 'wizard'"),
        ([{"role": "system"}], "entries[0][0].content", "missing"),
        ([{"role": "system", "content": 5}], "entries[0][0].content", "int"),
        (
            [{"role": "system", "content": [{"type": "image_url"}]}],
            "entries[0][0].content[0].type",
            "image_url",
        ),
        ({"messages": [{"role": "system", "content": "x"}], "tool": []}, "entries[0]", "'tool'"),
        (
            {"name": "", "messages": [{"role": "system", "content": "x"}]},
            "entries[0].name",
            "non-empty",
        ),
        ({"name": "a"}, "entries[0].messages", "missing"),
        (
            {"messages": [{"role": "system", "content": "x"}], "tools": {"a": 1}},
            "entries[0].tools",
            "list of tool objects",
        ),
        (
            {"messages": [{"role": "system", "content": "x"}], "chat_template_kwargs": [1]},
            "entries[0].chat_template_kwargs",
            "object",
        ),
    ],
)
def test_every_invalid_entry_names_index_field_and_expectation(raw, where, needle):
    result = parse_warm_prompts([raw, [{"role": "system", "content": "fine"}]])
    assert len(result.entries) == 1 and result.entries[0].index == 1  # the valid one survives
    (problem,) = result.problems
    assert problem.index == 0
    assert where in problem.message and needle in problem.message


def test_duplicate_names_are_reported():
    result = parse_warm_prompts(
        [
            {"name": "a", "messages": [{"role": "system", "content": "x"}]},
            {"name": "a", "messages": [{"role": "system", "content": "y"}]},
        ]
    )
    assert len(result.entries) == 1 and "already used by entry 0" in result.problems[0].message


def test_content_parts_become_text():
    (m,) = normalize_messages(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    )
    assert m == {"role": "user", "content": "ab"}


def test_file_errors_are_clear(tmp_path):
    with pytest.raises(WarmPromptError, match="no such warm-prompt file"):
        load_warm_prompts(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(WarmPromptError, match="not valid JSON at line 1"):
        load_warm_prompts(bad)
    bad.write_text('{"a": 1}')
    with pytest.raises(WarmPromptError, match="top level must be a JSON list"):
        load_warm_prompts(bad)
    bad.write_text(json.dumps([[{"role": "user", "content": "x"}]]))
    with pytest.raises(WarmPromptError, match="no valid warm-prompt entry"):
        load_warm_prompts(bad)


# --- strict prefix at the token level ------------------------------------------------

user_text = st.text(
    alphabet=st.sampled_from(list("abcXYZ 019\n\t\r.,!?'\"<>/-_中文你好 é"))
    | st.characters(codec="utf-8", exclude_categories=("Cs",)),
    min_size=1,
    max_size=40,
)

ENTRIES = {
    "system": [{"role": "system", "content": SYSTEM}],
    "history": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello, what shall I review?"},
    ],
    "no-system": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}],
}


@pytest.mark.parametrize("model", ["dense", "mistral", "default-system"])
@pytest.mark.parametrize("entry_name", list(ENTRIES))
def test_warm_tokens_are_a_strict_prefix_of_every_request(demo_models, model, entry_name):
    tok = demo_models.load(model).tokenizer
    entry = parse_entry(ENTRIES[entry_name], 0)
    warm = warm_prefix(tok, entry).tokens
    assert len(warm) > 0

    @settings(
        max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(user=user_text)
    def check(user):
        full = request_tokens(tok, list(entry.messages) + [{"role": "user", "content": user}])
        assert len(full) > len(warm) and tuple(full[: len(warm)]) == warm

    check()


def string_cut_tokens(tokenizer, prompt) -> list[int]:
    """The naive warm-up kvsnap does not do: cut the rendered string where a probe starts, then
    tokenize."""
    text = render_messages(
        tokenizer,
        list(prompt.messages) + [{"role": "user", "content": "__PROBE_A__"}],
        prompt.tools,
        prompt.chat_template_kwargs,
    )
    return encode_prompt(tokenizer, text[: text.index("__PROBE_A__")])


def test_string_cut_is_not_a_token_prefix_on_the_mistral_template(demo_models):
    """Why kvsnap cuts on tokens: the rendered string ends in a space the user's word absorbs."""
    tok = demo_models.load("mistral").tokenizer
    entry = parse_entry(ENTRIES["system"], 0)
    naive = string_cut_tokens(tok, entry)
    full = request_tokens(tok, list(entry.messages) + [{"role": "user", "content": "hello there"}])
    assert full[: len(naive)] != naive
    warm = warm_prefix(tok, entry).tokens
    assert tuple(full[: len(warm)]) == warm


def test_warm_prefix_covers_a_system_prompt(demo_models):
    tok = demo_models.load("dense").tokenizer
    prefix = warm_prefix(tok, parse_entry(ENTRIES["system"], 0))
    assert prefix.coverage >= 0.9 and not prefix.warnings


class _LastTurnTemplate:
    """A tokenizer whose template moves the system prompt into the last user turn."""

    def __init__(self, inner):
        self.inner = inner

    def apply_chat_template(self, messages, **kw):
        system = " ".join(m["content"] for m in messages if m["role"] == "system")
        rest = [dict(m) for m in messages if m["role"] != "system"]
        users = [m for m in rest if m["role"] == "user"]
        if users:
            users[-1]["content"] = users[-1]["content"] + "\n\n" + system
        return self.inner.apply_chat_template(rest or [{"role": "user", "content": system}], **kw)

    def encode(self, text, **kw):
        return self.inner.encode(text, **kw)


def test_low_coverage_is_warned(demo_models):
    tok = _LastTurnTemplate(demo_models.load("dense").tokenizer)
    prefix = warm_prefix(tok, parse_entry(ENTRIES["system"], 0))
    assert prefix.coverage < 0.9
    assert any("covers only" in w for w in prefix.warnings)


def test_a_template_that_stamps_today_is_warned(demo_models):
    import datetime

    inner = demo_models.load("dense").tokenizer

    class Dated(_LastTurnTemplate):
        def apply_chat_template(self, messages, **kw):
            return f"Today: {datetime.date.today().isoformat()}\n" + self.inner.apply_chat_template(
                messages, **kw
            )

    prefix = warm_prefix(Dated(inner), parse_entry(ENTRIES["system"], 0))
    assert any("stamps today's date" in w for w in prefix.warnings)


def test_coverage_counts_a_system_prompt_the_template_moves_to_the_last_user_turn(demo_models):
    """Regression: measuring the entry by its own render (just BOS) hid a 4-token warm prefix."""
    inner = demo_models.load("mistral").tokenizer

    class LastTurnMistral(_LastTurnTemplate):
        pass

    prefix = warm_prefix(LastTurnMistral(inner), parse_entry(ENTRIES["system"], 0))
    assert prefix.entry_tokens >= len(inner.encode(SYSTEM, add_special_tokens=False))
    assert prefix.coverage < 0.5 and any("covers only" in w for w in prefix.warnings)


# --- warm key: the one composition build and every warm-up share -----------------------


def test_warm_key_keys_another_servers_tokenization_apart_from_kvsnaps(demo_models):
    """Same tokens under another server's name: another prompt digest and key, so a server never
    pins a snapshot built for a request path it does not have; kvsnap's own keeps the digest
    keys had before profiles existed."""
    from kvsnap.chat import KVSNAP_TOKENIZATION, Tokenization, resolve_chat_template
    from kvsnap.key import prompt_identity, snapshot_key
    from kvsnap.warm_key import warm_key

    lm = demo_models.load("dense")
    identity = lm.identity()
    entry = parse_entry([{"role": "system", "content": SYSTEM}], 0)
    own = warm_key(lm.tokenizer, identity, entry)
    other = warm_key(lm.tokenizer, identity, entry, Tokenization(server="mlx-lm"))
    assert own.tokens == other.tokens == warm_prefix(lm.tokenizer, entry).tokens
    assert own.prompt_digest == prompt_identity(resolve_chat_template(lm.tokenizer), None, None)
    assert own.key == snapshot_key(identity, own.prompt_digest, own.tokens)
    assert warm_key(lm.tokenizer, identity, entry, KVSNAP_TOKENIZATION) == own
    assert other.prompt_digest != own.prompt_digest and other.key != own.key
    assert not own.recipe_reused and own.prefix.tokens == own.tokens
