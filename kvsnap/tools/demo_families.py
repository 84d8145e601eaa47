"""The demo model families: each architecture and size (``DemoSpec``, checked) and the
``config.json`` mlx-lm builds it from. No mlx here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsnap.errors import UsageError
from kvsnap.tools.demo_templates import TEMPLATES
from kvsnap.tools.demo_tokenizer import CONTEXT, LLAMA3_SPECIAL_TOKENS

# dense = qwen3, hybrid = qwen3_next (SSM + attention, dense MLPs), sliding = gemma3_text,
# llama = llama with a Llama-3-style tokenizer, moe = qwen3_5_moe (Qwen3.5/3.6 MoE hybrid).
ARCHES = ("dense", "hybrid", "sliding", "llama", "moe")
# tiny: tests; small: the 2-core benchmark table (scripts/bench_table.py); qwen3-0.6b: Qwen3-0.6B's
# shape.
SIZES = ("tiny", "small", "qwen3-0.6b")
QWEN3_06B_VOCAB = 151936

# The benchmark table's shapes: sized so quantized matmul on 2 CPU cores (~1.6 GFLOPS at 4
# and 8 bits) prefills ~4,200 prompt tokens in seconds; why each is what it is: docs/benchmarks.md.
_SMALL_SHAPES = {
    ("dense", "small"): dict(
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=384,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    ),
    ("llama", "small"): dict(
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=384,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    ),
    ("moe", "small"): dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    ),
}

# Shapes per (architecture, size). qwen3-0.6b is Qwen3-0.6B's shape, for benchmarks.
_SHAPES = {
    ("dense", "tiny"): dict(
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    ("dense", "qwen3-0.6b"): dict(
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    ("hybrid", "tiny"): dict(
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    ("hybrid", "qwen3-0.6b"): dict(
        hidden_size=1024,
        num_hidden_layers=24,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
    ("sliding", "tiny"): dict(
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    ("sliding", "qwen3-0.6b"): dict(
        hidden_size=1024,
        num_hidden_layers=26,
        intermediate_size=3072,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
    ),
    ("llama", "tiny"): dict(
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    # Four layers, three linear-attention (gated delta-net) and one full attention, as Qwen3.5/3.6
    # interleave them.
    ("moe", "tiny"): dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    ),
    **_SMALL_SHAPES,
}


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
    # None: the shape's own; another count makes pipeline stages of unequal size (tests).
    layers: int | None = None

    def check(self) -> None:
        if self.arch not in ARCHES:
            raise UsageError(
                f"--arch {self.arch!r} is not a demo architecture; use one of {', '.join(ARCHES)}"
            )
        if self.size not in SIZES:
            raise UsageError(
                f"--size {self.size!r} is not a demo size; use one of {', '.join(SIZES)}"
            )
        if (self.arch, self.size) not in _SHAPES:
            sizes = [size for arch, size in _SHAPES if arch == self.arch]
            raise UsageError(
                f"--size {self.size!r} has no shape for --arch {self.arch}; use one of "
                f"{', '.join(sizes)}"
            )
        if self.chat_template not in TEMPLATES:
            raise UsageError(
                f"--template {self.template!r} is not a demo template; use one of "
                f"{', '.join(TEMPLATES)}"
            )
        if (self.arch == "llama") != (self.chat_template == "llama3"):
            # The Llama-3 template needs the Llama-3 special tokens, which only the llama tokenizer
            # has.
            raise UsageError(
                f"--template {self.chat_template} does not fit --arch {self.arch}: the llama3 "
                f"template goes with --arch llama and only there; leave --template out or change it"
            )
        if self.layers is not None and not 1 <= self.layers <= 64:
            raise UsageError(f"--layers {self.layers} is out of range; use 1 to 64")
        if self.quantize_bits not in (None, 4, 8):
            raise UsageError(
                f"--quantize {self.quantize_bits} is not supported; use 4 or 8 (or leave it out "
                f"for fp32)"
            )

    @property
    def plain_text_outputs(self) -> bool:
        return self.size == "small" if self.text_outputs is None else self.text_outputs

    @property
    def chat_template(self) -> str:
        if self.template is not None:
            return self.template
        return "llama3" if self.arch == "llama" else "chatml"


def model_config(spec: DemoSpec, vocab_size: int, eos_ids: list[int]) -> dict:
    shape = dict(_SHAPES[(spec.arch, spec.size)])
    if spec.layers is not None:
        shape["num_hidden_layers"] = spec.layers
    common = dict(
        vocab_size=vocab_size,
        rms_norm_eps=1e-6,
        max_position_embeddings=CONTEXT,
        # an own lm_head, so its rows can be masked
        tie_word_embeddings=not spec.plain_text_outputs,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        torch_dtype="float32",
        **shape,
    )
    if spec.arch == "llama":
        # Llama-3.2's rope base; it ties its embeddings at 1B and 3B as here.
        # BpeTrainer gives the special tokens the first ids, in order.
        return dict(
            model_type="llama",
            rope_theta=500_000.0,
            rms_norm_eps=1e-5,
            bos_token_id=LLAMA3_SPECIAL_TOKENS.index("<|begin_of_text|>"),
            **{k: v for k, v in common.items() if k != "rms_norm_eps"},
        )
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
    """Qwen3.5/3.6 MoE (model_type qwen3_5_moe): the text model's fields nested in text_config, as
    the hub's configs are."""
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
        rope_parameters={
            "type": "default",
            "mrope_section": [11, 11, 10],
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
        **{k: v for k, v in common.items() if k not in ("eos_token_id", "torch_dtype")},
    )
    # unused with experts; the dataclass wants one
    text["intermediate_size"] = shape["moe_intermediate_size"]
    text["tie_word_embeddings"] = False  # Qwen3.5/3.6 MoE keep a separate lm_head
    return dict(
        model_type="qwen3_5_moe",
        text_config=text,
        tie_word_embeddings=False,
        eos_token_id=common["eos_token_id"],
        torch_dtype="float32",
    )
