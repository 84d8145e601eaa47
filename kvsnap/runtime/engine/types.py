"""The engine's public types: its configuration, a generation request and a request's live state."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvsnap.key import DigestCache, KVSettings
from kvsnap.prompts import WarmPromptSet
from kvsnap.runtime.persist.options import PersistOptions

EventFn = Callable[["RequestState", str, Any], None]  # (state, "token"|"done"|"error", payload)


@dataclass
class EngineConfig:
    model: str
    settings: KVSettings = field(default_factory=KVSettings)
    warm_prompts: WarmPromptSet | None = None
    warm_prompts_file: str | None = None
    snapshots: str | None = None
    write_back: bool = True
    warm_prompts_concurrency: int = 1
    cache_memory_mb: float = 2048.0
    continuous_batching: bool = True
    max_batch_size: int = 8
    # requests prefilled together (mlx_lm.server's --prompt-concurrency default): fewer,
    # larger groups join the decoding batch fewer times (each join copies the batch's KV)
    prefill_batch_size: int = 8
    digest_cache: DigestCache | None = None
    persist: PersistOptions | None = None  # --persist-requests (None: off)
    # kvsnap serve: the weights are mapped at load and read on the engine thread right after
    # warm, before its first request, so /health does not wait for seconds of reading
    weights_after_warm: bool = False
    # OpenBLAS threads for a batch step that only decodes (None: the cores other processes
    # leave idle; 0: OpenBLAS's own count): step_threads.py says why
    decode_blas_threads: int | None = None


@dataclass
class GenerationRequest:
    tokens: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    namespace: str = ""  # request prefixes are captured and matched only within this scope
    tenant: str = ""  # who sent it, for /v1/status (a key's fingerprint; "" when open)
    capture: bool = True  # keep this prompt's prefix for later requests of the namespace
    # None: no log-probabilities (nothing computed); N: each token's and its N most likely
    top_logprobs: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the ``top`` most likely (id, log-probability)
    pairs at its position, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestState:
    id: int
    request: GenerationRequest
    on_event: EventFn
    cached_tokens: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    text: str = ""
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_done: float | None = None
    cache_source: str = ""
    # matched part of an entry this request's namespace does not own
    cache_shared_partial: bool = False
    # with cache_shared_partial: the best match among its own namespace's entries
    own_cached_tokens: int = 0
    # with cache_shared_partial: the longest whole warm prompt the request contains
    whole_shared_tokens: int = 0
    uid: int | None = None
    detok: Any = None
    capture: bool = False
    # the tokens of each request prefix of its own namespace it extends in full: the entry it
    # hit, and a prompt + reply entry's prompt (persisted conversations: the records for those
    # tokens are superseded by this request's)
    extends: tuple[tuple[int, ...], ...] = ()
    last_token_counted: bool = False
    held_text: str = ""
    # one per generated token, when the request asked for log-probabilities
    logprobs: list[TokenLogprob] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.tokens)


def check_request(r: GenerationRequest) -> None:
    if not r.tokens:
        raise ValueError("the prompt has no tokens")
    if r.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {r.max_tokens}")
