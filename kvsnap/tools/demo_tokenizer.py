"""A demo model's tokenizer: byte-level BPE trained on a small seeded corpus (nothing is
downloaded), with the special tokens and chat template of its family (Llama-3's pre-tokenizer
and BOS post-processor for ``llama``, ChatML-style for the rest). No mlx here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvsnap.tools.demo_templates import TEMPLATES

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "<think>",
    "</think>",
]
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
# Meta's Llama-3 pre-tokenizer split (digits in threes, newlines kept apart from words).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
    r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEMO_VOCAB = 2048
# every demo model's context: the tokenizer's model_max_length, the config's max positions
CONTEXT = 32768

_CORPUS_WORDS = (
    "you are a helpful code assistant reviewer planner agent that reads writes tests and explains "
    "python rust function class module error value return import file path server request response "
    "the of to in and for with on by from as is are be this that it not or if then else when while "
    "please answer briefly carefully always never use tools call search open list check fix build "
    "run "
    "system user assistant message content token prompt cache model layer state snapshot warm cold "
    "hello world question first second next number data time day week plan task step goal review "
    "code "
    "中文 内容 你好 世界 模型 缓存 0 1 2 3 4 5 6 7 8 9 42 100 2026 "
    "! ? . , : ; ' \" ( ) [ ] { } < > / - _ = + "
    "* # @ $ % & "
).split()


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(3000):
        words = [rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(3, 16))]
        sep = rng.choice([" ", " ", " ", "\n", "\n\n", "\t", ", "])
        lines.append(sep.join(words))
    return lines


def _llama3_tokenizer(tok) -> list[str]:
    """Llama-3's pre-tokenizer and post-processor: a plain encode starts with <|begin_of_text|>, as
    Meta's does."""
    from tokenizers import Regex, pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return LLAMA3_SPECIAL_TOKENS


def _add_bos_post_processor(tok) -> None:
    from tokenizers import processors

    bos = LLAMA3_SPECIAL_TOKENS[0]
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, tok.token_to_id(bos))],
            ),
        ]
    )


def train_tokenizer(
    out_dir: Path, template: str, seed: int = 0, vocab_size: int = DEMO_VOCAB
) -> tuple[int, list[int]]:
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
        (out_dir / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False)
        )
        return tok.get_vocab_size(), [
            _token_id(tok, "<|end_of_text|>"),
            _token_id(tok, "<|eot_id|>"),
        ]
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
    return tok.get_vocab_size(), [_token_id(tok, eos)]


def _token_id(tok, text: str) -> int:
    """The id of a special token the trained vocabulary holds (every one it was given)."""
    found = tok.token_to_id(text)
    if found is None:
        raise ValueError(f"the demo tokenizer has no token {text!r}")
    return found


def non_text_ids(tokenizer_json: Path) -> list[int]:
    """Ids that decode to no text alone: special tokens, and byte pieces of a longer UTF-8
    character."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    special = set(tok.get_added_tokens_decoder())
    texts = {i: tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())}
    return sorted(i for i, text in texts.items() if i in special or not text or "\ufffd" in text)
