"""What a kept request prefix gives the next turn of a conversation, on real chat
templates (docs/conversations.md, "What is kept"; scripts/measure_turn_reuse.py measures it
at full size).

Conversations are rendered through kvsnap.chat exactly as the server renders a chat
request. The prompt-only entry (the prompt minus its last token, what
RequestCaches.capture keeps) reuses >= 95 % of the previous turn's prompt on every
template that keeps the system prompt in place; prompt + reply is a strict prefix only
where the template re-renders the reply as generated.

Tests skip only when npm is missing or the registry cannot be reached, as
tests/test_real_templates.py does.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
from helpers.npm_tokenizers import unavailable_reason

from kvsnap.chat import normalize_messages, render_messages, request_tokens

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location(
        "measure_turn_reuse", ROOT / "scripts" / "measure_turn_reuse.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


m = _script()
VARIANTS = {v.name: v for v in m.VARIANTS}
SMALL = m.Shape(turns=4, system=300, user=(30, 80), reply=(30, 80), think=(30, 80))
CONVERSATIONS = 3
STABLE = ("chatml", "qwen3-thinking", "qwen3-no-thinking", "llama3", "mistral-v1")


def _tok(variant):
    tok = m.load(variant.spec, variant.template)
    if tok is None:
        pytest.skip(unavailable_reason(variant.spec) or "real tokenizer unavailable")
    return tok


@functools.lru_cache(maxsize=None)
def _conversations(name: str):
    variant = VARIANTS[name]
    tok = m.load(variant.spec, variant.template)
    return [m.conversation(tok, variant, SMALL, seed) for seed in range(CONVERSATIONS)]


@functools.lru_cache(maxsize=None)
def _steps(name: str):
    variant = VARIANTS[name]
    tok = m.load(variant.spec, variant.template)
    return [step for msgs in _conversations(name) for step in m.measure(tok, variant, msgs)]


@pytest.mark.parametrize("name", STABLE)
def test_prompt_only_entry_reuses_95_percent_of_the_previous_prompt(name):
    _tok(VARIANTS[name])
    steps = _steps(name)
    assert len(steps) == CONVERSATIONS * (SMALL.turns - 1)
    assert min(s.prompt_only_reuse for s in steps) >= 0.95, [
        (s.turn, s.prompt_only, s.prompt) for s in steps
    ]


@pytest.mark.parametrize("name", ["chatml", "qwen3-thinking", "llama3", "mistral-v1"])
def test_prompt_only_entry_is_a_strict_prefix_of_the_next_turn(name):
    """Every token of the entry is reused: it serves untrimmable caches too."""
    _tok(VARIANTS[name])
    assert all(s.prompt_only_strict for s in _steps(name))


def test_qwen3_without_thinking_drops_the_empty_think_block_from_history():
    """enable_thinking=false puts an empty think block after the generation prompt, which the
    next turn's rendering of that reply leaves out: the entry diverges 4 tokens before its
    end (reusable where the cache can be trimmed, not a strict prefix)."""
    variant = VARIANTS["qwen3-no-thinking"]
    tok = _tok(variant)
    for msgs in _conversations(variant.name):
        prompts = [
            request_tokens(tok, normalize_messages(msgs[: i + 1]), None, variant.kwargs)
            for i, msg in enumerate(msgs)
            if msg["role"] == "user"
        ]
        for before, after in zip(prompts, prompts[1:]):
            n = m.common_prefix(before[:-1], after)
            assert n == len(before) - 4
            assert tok.decode(before[n:]) == "<think>\n\n</think>\n\n"
            assert tok.decode(after[n : n + 1]) != "<think>"


def test_mistral_v3_moves_the_system_prompt_so_no_entry_reaches_95_percent():
    """Mistral V3-style templates put the system prompt into the last user turn: it is in a
    new place every turn, so the previous prompt is reused only up to its last user turn."""
    variant = VARIANTS["mistral-v3"]
    tok = _tok(variant)
    steps = _steps(variant.name)
    text = _conversations(variant.name)[0][0]["content"]
    system = len(tok.encode(text, add_special_tokens=False))
    assert all(s.prompt - s.prompt_only >= system for s in steps)
    assert all(s.prompt - min(s.with_reply, s.prompt) >= system for s in steps)
    assert max(s.prompt_only_reuse for s in steps) < 0.95


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral-v1"])
def test_prompt_plus_reply_is_a_strict_prefix_where_the_reply_renders_as_generated(name):
    _tok(VARIANTS[name])
    steps = _steps(name)
    assert all(s.with_reply_strict for s in steps)
    assert all(s.reply_reused == s.reply for s in steps)


def test_qwen3_thinking_prompt_plus_reply_is_never_a_prefix():
    """Qwen3's template strips the <think> block from earlier replies: a prompt + reply entry
    diverges at the reply's first token, so none of the reply is reused."""
    variant = VARIANTS["qwen3-thinking"]
    tok = _tok(variant)
    steps = _steps(variant.name)
    assert not any(s.with_reply_strict for s in steps)
    assert all(s.with_reply == s.prompt and s.reply_reused == 0 for s in steps)
    msgs = _conversations(variant.name)[0]
    assert all("<think>" in x["content"] for x in msgs if x["role"] == "assistant")
    assert "<think>" not in render_messages(tok, normalize_messages(msgs[:-1]))


def test_the_script_prints_a_row_per_template_and_entry(capsys):
    for variant in m.VARIANTS:
        _tok(variant)
    assert m.main(["--conversations", "1", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    for variant in m.VARIANTS:
        for kind in ("prompt-only", "prompt+reply"):
            assert f"| {variant.name} | {variant.label} | {kind} |" in out
    assert "unavailable" not in out
