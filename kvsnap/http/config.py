"""The HTTP server's settings (``ServerConfig``, ``SamplingDefaults``), apart from the routes:
`kvsnap serve` makes them before the API (fastapi, pydantic) is imported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvsnap.http.guard import Auth


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets (serve --temp, --top-p, --top-k,
    --min-p; mlx_lm.server's defaults)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


# mlx_lm.server's name for the model it serves (its own tests send it): the served one here
DEFAULT_MODEL = "default_model"


@dataclass
class ServerConfig:
    served_model_name: str  # the first --served-model-name: answers name it
    more_model_names: tuple[str, ...] = ()  # the others, listed and served alike
    model_aliases: tuple[str, ...] = ()  # accepted, not listed: the model as given, its folder
    default_max_tokens: int = 256
    context_length: Optional[int] = None
    auth: Auth = Auth()
    max_request_bytes: int = 8 * 2**20
    max_inflight: int = 72  # running + queued requests; more get 429
    request_prefix_cache: bool = True
    # Partial matches on a prefix shared with other clients report cached tokens in these
    # steps, as OpenAI does (128): exact counts would spell out others' prompts token by token.
    cached_tokens_granularity: int = 128
    max_messages: int = 2048  # counted before anything is normalised or rendered
    max_tools: int = 256
    max_preparing: int = 2  # prompts checked, rendered and tokenized at once (worker threads)
    sampling: SamplingDefaults = SamplingDefaults()
    # serve --chat-template-args: template variables a chat request's own kwargs override
    chat_template_args: dict = field(default_factory=dict)
    # serve --reasoning-parser: None leaves think blocks in content
    reasoning_parser: Optional[str] = None
    # serve --allowed-origins: browser origins answered with CORS headers (none: no CORS)
    allowed_origins: tuple[str, ...] = ()

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name GET /v1/models lists, the answers' first."""
        return tuple(dict.fromkeys((self.served_model_name, *self.more_model_names)))
