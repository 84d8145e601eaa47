"""OpenAI wire types: request validation and response shapes. No mlx, no engine."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

MAX_STOP_SEQUENCES = 8
MAX_STOP_LENGTH = 1024
MAX_TOKENS_LIMIT = 2**31 - 1  # beyond any context; keeps absurd values out of mlx-lm's int fields
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    # Clients send many optional OpenAI fields kvsnap does not use; ignore those, type-check ours.
    model_config = ConfigDict(extra="ignore")

    # None (left out): the served model, as mlx_lm.server takes it (ServerContext.check_model)
    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    # None: the server's default (serve --temp, --top-p, --top-k, --min-p)
    temperature: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, ge=0, le=2)
    top_p: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, gt=0, le=1)
    # 0 and vLLM's -1: off
    top_k: Optional[StrictInt] = Field(default=None, ge=-1, le=MAX_TOKENS_LIMIT)
    min_p: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, ge=0, le=1)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    # OpenAI's int64, and uint64
    seed: Optional[StrictInt] = Field(default=None, ge=-(2**63), le=2**64 - 1)
    n: StrictInt = Field(default=1, ge=1, le=1)
    # vLLM's name: scopes cached prefixes
    cache_salt: Optional[StrictStr] = Field(default=None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"a stop sequence may be at most {MAX_STOP_LENGTH} characters")
        return [s for s in stops if s]

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[Any]  # checked by prompts.normalize_messages, shared with warm-prompt files
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Any] = None
    chat_template_kwargs: Optional[dict] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    @property
    def wanted_top_logprobs(self) -> Optional[int]:
        """None: no log-probabilities; N: each token's and its N most likely."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt]]
    max_tokens: Optional[StrictInt] = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    # OpenAI's legacy N (the N most likely beside each token's own); mlx_lm.server's clients
    # send true with top_logprobs
    logprobs: Optional[Union[StrictBool, StrictInt]] = None
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v):
        if not isinstance(v, bool) and v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        return v

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    @property
    def wanted_top_logprobs(self) -> Optional[int]:
        """None: no log-probabilities; N: each token's and its N most likely."""
        if self.logprobs is None or self.logprobs is False:
            return None
        return (self.top_logprobs or 0) if self.logprobs is True else self.logprobs


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "tokens_saved": cached_tokens,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: str,
    usage_: dict,
    logprobs: Optional[dict] = None,
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": logprobs,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict,
    finish_reason: Optional[str] = None,
    usage_: Optional[dict] = None,
    logprobs: Optional[dict] = None,
) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def completion_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: Optional[str],
    usage_: Optional[dict],
    obj: Literal["text_completion"] = "text_completion",
    logprobs: Optional[dict] = None,
) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    body = {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body
