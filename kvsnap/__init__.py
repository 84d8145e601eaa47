"""kvsnap: persistent, shippable warm prefix caches for LLM serving on MLX."""

__version__ = "0.1.0"
