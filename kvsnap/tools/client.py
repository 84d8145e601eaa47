"""A small OpenAI-API client for the quickstart, tests and benchmarks: streams and times a
request."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class ChatResult:
    text: str = ""
    ttft_s: float = 0.0  # to the first content token; the whole request's time when none came
    total_s: float = 0.0
    usage: dict = field(default_factory=dict)
    finish_reason: str | None = None
    chunks: int = 0

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def chat_body(model: str, messages: list, max_tokens: int, **extra) -> dict:
    """A greedy streaming chat request that reports usage (and so cached tokens) at its end."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        **extra,
    }


def stream_chat(
    client: httpx.Client, url: str, model: str, messages: list, max_tokens: int = 32, **extra
) -> ChatResult:
    """POST a streaming chat completion; time to the first content token and usage."""
    body = chat_body(model, messages, max_tokens, **extra)
    result = ChatResult()
    first: float | None = None
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter() - t0
                    result.text += content
                    result.chunks += 1
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
    result.total_s = time.perf_counter() - t0
    result.ttft_s = first if first is not None else result.total_s
    return result
