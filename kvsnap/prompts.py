"""Warm prompts: the files (each entry the leading messages of future requests, checked) and
the token-level strict prefix every request starting with an entry begins with.

Messages are normalised, rendered and encoded by ``chat.py``. No mlx here.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvsnap.agent_requests import anthropic_prefix, responses_prefix
from kvsnap.chat import (
    KVSNAP_TOKENIZATION,
    ChatTokenizer,
    Tokenization,
    encode_prompt,
    normalize_messages,
)
from kvsnap.errors import MessageError, TemplateError, WarmPromptError

ENTRY_KEYS = ("name", "messages", "tools", "chat_template_kwargs")
# An agent's request body as its client sends it: the prefix every request shares is warmed
AGENT_ENTRY_KEYS = ("anthropic", "responses")

# Probe user turns whose first characters differ in every way a BPE merge can
# care about: letter, space, newlines, tab, digit, CJK, punctuation, markup.
PROBE_CONTENTS = (
    "Hello there",
    " leading space",
    "\nnewline first",
    "\r\ncarriage return",
    "\ttab first",
    "42 is a number",
    "中文内容",
    "!? punctuation",
    "<b>markup</b>",
    "'quoted'",
)
COVERAGE_WARN_BELOW = 0.90


@dataclass(frozen=True)
class WarmPrompt:
    """One entry of a warm-prompt file: the leading messages of future requests."""

    index: int
    name: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    chat_template_kwargs: dict | None = None
    # for an agent body: which API and where its shared prefix was cut
    cut: str | None = None
    # for an agent body: its API ("anthropic" | "responses") and the body as given, for a
    # server that converts such bodies itself (vllm-mlx's /v1/messages, /v1/responses)
    api: str | None = None
    body: dict | None = field(default=None, compare=False, repr=False)

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "messages": list(self.messages),
            "tools": list(self.tools) if self.tools is not None else None,
            "chat_template_kwargs": self.chat_template_kwargs,
        }


@dataclass(frozen=True)
class EntryProblem:
    index: int
    message: str

    def __str__(self) -> str:
        return f"entry {self.index}: {self.message}"


@dataclass
class WarmPromptSet:
    source: str
    entries: list[WarmPrompt] = field(default_factory=list)
    problems: list[EntryProblem] = field(default_factory=list)


@dataclass(frozen=True)
class WarmPrefix:
    """The tokens every real request that starts with ``prompt.messages`` begins with."""

    prompt: WarmPrompt
    tokens: tuple[int, ...]
    entry_tokens: int
    warnings: tuple[str, ...] = ()

    @property
    def coverage(self) -> float:
        if self.entry_tokens <= 0:
            return 1.0
        return min(1.0, len(self.tokens) / self.entry_tokens)


# --- warm-prompt files ----------------------------------------------------------


def _check_tools(tools: Any, where: str) -> tuple[dict, ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise MessageError(
            where,
            f"expected a list of tool objects, got {json.dumps(tools)[:60]}",
            "use OpenAI's tools shape",
        )
    return tuple(tools)


def _check_kwargs(kwargs: Any, where: str) -> dict | None:
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise MessageError(
            where,
            f"expected an object, got {type(kwargs).__name__}",
            'e.g. {"enable_thinking": false}',
        )
    return dict(kwargs)


def _entry_name(raw: dict, where: str, default: str) -> str:
    if "name" not in raw:
        return default
    if not isinstance(raw["name"], str) or not raw["name"].strip():
        raise MessageError(
            where + ".name",
            f"expected a non-empty string, got {raw['name']!r}",
            'name the agent, e.g. "reviewer"',
        )
    return raw["name"].strip()


def _agent_entry(raw: dict, index: int, where: str) -> WarmPrompt:
    """``{"name": ..., "anthropic": BODY}`` or ``{"name": ..., "responses": BODY}``: the
    prefix every request of that agent shares, cut by ``agent_requests``."""
    apis = [k for k in AGENT_ENTRY_KEYS if k in raw]
    unknown = sorted(set(raw) - {"name", *AGENT_ENTRY_KEYS})
    if len(apis) > 1 or unknown:
        raise MessageError(
            where,
            f"unknown or extra field(s) {', '.join(map(repr, unknown + apis[1:]))}",
            f"an agent entry has name and one of {', '.join(AGENT_ENTRY_KEYS)}",
        )
    api = apis[0]
    cut_prefix = anthropic_prefix if api == "anthropic" else responses_prefix
    chat, cut = cut_prefix(raw[api], f"{where}.{api}")
    return WarmPrompt(
        index=index,
        name=_entry_name(raw, where, f"{api}-{index}"),
        messages=chat.messages,
        tools=chat.tools,
        chat_template_kwargs=chat.template_kwargs or None,
        cut=cut,
        api=api,
        body=raw[api],
    )


def parse_entry(raw: Any, index: int) -> WarmPrompt:
    where = f"entries[{index}]"
    name = f"agent-{index}"
    tools = kwargs = None
    if isinstance(raw, dict) and any(k in raw for k in AGENT_ENTRY_KEYS):
        return _agent_entry(raw, index, where)
    if isinstance(raw, dict):
        unknown = sorted(set(raw) - set(ENTRY_KEYS))
        if unknown:
            raise MessageError(
                where,
                f"unknown field(s) {', '.join(map(repr, unknown))}",
                f"an entry object may only have {', '.join(ENTRY_KEYS)} (or name and one of "
                f"{', '.join(AGENT_ENTRY_KEYS)})",
            )
        name = _entry_name(raw, where, name)
        if "messages" not in raw:
            raise MessageError(
                where + ".messages",
                "missing",
                "give the leading chat messages of this agent's requests",
            )
        messages = normalize_messages(raw["messages"], where + ".messages")
        tools = _check_tools(raw.get("tools"), where + ".tools")
        kwargs = _check_kwargs(raw.get("chat_template_kwargs"), where + ".chat_template_kwargs")
        where_last = f"{where}.messages[{len(messages) - 1}].role"
    elif isinstance(raw, list):
        messages = normalize_messages(raw, where)
        where_last = f"{where}[{len(messages) - 1}].role"
    else:
        raise MessageError(
            where,
            f"an entry must be a list of messages or an object, got {type(raw).__name__}",
            'write [{"role": "system", "content": "..."}]',
        )
    last = messages[-1]["role"]
    if last in ("user", "tool"):
        raise MessageError(
            where_last,
            f"the entry ends with a {last!r} message, so the next message of a real request would "
            f"be an assistant turn the server does not know",
            "end the entry with its system prompt or with an assistant turn (drop the trailing "
            "user message)",
        )
    return WarmPrompt(
        index=index, name=name, messages=tuple(messages), tools=tools, chat_template_kwargs=kwargs
    )


def parse_warm_prompts(data: Any, source: str = "<warm prompts>") -> WarmPromptSet:
    """Parse the decoded JSON of a warm-prompt file. Invalid entries are reported, the rest kept."""
    if not isinstance(data, list):
        raise WarmPromptError(
            f"{source}: the top level must be a JSON list of entries, got {type(data).__name__}; "
            f"wrap the entries in [ ... ]"
        )
    result = WarmPromptSet(source=source)
    seen: dict[str, int] = {}
    for index, raw in enumerate(data):
        try:
            entry = parse_entry(raw, index)
        except MessageError as exc:
            result.problems.append(EntryProblem(index, str(exc)))
            continue
        if entry.name in seen:
            result.problems.append(
                EntryProblem(
                    index,
                    f"entries[{index}].name: {entry.name!r} is already used by entry "
                    f"{seen[entry.name]}; give every agent its own name",
                )
            )
            continue
        seen[entry.name] = index
        result.entries.append(entry)
    return result


def load_warm_prompts(path: str | Path) -> WarmPromptSet:
    """Read and parse a warm-prompt file; a file with no valid entry is an error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WarmPromptError(f"{path}: no such warm-prompt file; check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WarmPromptError(
            f"{path}: cannot be read ({exc}); give a readable UTF-8 JSON file"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WarmPromptError(
            f"{path}: not valid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); fix the "
            f"JSON"
        ) from None
    result = parse_warm_prompts(data, str(path))
    if not result.entries:
        detail = "; ".join(str(p) for p in result.problems[:3]) or "the list is empty"
        raise WarmPromptError(f"{path}: no valid warm-prompt entry ({detail})")
    return result


# --- strict prefix --------------------------------------------------------------


def common_prefix_length(sequences: Iterable[Sequence[int]]) -> int:
    """How many leading tokens every sequence shares (0 for no sequence).

    The one common-prefix function (warm prefixes, shared prefixes, the prefix trie, the block
    store's branch points).
    A binary search over slice equality: the comparisons run in C, not token by token.
    """
    seqs = [tuple(s) for s in sequences]
    if not seqs:
        return 0
    first = seqs[0]
    lo, hi = 0, min(len(s) for s in seqs)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        head = first[:mid]
        if all(s[:mid] == head for s in seqs[1:]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def probe_conversations(prompt: WarmPrompt) -> list[list[dict]]:
    """Plausible continuations of an entry: one user turn per probe, plus a longer exchange."""
    base = list(prompt.messages)
    convs = [base + [{"role": "user", "content": c}] for c in PROBE_CONTENTS]
    convs.append(
        base
        + [
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": "First answer."},
            {"role": "user", "content": "Second question"},
        ]
    )
    return convs


def _date_stamps(today: _dt.date) -> list[str]:
    return [
        today.isoformat(),
        today.strftime("%d %b %Y"),
        today.strftime("%B %d, %Y"),
        today.strftime("%d %B %Y"),
    ]


def warm_prefix(
    tokenizer: ChatTokenizer, prompt: WarmPrompt, tokenization: Tokenization | None = None
) -> WarmPrefix:
    """The longest token prefix shared by every probe continuation of ``prompt``.

    Cutting the rendered *string* is not enough: BPE can merge the text before
    the cut with the user's first characters, so the cut is made on tokens.
    ``tokenization``: the serving server's request path (default: kvsnap's own).
    """
    tok = tokenization or KVSNAP_TOKENIZATION
    renders = [
        tok.render(tokenizer, conv, prompt.tools, prompt.chat_template_kwargs)
        for conv in probe_conversations(prompt)
    ]
    token_lists = [tok.encode(tokenizer, text) for text in renders]
    n = common_prefix_length(token_lists)
    tokens = tuple(token_lists[0][:n])

    warnings = []
    # The entry's size: its own render, or its content when the template drops or moves
    # the system prompt (a system-only render can be just BOS), whichever is larger.
    content_tokens = sum(len(encode_prompt(tokenizer, m["content"])) for m in prompt.messages)
    try:
        alone = tok.render(
            tokenizer,
            prompt.messages,
            prompt.tools,
            prompt.chat_template_kwargs,
            add_generation_prompt=False,
        )
        entry_tokens = max(len(tok.encode(tokenizer, alone)), content_tokens)
    except TemplateError:
        entry_tokens = content_tokens
    coverage = 1.0 if entry_tokens <= 0 else min(1.0, n / entry_tokens)
    if coverage < COVERAGE_WARN_BELOW:
        warnings.append(
            f"{prompt.name}: the warm prefix covers only {coverage:.0%} of the entry's "
            f"{entry_tokens} tokens "
            "(the template changes the text before the next user turn, e.g. it moves the system "
            "prompt into the last user message)"
        )
    today = _dt.date.today()
    own_text = "".join(m["content"] for m in prompt.messages)
    if any(stamp in renders[0] and stamp not in own_text for stamp in _date_stamps(today)):
        warnings.append(
            f"{prompt.name}: the chat template stamps today's date into the prompt, so this "
            f"snapshot goes stale tomorrow; "
            "pass a fixed date through chat_template_kwargs (e.g. date_string) or rebuild daily"
        )
    if n == 0:
        warnings.append(
            f"{prompt.name}: no token is shared by every continuation of this entry; nothing can "
            f"be warmed"
        )
    return WarmPrefix(
        prompt=prompt, tokens=tokens, entry_tokens=entry_tokens, warnings=tuple(warnings)
    )
