"""What every route needs, one object per app (no globals): the engine, the server's
configuration, who is calling, the checks the endpoints share, and the in-flight count."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request

from kvsnap.http.api_errors import APIError
from kvsnap.http.config import DEFAULT_MODEL, ServerConfig
from kvsnap.http.handoff import Handoffs
from kvsnap.http.limits import (
    allowed_template_kwargs,
    context_length,
    find_lone_surrogate,
    template_variables,
    vocab_bound,
)
from kvsnap.http.logprobs import TokenBytes, token_bytes_of
from kvsnap.http.metrics import Metrics
from kvsnap.http.schemas import usage
from kvsnap.http.tool_calls import output_rules
from kvsnap.runtime.engine.accounting import reported_cached_tokens
from kvsnap.runtime.engine.engine import Engine, RequestState

log = logging.getLogger("kvsnap.http.server")


@dataclass
class ServerContext:
    engine: Engine
    config: ServerConfig
    started: float = field(default_factory=time.time)  # reset when the app starts
    inflight: int = 0  # requests admitted (being prepared, queued or running) and not yet ended
    _limits: dict = field(default_factory=dict)  # filled on first use: the model is loaded by then
    _preparing: Optional[asyncio.Semaphore] = None
    _tools_unrendered_warned: bool = False  # one warning per server start, not one per request
    metrics: Metrics = field(init=False)  # this app's own registry (GET /metrics)
    # serve --record-agents: an AgentRecorder, or None
    recorder: Optional[Any] = None
    # the engine's events handed to the event loop, one wake-up per engine step
    handoffs: Handoffs = field(default_factory=Handoffs)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.engine, lambda: self.inflight)

    def admit(self) -> None:
        """Take an in-flight slot or answer 429: before any costly work on the request."""
        if self.inflight >= self.config.max_inflight:
            raise APIError(
                429,
                f"the server has {self.inflight} requests being prepared, running or queued "
                f"(--max-queued-requests); retry shortly",
                None,
                "rate_limit_exceeded",
                "rate_limit_error",
                {"Retry-After": "1"},
            )
        self.inflight += 1

    def release(self, state: Optional[RequestState] = None) -> None:
        """Give the slot back; with ``state``, the engine has ended that generation."""
        self.inflight -= 1
        if state is not None:
            self.metrics.finished(state)

    def preparing(self) -> asyncio.Semaphore:
        """At most ``max_preparing`` prompts rendered at once; the rest wait, holding their slot."""
        if self._preparing is None:
            self._preparing = asyncio.Semaphore(self.config.max_preparing)
        return self._preparing

    def check_sizes(self, req: Any) -> None:
        """Counts that make rendering expensive, refused before any of it runs."""
        n = len(req.messages)
        if n > self.config.max_messages:
            raise APIError(
                400,
                f"messages: {n} messages is more than this server takes "
                f"({self.config.max_messages}); send fewer, or start the server with a larger "
                f"--max-messages",
                "messages",
                "invalid_value",
            )
        if req.tools is not None and len(req.tools) > self.config.max_tools:
            raise APIError(
                400,
                f"tools: {len(req.tools)} tools is more than {self.config.max_tools}; send fewer",
                "tools",
                "invalid_value",
            )
        if req.tools:
            self.warn_unrendered_tools()

    def warn_unrendered_tools(self) -> None:
        """Requests send tools, and the model's chat template reads no ``tools``: the model
        never sees them. Logged once per server start (the request is still served)."""
        if self._tools_unrendered_warned:
            return
        self._tools_unrendered_warned = True
        template = getattr(self.engine.lm.tokenizer, "chat_template", None)
        if "tools" not in template_variables(template):
            log.warning(
                "[kvsnap] a request sent tools, but this model's chat template renders none (it "
                "reads no `tools` variable): the model never sees them and cannot call them; "
                "serve a model whose template renders tools (this is logged once)"
            )

    def model_limits(self) -> dict:
        if not self._limits:
            # Built whole, then published: requests prepared at once in worker threads must
            # never see it half filled (a burst right after a restart did: KeyError, 500).
            lm = self.engine.lm
            limits = {
                "vocab": vocab_bound(lm.model, lm.config),
                "template_kwargs": allowed_template_kwargs(
                    getattr(lm.tokenizer, "chat_template", None)
                ),
                "context": self.config.context_length or context_length(lm.config),
                "token_bytes": token_bytes_of(lm.tokenizer),
                # tool-call and think markers: how every chat API's answer is split
                "answer_rules": output_rules(lm.tokenizer, self.config.reasoning_parser),
            }
            self._limits = limits
        return self._limits

    def token_bytes(self) -> TokenBytes:
        """A token id's bytes, for log-probabilities' ``token`` and ``bytes``."""
        return self.model_limits()["token_bytes"]

    @staticmethod
    def caller(request: Request) -> tuple[str, bool]:
        """(tenant, admin): admin = no keys configured, or an admin key."""
        return getattr(request.state, "tenant", ""), getattr(request.state, "admin", True)

    def require_admin(self, request: Request) -> None:
        # Without admin keys configured, every valid key may clear the cache (one trust level).
        if self.config.auth.admin_keys and not self.caller(request)[1]:
            raise APIError(
                403,
                "this needs an admin key (--admin-api-key / KVSNAP_ADMIN_API_KEY)",
                None,
                "insufficient_permissions",
            )

    def check_model(self, name: Optional[str]) -> None:
        """A request's ``model``: None (left out) and mlx-lm's ``default_model`` mean the
        served one; any other name must be served here, else a 404 naming what is."""
        config = self.config
        if name is None or name in (DEFAULT_MODEL, *config.model_names, *config.model_aliases):
            return
        raise APIError(404, self.unknown_model(name), "model", "model_not_found")

    def unknown_model(self, name: str) -> str:
        served = ", ".join(repr(n) for n in self.config.model_names)
        return (
            f"model {name!r} is not served here; this server serves {served} (GET /v1/models); "
            f"leave model out to use it"
        )

    def check_ready(self) -> None:
        if self.engine.failed is not None:
            raise APIError(
                503,
                f"the engine failed to start: {self.engine.failed}",
                None,
                "engine_failed",
                "server_error",
            )

    @staticmethod
    def check_text(req: Any, fields: tuple[str, ...]) -> None:
        for name in fields:
            where = find_lone_surrogate(getattr(req, name, None), name)
            if where is not None:
                raise APIError(
                    400,
                    f"{where}: the text holds a lone surrogate code point, which is not valid "
                    f"Unicode; send UTF-8 text",
                    where,
                    "invalid_value",
                )

    def resolve_max_tokens(
        self, requested: Optional[int], prompt_len: int, cap: bool = False
    ) -> int:
        """The answer's token budget; ``cap``: ``requested`` is an upper bound the context
        may cut (the agent APIs' ``max_tokens``), not a length to refuse when it cannot fit."""
        ctx = self.model_limits()["context"]
        max_tokens = requested if requested is not None else self.config.default_max_tokens
        if ctx is not None:
            if prompt_len >= ctx:
                raise APIError(
                    400,
                    f"the prompt has {prompt_len} tokens but the model's context is {ctx}; shorten "
                    f"the messages",
                    "messages",
                    "context_length_exceeded",
                )
            if requested is not None and not cap and prompt_len + requested > ctx:
                raise APIError(
                    400,
                    f"max_tokens {requested} + {prompt_len} prompt tokens exceed the model's "
                    f"context of {ctx}; ask for at most {ctx - prompt_len}",
                    "max_tokens",
                    "context_length_exceeded",
                )
            max_tokens = min(max_tokens, ctx - prompt_len)
        return max_tokens

    def reported_usage(self, state: RequestState) -> dict:
        # Without keys every caller is trusted alike and sees /v1/status's exact counts:
        # rounding would hide nothing from anyone and only under-report.
        step = self.config.cached_tokens_granularity if self.config.auth.enabled else 1
        cached = reported_cached_tokens(state, step)
        return usage(state.prompt_tokens, state.completion_tokens, cached)
