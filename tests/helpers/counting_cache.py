"""mlx-lm's KVCache that counts how often its keys buffer is replaced by one of another size: how
the prefill tests see a cache grown (copied whole) instead of allocated once."""

from __future__ import annotations

from mlx_lm.models import cache as mlx_cache


class KVCache(mlx_cache.KVCache):
    """mlx-lm's KVCache counting its keys buffer's replacements (named as mlx-lm's, so the codec
    stores it as one)."""

    def __init__(self) -> None:
        self.replaced = 0
        super().__init__()

    @property  # type: ignore[override]
    def keys(self):
        return self._keys

    @keys.setter
    def keys(self, value) -> None:
        old = getattr(self, "_keys", None)
        if value is not None and (old is None or old.shape[2] != value.shape[2]):
            self.replaced += 1
        self._keys = value
