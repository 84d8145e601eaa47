"""A chat answer split as an agent client expects it: tool calls into OpenAI's ``tool_calls``,
reasoning into ``reasoning_content``, the rest as ``content``, whole or as stream deltas.

The markers and the call parser are mlx-lm's, read from its ``TokenizerWrapper``
(``tool_call_start``/``tool_call_end``/``tool_parser``, inferred from the chat template or set
by ``tool_parser_type`` in tokenizer_config.json; ``think_start``/``think_end`` from the
vocabulary), and the text is cut by mlx-lm's own ``TextStateMachine``, as mlx_lm.server does:
marker text is never sent, and a partial marker is held back until it is known.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvsnap.http.limits import RequestRejected

# serve --reasoning-parser: vllm-mlx's flag; "auto" takes the tokenizer's think markers
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1")
THINK_MARKERS = ("<think>", "</think>")
# how far back in the prompt to look for an opened think block (a template's generation prompt)
PROMPT_TAIL_TOKENS = 32
# what a tool parser raises on text it cannot read (json, ast, regex, missing keys)
PARSE_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, SyntaxError)

log = logging.getLogger("kvsnap.http.server")


@dataclass(frozen=True)
class OutputRules:
    """One server's markers: where tool calls and reasoning start and end in an answer."""

    tool_start: Optional[str] = None
    tool_end: Optional[str] = None
    tool_parser: Optional[Callable[..., Any]] = None
    parser_name: Optional[str] = None
    think_start: Optional[str] = None
    think_end: Optional[str] = None
    # deepseek_r1: an answer is reasoning from its first token until the end marker
    reasoning_first: bool = False

    @property
    def parses_tools(self) -> bool:
        return self.tool_parser is not None and bool(self.tool_start)

    @property
    def splits_reasoning(self) -> bool:
        return bool(self.think_start and self.think_end)


def output_rules(tokenizer: Any, reasoning_parser: Optional[str]) -> OutputRules:
    """The rules for a loaded tokenizer (mlx-lm's wrapper) and serve's --reasoning-parser."""
    think: tuple[Optional[str], Optional[str]] = (None, None)
    if reasoning_parser == "auto":
        think = (getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None))
        if not think[0]:
            log.warning(
                "[kvsnap] --reasoning-parser auto: the tokenizer has no think markers; "
                "reasoning stays in content"
            )
    elif reasoning_parser in ("qwen3", "deepseek_r1"):
        think = THINK_MARKERS
    init = getattr(tokenizer, "init_kwargs", None)
    return OutputRules(
        tool_start=getattr(tokenizer, "tool_call_start", None),
        tool_end=getattr(tokenizer, "tool_call_end", None),
        tool_parser=getattr(tokenizer, "tool_parser", None),
        parser_name=init.get("tool_parser_type") if isinstance(init, dict) else None,
        think_start=think[0],
        think_end=think[1],
        reasoning_first=reasoning_parser == "deepseek_r1",
    )


def check_tool_choice(tool_choice: Any, tools: Optional[list]) -> None:
    """OpenAI's shapes: "none", "auto", "required", or one named function among ``tools``."""
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestRejected(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    names = {
        t.get("function", {}).get("name")
        for t in tools or []
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    }
    if name not in names:
        raise RequestRejected(
            f"tool_choice names {name!r}, which tools does not hold", "tool_choice"
        )


def prompt_opens_reasoning(rules: OutputRules, prompt_tail: str) -> bool:
    """Whether generation starts inside a think block: the prompt's last marker opens one
    (a template that writes ``<think>`` into the generation prompt), or, for deepseek_r1,
    the prompt's tail has not closed one."""
    if not rules.splits_reasoning:
        return False
    assert rules.think_start and rules.think_end
    opened = prompt_tail.rfind(rules.think_start)
    closed = prompt_tail.rfind(rules.think_end)
    if rules.reasoning_first:
        return closed < 0 or opened > closed
    return opened > closed


class AnswerSplitter:
    """One answer's text, fed as it is generated, out as OpenAI delta fields: ``content``,
    ``reasoning_content`` and ``tool_calls`` (each call whole, once its end marker is read)."""

    def __init__(
        self,
        rules: OutputRules,
        tools: Optional[list] = None,
        tool_choice: Any = None,
        prompt_tail: str = "",
    ):
        from mlx_lm.generate import TextStateMachine

        self.rules = rules
        self.tools = tools
        self.parse_tools = bool(tools) and tool_choice != "none" and rules.parses_tools
        transitions: dict[str, list[tuple[str, str]]] = {}
        if rules.splits_reasoning:
            assert rules.think_start and rules.think_end
            transitions["normal"] = [(rules.think_start, "reasoning")]
            # an answer that opens the block its prompt (or deepseek_r1) already opened: the
            # marker is dropped, as vLLM's deepseek_r1 parser drops it
            transitions["reasoning"] = [
                (rules.think_end, "normal"),
                (rules.think_start, "reasoning"),
            ]
        if self.parse_tools:
            assert rules.tool_start
            transitions.setdefault("normal", []).append((rules.tool_start, "tool"))
            if rules.splits_reasoning:
                transitions["reasoning"].append((rules.tool_start, "tool"))
            transitions["tool"] = [(rules.tool_end, "normal")] if rules.tool_end else []
        self._machine = TextStateMachine
        initial = "reasoning" if prompt_opens_reasoning(rules, prompt_tail) else "normal"
        self._state = TextStateMachine(transitions or None).make_state(initial)
        self._prev = initial
        self._tool_text = ""
        self._pending_space = ""
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[dict] = []

    @property
    def active(self) -> bool:
        """Whether this answer is split at all (else its text goes out as content, as is)."""
        return self.parse_tools or self.rules.splits_reasoning

    def feed(self, text: str) -> list[dict]:
        """The delta fields ``text`` completes, in order (text that may start a marker waits)."""
        self._state, segments = self._machine.split(self._state, text)
        return self._collect(segments)

    def finish(self) -> list[dict]:
        """The rest at the end of the answer: held text, and a call cut before its end marker
        (``max_tokens``): a call when what was written parses, else content as written, the
        end marker never made up."""
        self._state, held, current = self._machine.flush(self._state)
        deltas = self._collect([(current, held)])
        if self._prev == "tool":
            deltas += self._end_call(closed=False)
        if self._pending_space and not self.tool_calls:
            deltas.append(self._content(self._pending_space))
        self._pending_space = ""
        return [d for d in deltas if d]

    def finish_reason(self, engine_reason: Optional[str]) -> str:
        """OpenAI's: "tool_calls" when the answer ended by itself after a call."""
        reason = "length" if engine_reason == "length" else "stop"
        return "tool_calls" if reason == "stop" and self.tool_calls else reason

    def message(self) -> dict:
        """The non-streamed ``message`` fields beyond the role (after ``finish``)."""
        out: dict = {"content": self.content}
        if self.tool_calls:
            out["content"] = self.content.strip() or None
            out["tool_calls"] = [
                {k: v for k, v in call.items() if k != "index"} for call in self.tool_calls
            ]
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        return out

    def _collect(self, segments: list[tuple[Optional[str], str]]) -> list[dict]:
        deltas: list[dict] = []
        for state, text in segments:
            if self._prev == "tool" and state != "tool":
                deltas += self._end_call()
            self._prev = state or "normal"
            if not text:
                continue
            if state == "tool":
                self._tool_text += text
            elif state == "reasoning":
                self.reasoning += text
                deltas.append({"reasoning_content": text})
            else:
                deltas.append(self._content(text))
        return [d for d in deltas if d]

    def _content(self, text: str) -> dict:
        """Content; with tools on, white space waits for what follows (dropped before a call)."""
        if self.parse_tools and not (self._pending_space + text).strip():
            self._pending_space += text
            return {}
        text, self._pending_space = self._pending_space + text, ""
        self.content += text
        return {"content": text}

    def _end_call(self, closed: bool = True) -> list[dict]:
        """The call just read: ``closed`` when its end marker was, else cut at the answer's
        end (its text may then end in part of the end marker, held back until the end)."""
        text, self._tool_text = self._tool_text, ""
        calls, error = self._parse(text)
        if calls is None and not closed:
            cut = self._without_partial_end(text)
            if cut != text:
                calls, _ = self._parse(cut)
        if calls is None:
            log.warning(
                "[kvsnap] a tool call the %s parser cannot read%s is sent as content (%s)",
                self.rules.parser_name or "tool",
                "" if closed else ", cut before its end marker,",
                error,
            )
            # the client sees the text as it was written, markers and all: a cut call has
            # no end marker
            end = (self.rules.tool_end or "") if closed else ""
            return [self._content(f"{self.rules.tool_start}{text}{end}")]
        self._pending_space = ""
        for call in calls:
            call["index"] = len(self.tool_calls)
            self.tool_calls.append(call)
        return [{"tool_calls": calls}] if calls else []

    def _without_partial_end(self, text: str) -> str:
        """``text`` less a tail that begins the end marker (a call cut inside its marker)."""
        end = self.rules.tool_end or ""
        for n in range(len(end) - 1, 0, -1):
            if text.endswith(end[:n]):
                return text[:-n]
        return text

    def _parse(self, text: str) -> tuple[Optional[list[dict]], str]:
        """The calls mlx-lm's parser reads in ``text``, or None and why not."""
        assert self.rules.tool_parser is not None
        try:
            parsed = self.rules.tool_parser(text, self.tools)
            found = parsed if isinstance(parsed, list) else [parsed]
            return [_openai_call(item) for item in found], ""
        except PARSE_ERRORS as exc:
            return None, f"{type(exc).__name__}: {exc}"


def _openai_call(parsed: Any) -> dict:
    """One parsed call ({"name", "arguments"}) in OpenAI's shape, arguments as a JSON string."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ValueError("a tool call needs a name")
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": str(parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
        "type": "function",
        "function": {"name": parsed["name"], "arguments": arguments},
    }
