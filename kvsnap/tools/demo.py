"""Demo models: deterministic random weights, a small trained BPE tokenizer and a chat template.

Tests, the quickstart and the benchmarks all make their models with ``make_demo_model``;
nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvsnap.tools.demo_templates import TEMPLATES
from kvsnap.errors import UsageError

# dense = qwen3, hybrid = qwen3_next (SSM + attention, dense MLPs), sliding = gemma3_text,
# llama = llama with a Llama-3-style tokenizer, moe = qwen3_5_moe (Qwen3.5/3.6 MoE hybrid).
ARCHES = ("dense", "hybrid", "sliding", "llama", "moe")
# tiny: tests; small: the 2-core benchmark table (scripts/bench_table.py); qwen3-0.6b: Qwen3-0.6B's shape.
SIZES = ("tiny", "small", "qwen3-0.6b")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]", "<think>", "</think>"]
LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Meta's Llama-3 pre-tokenizer split (digits in threes, newlines kept apart from words).
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
DEMO_VOCAB = 2048
QWEN3_06B_VOCAB = 151936
CONTEXT = 32768

# The benchmark table's shapes: sized so quantized matmul on 2 CPU cores (~1.6 GFLOPS at 4
# and 8 bits) prefills ~4,200 prompt tokens in seconds; why each is what it is: docs/benchmarks.md.
_SMALL_SHAPES = {
    ("dense", "small"): dict(hidden_size=128, num_hidden_layers=4, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    ("llama", "small"): dict(hidden_size=128, num_hidden_layers=4, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    ("moe", "small"): dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128),
}

# Shapes per (architecture, size). qwen3-0.6b is Qwen3-0.6B's shape, for benchmarks.
_SHAPES = {
    ("dense", "tiny"): dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    ("dense", "qwen3-0.6b"): dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    ("hybrid", "tiny"): dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    ("hybrid", "qwen3-0.6b"): dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    ("sliding", "tiny"): dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    ("sliding", "qwen3-0.6b"): dict(hidden_size=1024, num_hidden_layers=26, intermediate_size=3072, num_attention_heads=8, num_key_value_heads=4, head_dim=128),
    ("llama", "tiny"): dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # Four layers, three linear-attention (gated delta-net) and one full attention, as Qwen3.5/3.6 interleave them.
    ("moe", "tiny"): dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128),
    **_SMALL_SHAPES,
}

_CORPUS_WORDS = (
    "you are a helpful code assistant reviewer planner agent that reads writes tests and explains "
    "python rust function class module error value return import file path server request response "
    "the of to in and for with on by from as is are be this that it not or if then else when while "
    "please answer briefly carefully always never use tools call search open list check fix build run "
    "system user assistant message content token prompt cache model layer state snapshot warm cold "
    "hello world question first second next number data time day week plan task step goal review code "
    "中文 内容 你好 世界 模型 缓存 0 1 2 3 4 5 6 7 8 9 42 100 2026 ! ? . , : ; ' \" ( ) [ ] { } < > / - _ = + * # @ $ % & "
).split()


@dataclass(frozen=True)
class DemoSpec:
    arch: str = "dense"
    size: str = "tiny"
    template: str | None = None  # None: the architecture's own (llama3 for llama, else chatml)
    quantize_bits: int | None = None
    seed: int = 0
    sliding_window: int = 64
    # Greedy never picks a special or partial-UTF-8 token, so streamed text (and TTFT) starts
    # with the first generated token and every request runs to max_tokens. None: on for
    # the benchmark size (small) only, so the tests' models keep their weights.
    text_outputs: bool | None = None

    def check(self) -> None:
        if self.arch not in ARCHES:
            raise UsageError(f"--arch {self.arch!r} is not a demo architecture; use one of {', '.join(ARCHES)}")
        if self.size not in SIZES:
            raise UsageError(f"--size {self.size!r} is not a demo size; use one of {', '.join(SIZES)}")
        if (self.arch, self.size) not in _SHAPES:
            sizes = [size for arch, size in _SHAPES if arch == self.arch]
            raise UsageError(f"--size {self.size!r} has no shape for --arch {self.arch}; use one of {', '.join(sizes)}")
        if self.chat_template not in TEMPLATES:
            raise UsageError(f"--template {self.template!r} is not a demo template; use one of {', '.join(TEMPLATES)}")
        if (self.arch == "llama") != (self.chat_template == "llama3"):
            # The Llama-3 template needs the Llama-3 special tokens, which only the llama tokenizer has.
            raise UsageError(f"--template {self.chat_template} does not fit --arch {self.arch}: the llama3 template goes with --arch llama and only there; leave --template out or change it")
        if self.quantize_bits not in (None, 4, 8):
            raise UsageError(f"--quantize {self.quantize_bits} is not supported; use 4 or 8 (or leave it out for fp32)")

    @property
    def plain_text_outputs(self) -> bool:
        return self.size == "small" if self.text_outputs is None else self.text_outputs

    @property
    def chat_template(self) -> str:
        if self.template is not None:
            return self.template
        return "llama3" if self.arch == "llama" else "chatml"


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(3000):
        words = [rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(3, 16))]
        sep = rng.choice([" ", " ", " ", "\n", "\n\n", "\t", ", "])
        lines.append(sep.join(words))
    return lines


def _llama3_tokenizer(tok) -> list[str]:
    """Llama-3's pre-tokenizer and post-processor: a plain encode starts with <|begin_of_text|>, as Meta's does."""
    from tokenizers import Regex, pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return LLAMA3_SPECIAL_TOKENS


def _add_bos_post_processor(tok) -> None:
    from tokenizers import processors

    bos = LLAMA3_SPECIAL_TOKENS[0]
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.token_to_id(bos))]),
        ]
    )


def train_tokenizer(out_dir: Path, template: str, seed: int = 0, vocab_size: int = DEMO_VOCAB) -> tuple[int, list[int]]:
    """Train a byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json.

    Returns the vocabulary size and the end-of-sequence ids for config.json.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    llama3 = template == "llama3"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = _llama3_tokenizer(tok) if llama3 else SPECIAL_TOKENS
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if llama3:
        _add_bos_post_processor(tok)
    tok.save(str(out_dir / "tokenizer.json"))
    if llama3:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "model_max_length": CONTEXT,
            "clean_up_tokenization_spaces": True,
            "chat_template": TEMPLATES[template],
        }
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        return tok.get_vocab_size(), [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    eos = "</s>" if template == "mistral" else "<|im_end|>"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": eos,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": CONTEXT,
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATES[template],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return tok.get_vocab_size(), [tok.token_to_id(eos)]


def _model_config(spec: DemoSpec, vocab_size: int, eos_ids: list[int]) -> dict:
    shape = dict(_SHAPES[(spec.arch, spec.size)])
    common = dict(
        vocab_size=vocab_size,
        rms_norm_eps=1e-6,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=not spec.plain_text_outputs,  # an own lm_head, so its rows can be masked
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        torch_dtype="float32",
        **shape,
    )
    if spec.arch == "llama":
        # Llama-3.2's rope base; it ties its embeddings at 1B and 3B as here.
        # BpeTrainer gives the special tokens the first ids, in order.
        return dict(model_type="llama", rope_theta=500_000.0, rms_norm_eps=1e-5, bos_token_id=LLAMA3_SPECIAL_TOKENS.index("<|begin_of_text|>"), **{k: v for k, v in common.items() if k != "rms_norm_eps"})
    if spec.arch == "moe":
        return _moe_config(shape, common)
    if spec.arch == "dense":
        return dict(model_type="qwen3", rope_theta=1_000_000.0, **common)
    if spec.arch == "hybrid":
        layers = shape["num_hidden_layers"]
        return dict(
            model_type="qwen3_next",
            rope_theta=1_000_000.0,
            partial_rotary_factor=0.25,
            full_attention_interval=2,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            # Dense MLPs everywhere: the hybrid cache is what matters, not MoE routing.
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=shape["intermediate_size"],
            moe_intermediate_size=shape["intermediate_size"] // 2,
            mlp_only_layers=list(range(layers)),
            norm_topk_prob=True,
            **common,
        )
    return dict(
        model_type="gemma3_text",
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=shape["head_dim"],
        sliding_window=spec.sliding_window,
        sliding_window_pattern=2,
        **common,
    )


def _moe_config(shape: dict, common: dict) -> dict:
    """Qwen3.5/3.6 MoE (model_type qwen3_5_moe): the text model's fields nested in text_config, as the hub's configs are."""
    text = dict(
        model_type="qwen3_5_moe_text",
        full_attention_interval=4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        rope_parameters={"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        **{k: v for k, v in common.items() if k not in ("eos_token_id", "torch_dtype")},
    )
    text["intermediate_size"] = shape["moe_intermediate_size"]  # unused with experts; the dataclass wants one
    text["tie_word_embeddings"] = False  # Qwen3.5/3.6 MoE keep a separate lm_head
    return dict(model_type="qwen3_5_moe", text_config=text, tie_word_embeddings=False, eos_token_id=common["eos_token_id"], torch_dtype="float32")


def _non_text_ids(tokenizer_json: Path) -> list[int]:
    """Ids that decode to no text alone: special tokens, and byte pieces of a longer UTF-8 character."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    special = set(tok.get_added_tokens_decoder())
    texts = {i: tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())}
    return sorted(i for i, text in texts.items() if i in special or not text or "\ufffd" in text)


def _mask_output_rows(model, ids: list[int], used_vocab: int) -> None:
    """Zero lm_head rows (``ids``, and those past the tokenizer's vocabulary): a zero logit never beats the largest of hundreds of random ones."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    (name, weight), = [(n, w) for n, w in tree_flatten(model.parameters()) if n.endswith("lm_head.weight")]
    keep = mx.ones((weight.shape[0], 1))
    keep[mx.array(ids)] = 0.0
    keep[used_vocab:] = 0.0
    model.update(tree_unflatten([(name, weight * keep)]))
    mx.eval(model.parameters())


def _randomize(model, seed: int, used_vocab: int) -> None:
    """Seeded Gaussian weights, scaled so outputs depend strongly on the context."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    new = []
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        key = mx.random.key(seed * 100_003 + i)
        if value.ndim < 2 or "conv1d" in name:
            if "conv1d" in name:
                value = mx.random.normal(value.shape, key=key) * 0.5
            new.append((name, value.astype(mx.float32)))
            continue
        fan_in = value.shape[-1]
        if "embed_tokens" in name:
            w = mx.random.normal(value.shape, key=key)
            if used_vocab < value.shape[0]:
                # Ids the tokenizer never produces get zero logits, so greedy never picks them.
                w = mx.concatenate([w[:used_vocab], mx.zeros((value.shape[0] - used_vocab, value.shape[1]))])
        else:
            w = mx.random.normal(value.shape, key=key) * (1.5 / fan_in**0.5)
        new.append((name, w.astype(mx.float32)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def make_demo_model(out_dir: str | Path, spec: DemoSpec = DemoSpec(), force: bool = False) -> Path:
    """Write a loadable mlx-lm model directory for ``spec`` (atomically) and return its path.

    An existing directory is kept unless ``force``: the weights are deterministic anyway.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model

    spec.check()
    out = Path(out_dir)
    if out.exists() and not force:
        if (out / "config.json").exists():
            return out
        raise UsageError(f"{out} exists and is not a model directory; choose another path or pass --force")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        vocab, eos_ids = train_tokenizer(tmp, spec.chat_template, seed=spec.seed)
        model_vocab = QWEN3_06B_VOCAB if spec.size == "qwen3-0.6b" else vocab
        config = _model_config(spec, model_vocab, eos_ids)
        model_cls, args_cls = _get_classes(config)
        mx.random.seed(spec.seed)
        model = model_cls(args_cls.from_dict(config))
        _randomize(model, spec.seed, vocab)
        if spec.plain_text_outputs:
            _mask_output_rows(model, _non_text_ids(tmp / "tokenizer.json"), vocab)
        if spec.quantize_bits:
            # As mlx_lm.convert -q does for mlx-community models: the model's own predicate
            # (a MoE router stays at 8 bits), per-layer overrides in config["quantization"].
            model, config = quantize_model(model, config, group_size=64, bits=spec.quantize_bits)
            config["quantization_config"] = config["quantization"]
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        config["kvsnap_demo"] = {"arch": spec.arch, "size": spec.size, "template": spec.chat_template, "seed": spec.seed}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
