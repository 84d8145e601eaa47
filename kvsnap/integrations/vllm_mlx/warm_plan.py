"""The shared warm plan, filling vllm-mlx's ``MemoryAwarePrefixCache``: each warm entry through
vllm-mlx's own ``store`` (which copies the arrays), pinned against its eviction
(``vllm_mlx.pin``); prefixes under its ``min_prefix_tokens`` are skipped, as vllm-mlx would never
reuse them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from kvsnap.integrations.common.warm_plan import WarmPlan, WarmReport

if TYPE_CHECKING:
    from kvsnap.chat import Tokenization
    from kvsnap.integrations.vllm_mlx.pin import Pins
    from kvsnap.prompts import WarmPrompt


@dataclass
class VllmMlxWarmPlan(WarmPlan):
    """``WarmPlan`` into vllm-mlx's prefix cache; ``pins`` is None where it cannot be pinned."""

    route_name = "vllm-mlx"
    build_for = "vllm-mlx"

    pins: Pins | None = None
    # An agent body's entry (``{"anthropic": ...}``, ``{"responses": ...}``) -> its rendering
    # through vllm-mlx's own API for that body (``vllm_mlx.agents``); None: the chat path.
    agent_tokenization: Callable[[WarmPrompt], Tokenization] | None = None

    def _tokenization_for(self, prompt: WarmPrompt) -> Tokenization:
        if prompt.api is not None and self.agent_tokenization is not None:
            return self.agent_tokenization(prompt)
        return self.tokenization

    def _min_prefix_tokens(self) -> int:
        config = getattr(self.prefix_cache, "_config", None)
        return int(getattr(config, "min_prefix_tokens", 1) or 1)

    def _insert(self, name: str, tokens: tuple, state: list, report: WarmReport) -> bool:
        # evict_prefixes=False: never evict another warm entry.
        if not self.prefix_cache.store(list(tokens), state, evict_prefixes=False):
            report.skip(
                name,
                f"vllm-mlx's prefix cache refused it ({len(tokens)} tokens; "
                f"{self.prefix_cache.memory_usage_mb:.1f} of "
                f"{self.prefix_cache.memory_limit_mb:.1f} MiB used): raise --cache-memory-mb",
                len(tokens),
            )
            return False
        if self.pins is not None:
            self.pins.add(tokens)
        return True
