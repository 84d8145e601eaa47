"""What every tensor of this model's cache state looks like, and the check of a restored state
against it.

A store's blocks are checked against their own headers and keys, but a block's key does not
hash its data: anyone can rewrite a block with another head dim and a fresh checksum. Such a
state decodes fine and only fails inside the model, in a batch step shared with other
requests. So before a restored state is used, each tensor's dtype and shape are compared with
those of the model's own cache after one token (the token axis of per-token tensors aside).
"""

from __future__ import annotations

from typing import Any

from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.snapshot.cache_classes import cache_class, encode_layer, member_path
from kvsnap.snapshot.format import DTYPES, TOKENS

TOKEN_AXIS = -2  # per-token tensors (keys, values, their quantized parts) grow along this axis
Spec = tuple[tuple[int | None, ...], str]  # shape with None on the token axis, dtype name


def _token_axis_names(layers: list[dict], parent: str | None = None) -> set[str]:
    """The tensors of layers that hold one row per token (they carry an offset)."""
    names: set[str] = set()
    for i, meta in enumerate(layers):
        path = str(i) if parent is None else member_path(parent, i)
        spec = cache_class(meta.get("class"))
        if spec.members_field:
            names |= _token_axis_names(spec.members(meta), path)
        elif "offset" in spec.filled_fields:
            names.update(spec.tensor_names(meta, path))
    return names


def named_arrays(cache: list) -> tuple[list[dict], dict]:
    """A cache's layer fields and its arrays by snapshot tensor name (lazy slices, nothing
    computed)."""
    arrays: dict = {}
    layers = [encode_layer(c, str(i), arrays) for i, c in enumerate(cache)]
    return layers, arrays


def _spec(name: str, shape: tuple, dtype: str, per_token: set[str]) -> Spec:
    shape = tuple(shape)
    if name in per_token and len(shape) >= 2:
        shape = shape[:TOKEN_AXIS] + (None,) + shape[TOKEN_AXIS + 1 :]
    return shape, dtype


def _mlx_dtype(array: Any) -> str:
    return str(array.dtype).removeprefix("mlx.core.")


def _show(spec: Spec) -> str:
    shape, dtype = spec
    return f"{dtype}[{', '.join('T' if d is None else str(d) for d in shape)}]"


class ModelShapes:
    """This model's cache tensors, learned once from a one-token forward pass that is built but
    never evaluated (on the engine thread)."""

    def __init__(self, lm: LoadedModel):
        self._lm = lm
        self._expected: dict[str, Spec] | None = None
        self._per_token: set[str] = set()

    def expected(self) -> dict[str, Spec]:
        if self._expected is None:
            self._expected = self._learn()
        return self._expected

    def _learn(self) -> dict[str, Spec]:
        import mlx.core as mx
        from mlx_lm.generate import maybe_quantize_kv_cache

        s = self._lm.settings
        cache = self._lm.make_cache()
        self._lm.model(mx.array([[0]], dtype=mx.int32), cache=cache)
        forms = []
        if s.kv_bits is None or s.quantized_kv_start > 0:
            # below a quantization start above 0 a state is still unquantized (mlx-lm converts it
            # once a longer prompt reaches the start): that form is this model's too
            forms.append(named_arrays(cache))
        if s.kv_bits is not None:  # the names and dtypes of quantized parts
            maybe_quantize_kv_cache(cache, 0, s.kv_group_size, s.kv_bits)
            forms.append(named_arrays(cache))
        # Shapes and dtypes are known from the lazy graph: evaluating it would run the model's first
        # pass (kernel compiles, ~1 s at 0.6B) before warm; the kernel priming runs it after warm.
        self._per_token = set().union(*(_token_axis_names(layers) for layers, _ in forms))
        return {
            name: _spec(name, a.shape, _mlx_dtype(a), self._per_token)
            for _, arrays in forms
            for name, a in arrays.items()
        }

    def problem_in_arrays(self, arrays: dict, where: str = "") -> str | None:
        """Why these named arrays cannot be this model's state, or None."""
        return self._problem({name: (a.shape, _mlx_dtype(a)) for name, a in arrays.items()}, where)

    def problem_in_header(self, tensors: dict, where: str = "") -> str | None:
        """The same check from a file's header entries (``verify --model`` reads no data)."""
        return self._problem(
            {name: (e.shape, DTYPES[e.dtype][0]) for name, e in tensors.items()}, where
        )

    def _problem(self, found: dict[str, tuple], where: str) -> str | None:
        expected = self.expected()
        for name, (shape, dtype) in found.items():
            if name == TOKENS:
                continue
            want = expected.get(name)
            if want is None:
                return (
                    f"{where}tensor {name} is not part of this model's cache (it has "
                    f"{len(expected)} tensors)"
                )
            got = _spec(name, shape, dtype, self._per_token)
            if got != want:
                return (
                    f"{where}tensor {name} is {_show(got)}, this model's cache holds {_show(want)}"
                )
        return None

    def problem_in_layers(self, layers: list) -> str | None:
        """Why a state of these layers (cache objects or a record's layer fields) is not this
        model's: it must hold every layer the model has, not only fit the ones it holds."""
        want = len(self._lm.layout)
        if len(layers) != want:
            return f"holds {len(layers)} layers, this model's cache has {want}"
        return None

    def problem(self, state: Any) -> str | None:
        """Why a restored state (arrays by name, a composed state or a cache list) does not fit, or
        None."""
        from kvsnap.runtime.cache.composed import ComposedState

        if isinstance(state, dict):
            return self.problem_in_arrays(state)
        if isinstance(state, ComposedState):
            parts = [b for _, _, b in state.blocks] + (
                [state.checkpoint] if state.checkpoint is not None else []
            )
            for block in parts:
                why = self.problem_in_arrays(block.arrays, f"part {block.key}: ")
                if why:
                    return why
            return None
        return self.problem_in_layers(state) or self.problem_in_arrays(named_arrays(state)[1])


def token_bound(lm: LoadedModel) -> int | None:
    """Token ids must be below this: the input embedding's rows, or the configured vocab_size
    where smaller; None where neither is known."""
    import mlx.nn as nn

    embeddings = (nn.Embedding, nn.QuantizedEmbedding)
    first = next((m for _, m in lm.model.named_modules() if isinstance(m, embeddings)), None)
    found = [lm.config.get("vocab_size"), None if first is None else int(first.weight.shape[0])]
    bounds = [b for b in found if isinstance(b, int) and not isinstance(b, bool) and b > 0]
    return min(bounds) if bounds else None
