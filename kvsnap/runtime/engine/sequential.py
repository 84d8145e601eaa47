"""One request at a time, for a quantized KV (mlx-lm's batch caches cannot hold one) or with
continuous batching off: the same chunked prefill and quantization schedule as ``build``,
then a plain decode loop. Runs on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache

from kvsnap.runtime.engine.accounting import TokenAccounts
from kvsnap.runtime.engine.request_output import deliver_token, finish_request
from kvsnap.runtime.engine.sampling import make_request_sampler, token_logprob
from kvsnap.runtime.engine.step_threads import StepThreads
from kvsnap.runtime.engine.types import RequestState
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.prefill.chunked import run_chunk
from kvsnap.runtime.prefill.reserve import reserved


@dataclass
class SequentialRun:
    lm: LoadedModel
    state: RequestState
    cache: list
    accounts: TokenAccounts
    eos: set[int]
    poll: Callable[[], bool]  # serve the engine's commands; True once the engine is stopping
    capture: Callable[[list], None]  # keep the prompt's prefix (all but its last token)
    # at a normal finish, keep prompt + reply: (the cache, the tokens it holds past the cached
    # head: the suffix and every generated token but the last, which is never fed)
    keep_reply: Callable[[list, list[int]], None] | None = None
    threads: StepThreads | None = None  # OpenBLAS's count: every thread to prefill, fewer to decode

    def run(self, suffix: list[int]) -> None:
        body, last = list(suffix[:-1]), suffix[-1]
        if not self._prefill(body):
            return
        if body:
            self.state.capture = True
            self.capture(self.cache)
        generated = self._decode(last)
        if self.keep_reply is not None and self.state.finish_reason in ("stop", "length"):
            self.keep_reply(self.cache, [*suffix, *generated[:-1]])

    def _ended(self) -> bool:
        """Let a cancel (or a disconnect, or a stop) end this request between two model calls."""
        if self.poll() and self.state.finish_reason is None:
            finish_request(self.state, "cancelled")
        return self.state.finish_reason is not None

    def _prefill(self, body: list[int]) -> bool:
        """Run all but the last prompt token in chunks; False if the request ended meanwhile.

        Room for the whole prompt (the last token too) is made at once, as ``build`` does."""
        step = self.lm.settings.prefill_step_size
        if self.threads is not None:
            self.threads.before_step(decoding_only=False)
        with reserved(self.cache, len(body) + 1):
            for start in range(0, len(body), step):
                chunk = body[start : start + step]
                run_chunk(self.lm, self.cache, chunk)
                self.accounts.ran(len(chunk))
                if self._ended():
                    return False
        return True

    def _decode(self, last: int) -> list[int]:
        """Decode from the last prompt token; returns the tokens generated."""
        s, r = self.lm.settings, self.state.request
        generated: list[int] = []
        sampler = make_request_sampler(r.temperature, r.top_p, r.seed, r.top_k, r.min_p)
        token = mx.array([[last]], dtype=mx.int32)
        for i in range(r.max_tokens):
            if self.threads is not None:
                self.threads.before_step(decoding_only=True)
            logits = self.lm.model(token, cache=self.cache)[:, -1, :]
            if i == 0:
                self.accounts.ran(1)  # the last prompt token
            maybe_quantize_kv_cache(self.cache, s.quantized_kv_start, s.kv_group_size, s.kv_bits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nxt = sampler(logprobs)
            # mlx's stub types item() as any Python scalar, complex included; a token is an int
            tok = int(nxt.item())  # type: ignore[arg-type]
            generated.append(tok)
            reason = "stop" if tok in self.eos else ("length" if i + 1 >= r.max_tokens else None)
            n = r.top_logprobs
            lp = None if n is None else token_logprob(logprobs[0], tok, n)
            deliver_token(self.state, tok, reason, lp)
            if self.state.finish_reason is not None or self._ended():
                break
            token = nxt.reshape(1, 1)
        return generated
