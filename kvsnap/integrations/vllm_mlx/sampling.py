"""Each request's sampling values on vllm-mlx, held to kvsnap serve's rules.

vllm-mlx 0.6's text batch samples every row with one sampler: the one made from the values
of the request that created its ``BatchGenerator`` (``Scheduler._ensure_batch_generator``),
kept while any request runs. A greedy request beside another key's ``temperature`` samples
at that temperature (and the other way round), ``top_k`` is dropped, and a ``min_p``
outside [0, 1] (NaN included: vllm-mlx checks no range) raises in mlx-lm's compiled
``apply_min_p`` inside the batch: every running request ends with a 500, and the failed
trace leaves mlx's global random state unusable, so every later sampled request of every
key 500s until a restart. A temperature of 1e-39 overflows 1/T and samples at random.

``guard_sampling`` installs, once per process:

- ``SamplingChecks``: an ASGI middleware refusing, before vllm-mlx reads the body, a NaN
  or infinite sampling number and a ``min_p`` outside [0, 1] with a 400 in OpenAI's shape
  naming the field, on every route that takes them (``PATHS``);
- on vllm-mlx's ``Scheduler``: the batch's shared sampler is greedy and never rebuilt for a
  request's values; each sampled request's row gets its own sampler, made by
  ``kvsnap.runtime.engine.sampling`` on its settled values (a ``top_k`` of the vocabulary
  or more is off, a temperature below the floor greedy, a ``top_p`` below its floor the
  top token); a row whose sampler still raises ends that request alone (vllm-mlx's
  ``finish_reason="error"``: a 500, or an SSE error event) with mlx's random state reseeded,
  while the rest of the batch goes on.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
from typing import Any, Callable

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx  # noqa: E402

from kvsnap.http.limits import sampling_refusal  # noqa: E402
from kvsnap.runtime.engine.sampling import (  # noqa: E402
    TOP_P_FLOOR,
    OwnSampler,
    greedy,
    make_request_sampler,
)

log = logging.getLogger("kvsnap.vllm_mlx")

MARK = "_kvsnap_sampling"
# The sampling numbers each route's request model reads (vllm-mlx 0.6).
PATHS = {
    "/v1/chat/completions": ("temperature", "top_p", "top_k", "min_p"),
    "/v1/completions": ("temperature", "top_p", "top_k", "min_p"),
    "/v1/messages": ("temperature", "top_p", "top_k"),
    "/v1/responses": ("temperature", "top_p"),
}


# --- the request body -------------------------------------------------------------------


def body_refusal(path: str, body: Any) -> tuple[str, str] | None:
    """(field, message) for a sampling value of ``body`` that must not reach a batch; None
    when all may (a body that is not a JSON object is left to vllm-mlx)."""
    fields = PATHS.get(path)
    if fields is None or not isinstance(body, dict):
        return None
    refused = sampling_refusal({name: body.get(name) for name in fields})
    if refused is not None:
        return refused[0], refused[1]
    min_p = body.get("min_p") if "min_p" in fields else None
    if isinstance(min_p, (int, float)) and not isinstance(min_p, bool) and not 0 <= min_p <= 1:
        return "min_p", f"min_p: {min_p} is outside [0, 1]"
    return None


class SamplingChecks:
    """ASGI middleware: a POST to one of ``PATHS`` whose JSON body ``body_refusal`` refuses is
    answered 400 here; any other request reaches vllm-mlx with its body as sent. A request
    without vllm-mlx's API key (``api_key()``, when one is set) is left to vllm-mlx's 401."""

    def __init__(self, app: Any, api_key: Callable[[], str | None] = lambda: None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope.get("type") != "http" or scope.get("method") != "POST" or path not in PATHS:
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await self.app(scope, receive, send)
        chunks, message = [], {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message.get("type") != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
        raw = b"".join(chunks)
        try:
            refused = body_refusal(path, json.loads(raw))
        except ValueError:  # not JSON (or not UTF-8): vllm-mlx answers it
            refused = None
        if refused is not None:
            return await self._refuse(send, *refused)
        sent = False

        async def replay() -> dict:
            # A closure over receive: vllm-mlx's disconnect check walks closures down to
            # uvicorn's own receive.
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, scope: dict) -> bool:
        key = self.api_key()
        if key is None:
            return True
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), key)

    @staticmethod
    async def _refuse(send: Callable, param: str, message: str) -> None:
        from kvsnap.http.error_body import error_body

        payload = json.dumps(error_body(message, param=param, code="invalid_value")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


# --- the batch --------------------------------------------------------------------------


def settled_min_p(min_p: float) -> float:
    """``min_p`` within [0, 1], where mlx-lm's ``apply_min_p`` does not raise (NaN: off)."""
    return min(float(min_p), 1.0) if min_p >= 0 else 0.0


class RowSampler(OwnSampler):
    """kvsnap serve's ``OwnSampler`` (the error kept, a greedy token for the row), with mlx's
    global random state reseeded after a failure: one raised inside a compiled mlx-lm filter
    leaves that state unusable for every later draw of every request."""

    def __call__(self, logprobs: mx.array) -> mx.array:
        failed = self.error is not None
        token = super().__call__(logprobs)
        if not failed and self.error is not None:
            mx.random.seed(random.getrandbits(63))
        return token


def row_sampler(params: Any) -> Callable[[mx.array], mx.array]:
    """The sampler of one request's row: ``greedy``, or kvsnap serve's sampler on the settled
    values, kept from failing its batch. A ``top_p`` of 1/vocabulary or less keeps the top
    token alone (it holds at least that mass): greedy, where mlx-lm 0.31's ``apply_top_p``
    (``1 - top_p`` rounds to 1 in float32 below 6e-8) would drop every token and draw at
    random."""
    sampler = make_request_sampler(
        params.temperature,
        top_p=params.top_p,
        top_k=int(params.top_k or 0),
        min_p=settled_min_p(params.min_p),
    )
    if sampler is greedy:
        return greedy
    top_p = max(params.top_p, TOP_P_FLOOR)

    def sample(logprobs: mx.array) -> mx.array:
        if top_p * logprobs.shape[-1] <= 1:
            return greedy(logprobs)
        return sampler(logprobs)

    return RowSampler(sample)


def own_row_samplers(scheduler_cls: Any, request_output: Any) -> bool:
    """Give each request of vllm-mlx's ``Scheduler`` its own row sampler (once per class);
    False, with a warning, where this vllm-mlx lacks the methods."""
    if getattr(scheduler_cls, MARK, False):
        return True
    needed = (
        "_ensure_batch_generator",
        "_create_batch_generator",
        "_process_batch_responses",
        "_do_abort_request",
    )
    missing = [name for name in needed if not callable(getattr(scheduler_cls, name, None))]
    if missing:
        log.warning(
            "[kvsnap] this vllm-mlx's Scheduler lacks %s: requests share the batch's sampler",
            ", ".join(missing),
        )
        return False
    import dataclasses

    ensure = scheduler_cls._ensure_batch_generator
    create = scheduler_cls._create_batch_generator
    process = scheduler_cls._process_batch_responses

    def rows(self: Any) -> dict:
        found = self.__dict__.get(MARK)
        if found is None:
            found = self.__dict__[MARK] = {"next": None, "rows": {}}
        return found

    def _ensure_batch_generator(self: Any, sampling_params: Any) -> None:
        # The shared sampler is greedy whatever the request: the generator is never rebuilt,
        # nor kept, for one request's values. This request's own sampler goes in with it.
        shared = dataclasses.replace(sampling_params, temperature=0.0, top_p=1.0, min_p=0.0)
        ensure(self, shared)
        rows(self)["next"] = row_sampler(sampling_params)

    def _create_batch_generator(self: Any, sampling_params: Any) -> Any:
        generator = create(self, sampling_params)
        insert = generator.insert
        state = rows(self)

        def insert_with_sampler(prompts: Any, *args: Any, **kwargs: Any) -> Any:
            sampler = state["next"] or greedy
            if kwargs.get("samplers") is None:
                # Every row gets one, greedy too: mlx-lm 0.31's batch filter keeps an all-None
                # sampler list untrimmed, and the next rows would take the wrong entries.
                kwargs["samplers"] = [sampler for _ in prompts]
            uids = insert(prompts, *args, **kwargs)
            state["next"] = None
            live = self.uid_to_request_id
            state["rows"] = {u: s for u, s in state["rows"].items() if u in live}
            if isinstance(sampler, RowSampler):
                state["rows"].update((uid, sampler) for uid in uids)
            return uids

        generator.insert = insert_with_sampler
        return generator

    def _process_batch_responses(self: Any, responses: Any) -> Any:
        state = rows(self)["rows"]
        failed, kept = {}, []
        for response in responses:
            sampler = state.get(response.uid)
            rid = self.uid_to_request_id.get(response.uid)
            if sampler is not None and sampler.error is not None and rid is not None:
                failed[rid] = sampler.error
                del state[response.uid]
            else:
                kept.append(response)
        outputs, finished = process(self, kept)
        for rid, error in failed.items():
            log.warning("[kvsnap] request %s failed alone in its sampler: %s", rid[:12], error)
            self._do_abort_request(rid)
            outputs.append(request_output(request_id=rid, finished=True, finish_reason="error"))
            finished.add(rid)
        return outputs, finished

    scheduler_cls._ensure_batch_generator = _ensure_batch_generator
    scheduler_cls._create_batch_generator = _create_batch_generator
    scheduler_cls._process_batch_responses = _process_batch_responses
    setattr(scheduler_cls, MARK, True)
    return True


def guard_sampling(server: Any) -> None:
    """Install the body checks on ``server.app`` and the row samplers on vllm-mlx's
    ``Scheduler`` (once per process); call before the server starts."""
    if getattr(server, MARK, False):
        return
    import vllm_mlx.scheduler as scheduler
    from vllm_mlx.request import RequestOutput

    server.app.add_middleware(SamplingChecks, api_key=lambda: getattr(server, "_api_key", None))
    own_row_samplers(scheduler.Scheduler, RequestOutput)
    setattr(server, MARK, True)
