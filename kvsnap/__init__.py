"""kvsnap: persistent, shippable warm prefix caches for LLM serving on MLX.

The public Python API is the names in ``__all__`` (docs/api.md); each is imported on first use
(PEP 562), so ``import kvsnap`` loads neither mlx nor a model.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "PromptCache",
    "__version__",
    "export_prompt_cache",
    "import_prompt_cache",
    "load_prompt_cache",
]


def __getattr__(name: str) -> Any:
    # By name, not an import statement: the modules that read __version__ stay below the API.
    if name in __all__:
        return getattr(importlib.import_module("kvsnap.api"), name)
    raise AttributeError(f"module 'kvsnap' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
