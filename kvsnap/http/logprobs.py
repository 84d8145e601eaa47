"""Log-probabilities in OpenAI's shapes: chat's ``logprobs.content`` entries (``token``,
``logprob``, ``bytes``, ``top_logprobs``) and the legacy completions' ``tokens``,
``token_logprobs``, ``top_logprobs`` and ``text_offset``. The values are the engine's (mlx-lm's
log-softmax); here a token id becomes its text and bytes."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from kvsnap.runtime.engine.types import TokenLogprob

TokenBytes = Callable[[int], bytes]


def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """A token id's own bytes, as the model's detokenizer writes them: byte-level BPE pieces
    mapped back to bytes and SentencePiece's ``▁`` and ``<0xNN>`` pieces undone (a token
    holding part of a character keeps its partial bytes); other tokenizers decode the id."""
    kind = type(tokenizer.detokenizer).__name__
    if kind == "BPEStreamingDetokenizer":
        from mlx_lm.tokenizer_utils import _byte_decoder

        decoder = _byte_decoder()

        def bpe(token: int) -> bytes:
            piece = tokenizer.convert_ids_to_tokens(token)
            if all(c in decoder for c in piece):
                return bytes(decoder[c] for c in piece)
            return tokenizer.decode([token]).encode()

        return bpe
    if kind == "SPMStreamingDetokenizer":

        def spm(token: int) -> bytes:
            piece = tokenizer.convert_ids_to_tokens(token)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()

        return spm
    return lambda token: tokenizer.decode([token]).encode()


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict:
    """``choices[].logprobs`` of a chat answer or chunk."""

    def one(token: int, logprob: float) -> dict:
        raw = token_bytes(token)
        return {"token": _text(raw), "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_bytes: TokenBytes, offset: int = 0
) -> dict:
    """``choices[].logprobs`` of a legacy completion or chunk; ``offset``: where the first
    token's text starts in the answer (a stream's earlier chunks)."""
    tokens: list[str] = []
    offsets: list[int] = []
    top: list[Optional[dict]] = []
    for e in entries:
        offsets.append(offset)
        text = _text(token_bytes(e.token))
        tokens.append(text)
        offset += len(text)
        # tokens whose texts are alike (parts of one character) share a key: the likeliest's
        alike: dict[str, float] = {}
        for i, v in e.top:
            alike.setdefault(_text(token_bytes(i)), v)
        top.append(alike or None)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def text_length(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> int:
    """How far ``entries`` move a stream's ``text_offset``."""
    return sum(len(_text(token_bytes(e.token))) for e in entries)
