"""mlx_lm.server's request path held to what ``kvsnap serve`` allows.

mlx-lm renders a request's ``chat_template_kwargs`` as they come, ``chat_template`` included:
a client-supplied template is code (an injected one renders; a nested loop hangs the
server, SIGTERM included). It hands ``top_k`` to ``apply_top_k``, which raises for the
vocabulary size or more, and in a batch that kills the generation thread for good; a NaN
``min_p`` does the same, and a temperature below 1e-38 overflows 1/T and samples uniformly.

``guard_requests`` fences all of that with kvsnap serve's own rules: the kwargs through
``kvsnap.http.limits`` (only variables the model's template reads, plain values; messages
and tools counted before any render), non-finite sampling numbers refused with a 400, and
mlx-lm's ``_make_sampler`` given the values ``kvsnap.runtime.engine.sampling`` settles.
It also lets ``/v1/models`` answer on a machine without a Hugging Face cache folder.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any, Callable

from kvsnap.http.limits import (
    RequestRejected,
    allowed_template_kwargs,
    check_counts,
    check_template_kwargs,
    sampling_refusal,
)
from kvsnap.integrations.mlx_lm.models import Refusal, refusing_handler

LOAD_POLL_S = 0.05


def template_refusal(body: dict, template: Callable[[], Any]) -> Refusal:
    """kvsnap serve's checks on what reaches the chat template: counts first, then the
    kwargs against the variables of ``template()`` (the loaded model's template)."""
    messages, tools = body.get("messages"), body.get("tools")
    kwargs = body.get("chat_template_kwargs")
    try:
        check_counts(messages, tools)
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RequestRejected(
                "chat_template_kwargs: give an object of template variables",
                "chat_template_kwargs",
            )
        if kwargs:
            check_template_kwargs(kwargs, allowed_template_kwargs(template()))
    except RequestRejected as exc:
        return exc.param or "messages", str(exc), "invalid_value"
    return None


def settled_sampler(upstream: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """mlx-lm's ``_make_sampler(args, tokenizer)`` on the values kvsnap serve samples with: a
    temperature below the floor is greedy, a top_p below its floor is the floor, and a top_k
    of the vocabulary (the log-probabilities' width) or more is off."""
    from kvsnap.runtime.engine.sampling import TOP_P_FLOOR, is_greedy, top_k_applies

    def make(args: Any, tokenizer: Any) -> Any:
        s = args.sampling
        temperature = 0.0 if is_greedy(s.temperature) else s.temperature
        top_p = max(s.top_p, TOP_P_FLOOR) if s.top_p > 0 else s.top_p
        settled = dataclasses.replace(s, temperature=temperature, top_p=top_p)
        with_k = upstream(dataclasses.replace(args, sampling=settled), tokenizer)
        if temperature == 0 or s.top_k <= 0:
            return with_k
        off = dataclasses.replace(settled, top_k=0)
        without_k = upstream(dataclasses.replace(args, sampling=off), tokenizer)

        def sample(logprobs: Any) -> Any:
            applies = top_k_applies(s.top_k, logprobs.shape[-1])
            return (with_k if applies else without_k)(logprobs)

        return sample

    return make


def models_without_cache(scan: Callable[[], Any]) -> Callable[[], Any]:
    """huggingface_hub's ``scan_cache_dir`` that finds nothing where the cache folder does not
    exist: mlx-lm's ``/v1/models`` called it after its 200 and answered an empty body."""
    from huggingface_hub.errors import CacheNotFound

    def scan_cache_dir(*args: Any, **kwargs: Any) -> Any:
        try:
            return scan(*args, **kwargs)
        except CacheNotFound:
            return SimpleNamespace(repos=frozenset())

    return scan_cache_dir


def guard_requests(server: Any) -> None:
    """Install the checks on mlx_lm.server (before its ``main`` runs): wraps
    ``_run_http_server``, which both mlx-lm's ``run`` and kvsnap's warm ``run`` call."""
    upstream_http = server._run_http_server
    server._make_sampler = settled_sampler(server._make_sampler)
    server.scan_cache_dir = models_without_cache(server.scan_cache_dir)

    def run_http_server(host, port, response_generator, server_class=None, handler_class=None):
        def template() -> Any:
            # The port opens while mlx-lm loads --model: wait for its template, as the request
            # would wait for the model. None (every kwarg refused) if the load failed, or when
            # no model is loaded yet and none is on its way (--allow-request-models, no --model).
            provider = response_generator.model_provider
            while (
                provider.tokenizer is None
                and provider.cli_args.model is not None
                and response_generator.generation_available()
            ):
                time.sleep(LOAD_POLL_S)
            return getattr(provider.tokenizer, "chat_template", None)

        def check(body: dict) -> Refusal:
            return sampling_refusal(body) or template_refusal(body, template)

        handler = refusing_handler(handler_class or server.APIHandler, check)
        extra = {"server_class": server_class} if server_class is not None else {}
        return upstream_http(host, port, response_generator, handler_class=handler, **extra)

    server._run_http_server = run_http_server
