"""Room for a whole prompt in one allocation: mlx-lm's ``KVCache`` and ``QuantizedKVCache`` grow
their buffers ``step`` (256) tokens at a time, and every growth copies the whole cache into a
new buffer, so a prefill of L tokens in chunks copied O(L²) bytes.

``reserved(cache, n)`` sets each growing layer's ``step`` (an instance attribute over the
class's) to the ``n`` tokens about to be prefilled: the layer's next growth makes room for
all of them at once, and none follows. Afterwards the class's step applies again, so decode
grows as mlx-lm has it. The bytes a layer holds are the same: only the padding past its
tokens changes size, and every reader slices to the tokens.

Only what grows with the prompt is touched: ``RotatingKVCache`` is bounded by its window (and
its prefill concatenates, never using ``step``), ``ChunkedKVCache`` by its chunk (mlx-lm trims
its front on every call), ``ArraysCache`` holds a fixed-size state; ``CacheList`` members are
reserved one by one. No mlx import: this only sets attributes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

# mlx-lm cache classes whose buffer grows with every token, by ``step`` tokens at a time
GROWING_CLASSES = ("KVCache", "QuantizedKVCache")


def _growing_layers(cache: Sequence[Any]) -> Iterator[Any]:
    for layer in cache:
        members = getattr(layer, "caches", None)
        if type(layer).__name__ == "CacheList" and members is not None:
            yield from _growing_layers(members)
        elif type(layer).__name__ in GROWING_CLASSES and isinstance(
            getattr(type(layer), "step", None), int
        ):
            yield layer


def reserve(cache: Sequence[Any], n_tokens: int) -> int:
    """Let each growing layer's next growth make room for ``n_tokens`` more tokens at once (never
    less than the class's own step). Returns how many layers were reserved."""
    layers = list(_growing_layers(cache))
    for layer in layers:
        layer.step = max(type(layer).step, n_tokens)
    return len(layers)


def release(cache: Sequence[Any]) -> None:
    """Back to the class's step (mlx-lm's growth) for whatever comes after the prefill."""
    for layer in _growing_layers(cache):
        vars(layer).pop("step", None)


@contextlib.contextmanager
def reserved(cache: Sequence[Any], n_tokens: int) -> Iterator[None]:
    """``reserve`` for the block, ``release`` after it."""
    reserve(cache, n_tokens)
    try:
        yield
    finally:
        release(cache)
