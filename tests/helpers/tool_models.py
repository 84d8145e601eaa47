"""Demo models made to call a tool: their weights force one answer, token by token.

A demo model's attention and MLP outputs are zeroed, so the residual stream is the token's
own embedding and the next token depends on the last one only; its lm_head is then set so
each token of ``chain`` is followed by the next, ending on the end-of-turn token. The
answer's pieces (think text, markers, the call's JSON) are added tokens, one each, so no
token repeats in the chain. Templates are written as the real families write theirs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_JSON = json.dumps(CALL)
THOUGHT = "A city is named, so look it up."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# Qwen3's template, abridged: tools in the system turn, calls as <tool_call> JSON, tool
# results as user turns in <tool_response>, think blocks of the last turn kept.
QWEN3 = (
    r"{%- if tools %}{{- '<|im_start|>system\n' }}"
    r"{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    r"{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    r"<tools>' }}{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    r"{{- '\n</tools>\n\nFor each function call, return a json object within "
    r"<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    r"\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    r"{%- elif messages[0].role == 'system' %}"
    r"{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}"
    r"{%- for message in messages %}"
    r"{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    r"{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    r"{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\n' + message.content }}"
    r"{%- for tool_call in message.tool_calls or [] %}"
    r"{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    r"{{- '\n<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    r"{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    r"{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\n</tool_call>' }}"
    r"{%- endfor %}{{- '<|im_end|>\n' }}"
    r"{%- elif message.role == 'tool' %}"
    r"{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    r"{{- '<|im_start|>user' }}{%- endif %}"
    r"{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    r"{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    r"{{- '<|im_end|>\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Llama-3's headers and <|eot_id|>, tools in the system turn and results in an ipython turn
# as Llama-3.1 writes them; calls in <tool_call> tags as Hermes-style Llama-3 fine-tunes make
# them (mlx-lm has no parser for Llama-3.1's bare JSON calls).
LLAMA3 = (
    r"{{- bos_token }}{%- set system = messages[0].content if messages[0].role == 'system' "
    r"else '' %}"
    r"{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system }}"
    r"{%- if tools %}{{- '\n\nYou may call these functions, each call in <tool_call> tags as "
    r"{\"name\": tool_call.name, \"arguments\": {...}}:\n' }}"
    r"{%- for tool in tools %}{{- tool | tojson + '\n' }}{%- endfor %}{%- endif %}"
    r"{{- '<|eot_id|>' }}"
    r"{%- for message in messages %}{%- if message.role == 'system' %}"
    r"{%- elif message.role == 'assistant' and message.tool_calls %}"
    r"{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    r"{%- for tool_call in message.tool_calls %}{%- set f = tool_call.function %}"
    r"{{- '<tool_call>' + {'name': f.name, 'arguments': f.arguments} | tojson + "
    r"'</tool_call>' }}{%- endfor %}{{- '<|eot_id|>' }}"
    r"{%- elif message.role == 'tool' %}"
    r"{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}"
    r"{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + "
    r"message.content | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    r"{%- if add_generation_prompt %}"
    r"{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ToolModel:
    arch: str
    template: str
    # the answer, after the generation prompt's last token; the last is the end of turn
    chain: tuple[str, ...]
    added: tuple[str, ...]


# Qwen3-style: the markers are single tokens, as Qwen3's vocabulary has them.
QWEN3_MODEL = ToolModel(
    "dense",
    QWEN3,
    ("<think>", THOUGHT, "</think>", "<tool_call>", CALL_JSON, "</tool_call>", "<|im_end|>"),
    ("<tool_call>", "</tool_call>", THOUGHT, CALL_JSON),
)
# Llama-3-style: each marker spans two tokens, so the parser must hold back a partial one.
LLAMA3_MODEL = ToolModel(
    "llama",
    LLAMA3,
    ("<tool_", "call>", CALL_JSON, "</tool_c", "all>", "<|eot_id|>"),
    ("<tool_", "call>", "</tool_c", "all>", CALL_JSON),
)

# Two calls in one answer, as Qwen3 writes parallel calls: the first written in pieces (so
# max_tokens can cut it inside its JSON or right after it), the second with two-token markers
# (the chain cannot repeat a token). The Lisbon weather call, then the time there.
PAIR_HEAD = '{"name": "get_weather", "arguments": {"city": "'
PAIR_CITY = "Lisbon"
PAIR_TAIL = '"}}'
PAIR_CALLS = (
    {"name": "get_weather", "arguments": {"city": "Lisbon"}},
    {"name": "get_time", "arguments": {"city": "Lisbon"}},
)
PAIR_TIME_JSON = json.dumps(PAIR_CALLS[1])
PAIR_TOOLS = TOOLS + [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "the local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
PAIR_MODEL = ToolModel(
    "dense",
    QWEN3,
    (
        "<tool_call>",
        PAIR_HEAD,
        PAIR_CITY,
        PAIR_TAIL,
        "</tool_call>",
        "<tool_",
        "call>",
        PAIR_TIME_JSON,
        "</tool_c",
        "all>",
        "<|im_end|>",
    ),
    (
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "call>",
        "</tool_c",
        "all>",
        PAIR_HEAD,
        PAIR_CITY,
        PAIR_TAIL,
        PAIR_TIME_JSON,
    ),
)
# DeepSeek-R1-style on a Llama-3 template: the answer reasons from its first token (no
# <think>) until </think>, then calls with "parameters", as Llama-3.1 writes its calls.
PARAMETERS_CALL_JSON = json.dumps({"name": CALL["name"], "parameters": CALL["arguments"]})
R1_MODEL = ToolModel(
    "llama",
    LLAMA3,
    (
        THOUGHT,
        "</think>",
        "<tool_",
        "call>",
        PARAMETERS_CALL_JSON,
        "</tool_c",
        "all>",
        "<|eot_id|>",
    ),
    (THOUGHT, "</think>", "<tool_", "call>", "</tool_c", "all>", PARAMETERS_CALL_JSON),
)


def make_tool_model(root: Path, name: str, spec: ToolModel) -> Path:
    """The demo model of ``spec.arch`` rewritten to answer ``spec.chain`` (made once)."""
    out = root / name
    if (out / "config.json").exists():
        return out
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    base = make_demo_model(root / f"{name}-base", DemoSpec(arch=spec.arch, text_outputs=True))
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    vocab = _add_tokens(tmp, spec)
    _force_chain(tmp, spec, vocab)
    tmp.rename(out)
    return out


def _add_tokens(folder: Path, spec: ToolModel) -> int:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False) for t in spec.added])
    tok.save(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = spec.template
    config_path.write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def _chain_ids(folder: Path, spec: ToolModel) -> list[int]:
    """The generation prompt's last token, then the chain's ids (one token each)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    ids = [tok.encode(prompt, add_special_tokens=False)[-1]]
    for piece in spec.chain:
        (one,) = tok.encode(piece, add_special_tokens=False)
        ids.append(one)
    assert len(set(ids)) == len(ids), "a chain token repeats"
    return ids


def _force_chain(folder: Path, spec: ToolModel, vocab: int) -> None:
    import mlx.core as mx

    config = json.loads((folder / "config.json").read_text())
    weights = mx.load(str(folder / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    extra = vocab - embed.shape[0]
    if extra > 0:
        rows = mx.random.normal((extra, embed.shape[1]), key=mx.random.key(7))
        embed = mx.concatenate([embed, rows.astype(embed.dtype)])
    weights["model.embed_tokens.weight"] = embed
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    norm = weights["model.norm.weight"]
    eps = config.get("rms_norm_eps", 1e-6)
    head = mx.zeros((vocab, embed.shape[1]), dtype=embed.dtype)
    ids = _chain_ids(folder, spec)
    for src, dst in zip(ids, ids[1:]):
        e = embed[src]
        h = e * mx.rsqrt(mx.mean(e * e) + eps) * norm
        head[dst] = 20.0 * h / mx.linalg.norm(h)
    weights["lm_head.weight"] = head
    config["vocab_size"] = vocab
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
