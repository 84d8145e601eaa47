"""kvsnap's Python API: a store's snapshot as an mlx-lm prompt cache, and mlx-lm's prompt-cache
files (``mlx_lm.cache_prompt``, ``save_prompt_cache``) out of and into a store.

The public names are listed in ``kvsnap/__init__.py``; see docs/api.md. A snapshot is found
as the servers find it: the warm prefix and key come from ``warm_key`` (kvsnap serve's
profile, then mlx_lm.server's), else any snapshot of this model holding exactly those tokens
(its KV depends only on the model and the tokens). Every read goes through the store's checks
and the model's cache shapes (``checked_state``), so another model's or a forged file is
refused, never served.
"""

from __future__ import annotations

import json
import numbers
import os
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from kvsnap.blas import preload_openblas

preload_openblas()  # must precede the first mlx import, or mlx keeps its slow reference BLAS

from mlx_lm.models.cache import load_prompt_cache as mlx_load_prompt_cache  # noqa: E402
from mlx_lm.models.cache import save_prompt_cache  # noqa: E402

from kvsnap.chat import resolve_chat_template  # noqa: E402
from kvsnap.errors import KvsnapError, SnapshotError, UsageError  # noqa: E402
from kvsnap.integrations.common.warm_plan import checked_state, upstream_model  # noqa: E402
from kvsnap.key import ModelIdentity, tokenizer_digest, weights_digest  # noqa: E402
from kvsnap.profiles import mlx_lm_tokenization  # noqa: E402
from kvsnap.prompts import WarmPrompt, parse_entry  # noqa: E402
from kvsnap.runtime.cache.shapes import ModelShapes, named_arrays, token_bound  # noqa: E402
from kvsnap.runtime.model.loading import (  # noqa: E402
    LoadedModel,
    default_digest_cache,
    load_model,
    resolve_model,
)
from kvsnap.runtime.persist.writeback import commit_snapshot  # noqa: E402
from kvsnap.runtime.warmup.prefetch import context_tokens  # noqa: E402
from kvsnap.snapshot.cache_classes import CaptureError  # noqa: E402
from kvsnap.snapshot.codec import check_captured_at, copy_cache  # noqa: E402
from kvsnap.store.foreign import foreign_reason  # noqa: E402
from kvsnap.store.local import SnapshotInfo, Store  # noqa: E402
from kvsnap.warm_key import given_tokens_key, warm_key  # noqa: E402

# mlx-lm's metadata keys (cache_prompt writes model and tokenizer_config; older ones the
# template too); the token ids are kvsnap's addition, so an export imports back by itself.
TOKENS_FIELD = "kvsnap_tokens"
# A snapshot's tokens tensor is int32: no id reaches this, whatever the vocabulary.
INT32_IDS = 2**31
# How far an imported state may differ from the one a store holds under its key and still be
# the same state: the float noise of another prefill chunking, never another state.
SAME_STATE_TOLERANCE = 1e-2


class PromptCache(NamedTuple):
    """An mlx-lm prompt cache (the caller's own copy) and the token ids it holds."""

    cache: list
    tokens: tuple[int, ...]


def load_prompt_cache(
    store: str | os.PathLike,
    model: str | os.PathLike,
    messages: Sequence[dict] | dict,
    tools: Sequence[dict] | None = None,
    *,
    chat_template_kwargs: dict | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> PromptCache:
    """The snapshot ``kvsnap serve`` would use for requests starting with ``messages``, as an
    mlx-lm prompt cache for ``mlx_lm.generate(..., prompt_cache=cache)``; feed it the request's
    tokens after ``len(tokens)``. ``messages`` may also be a warm-prompt entry (an object with
    ``messages``, ``tools``, ``chat_template_kwargs``). ``loaded``: what ``mlx_lm.load(model)``
    returned, so the model is not loaded twice."""
    lm = _model(model, loaded)
    found = _find(_open(store), lm, _entry(messages, tools, chat_template_kwargs))
    return PromptCache(copy_cache(found.cache), found.tokens)


def export_prompt_cache(
    store: str | os.PathLike,
    model: str | os.PathLike,
    messages: Sequence[dict] | dict,
    path: str | os.PathLike,
    tools: Sequence[dict] | None = None,
    *,
    chat_template_kwargs: dict | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> PromptCache:
    """``load_prompt_cache``'s snapshot written with mlx-lm's ``save_prompt_cache`` to ``path``
    (a ``.safetensors`` file ``mlx_lm.models.cache.load_prompt_cache`` and ``mlx_lm.generate
    --prompt-cache-file`` read), with cache_prompt's metadata: ``model``, ``chat_template``,
    ``tokenizer_config``, and the token ids as ``kvsnap_tokens``."""
    lm = _model(model, loaded)
    prompt = _entry(messages, tools, chat_template_kwargs)
    found = _find(_open(store), lm, prompt)
    metadata = {
        "model": os.fspath(model),
        "chat_template": resolve_chat_template(lm.tokenizer, prompt.tools),
        "tokenizer_config": json.dumps({"trust_remote_code": False}),
        TOKENS_FIELD: json.dumps(list(found.tokens)),
    }
    save_prompt_cache(os.fspath(path), found.cache, metadata)
    return found


def import_prompt_cache(
    path: str | os.PathLike,
    store: str | os.PathLike,
    model: str | os.PathLike,
    *,
    prompt: str | None = None,
    tokens: Sequence[int] | None = None,
    name: str | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> str:
    """A prompt cache made by ``mlx_lm.cache_prompt`` (or ``save_prompt_cache``) stored in
    ``store`` (created if missing) as a snapshot keyed as kvsnap keys one; returns its key.

    Its tokens: ``tokens``, else ``prompt`` (the ``--prompt`` given to cache_prompt, rendered
    as it renders it), else the ``kvsnap_tokens`` an export recorded. The file's model must be
    ``model`` (same folder or same files) and its cache must hold exactly those tokens in this
    model's shapes; otherwise a UsageError or SnapshotError names both."""
    file = Path(path)
    try:
        cache, metadata = mlx_load_prompt_cache(os.fspath(file), return_metadata=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise SnapshotError(
            str(file),
            f"is not a prompt cache mlx-lm can load ({type(exc).__name__}: {exc})",
            "give a file made by `mlx_lm.cache_prompt` or `save_prompt_cache`",
        ) from None
    lm = _model(model, loaded)
    _require_same_model(file, metadata.get("model"), model, lm)
    ids = _imported_tokens(file, metadata, lm, prompt, tokens)
    shapes = ModelShapes(lm)
    why = shapes.problem(cache) or _non_finite(cache)
    if why:
        raise SnapshotError(str(file), why, f"import it with the model it was made by, not {model}")
    try:
        check_captured_at(cache, len(ids))
    except CaptureError as exc:
        raise SnapshotError(
            str(file),
            f"does not hold the {len(ids)} tokens given ({exc})",
            "pass the same --prompt (or tokens) cache_prompt was given",
        ) from None
    identity = lm.identity(default_digest_cache())
    entry = WarmPrompt(
        index=0,
        name=name or file.stem,
        messages=({"role": "user", "content": prompt},) if prompt is not None else (),
    )
    keyed = given_tokens_key(lm.tokenizer, identity, entry, ids)
    target = Store.open(store, create=True)
    if not _already_held(target, keyed.key, identity, shapes, cache, file):
        commit_snapshot(lm, target, identity, entry, keyed.prompt_digest, ids, cache, str(file))
    return keyed.key


def _non_finite(cache: list) -> str | None:
    """The first floating tensor holding NaN or infinity: mlx-lm would attend over it."""
    import mlx.core as mx

    for name, a in named_arrays(cache)[1].items():
        if mx.issubdtype(a.dtype, mx.floating) and not mx.all(mx.isfinite(a)).item():
            return f"tensor {name} holds NaN or infinite values"
    return None


def _already_held(
    store: Store, key: str, identity: ModelIdentity, shapes: ModelShapes, cache: list, file: Path
) -> bool:
    """Whether ``store`` already holds ``cache`` under ``key``. An import never replaces a record
    that verifies: other content under its key is a SnapshotError; a damaged one is replaced."""
    path = store.path_for(key)
    if not path.is_file():
        return False
    try:
        held = checked_state(store, store.inspect(path), identity, shapes)
    except SnapshotError:
        return False
    if _same_state(named_arrays(held)[1], named_arrays(cache)[1]):
        return True
    raise SnapshotError(
        str(file),
        f"the store already holds key {key} ({path}), which verifies, with other content than "
        "this file's; the store's is kept",
        "delete that record and run `kvsnap gc --yes` first if this file is the one to keep",
    )


def _same_state(held: dict, given: dict) -> bool:
    import mlx.core as mx

    if held.keys() != given.keys():
        return False
    for name, a in held.items():
        b = given[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if mx.issubdtype(a.dtype, mx.floating):
            a, b, tol = a.astype(mx.float32), b.astype(mx.float32), SAME_STATE_TOLERANCE
            if not mx.allclose(a, b, rtol=tol, atol=tol).item():
                return False
        elif not mx.array_equal(a, b).item():
            return False
    return True


def _open(store: str | os.PathLike) -> Store:
    return Store.open(store, readonly=True).require_store()


def _model(model: str | os.PathLike, loaded: tuple[Any, Any] | None) -> LoadedModel:
    if loaded is None:
        return load_model(model)
    return upstream_model(os.fspath(model), loaded[0], loaded[1])


def _entry(
    messages: Sequence[dict] | dict, tools: Sequence[dict] | None, kwargs: dict | None
) -> WarmPrompt:
    """The messages as a warm-prompt entry, checked as a warm-prompt file's are."""
    if isinstance(messages, dict):
        if tools is not None or kwargs is not None:
            raise UsageError("give tools and chat_template_kwargs inside the entry, not beside it")
        return parse_entry(messages, 0)
    raw = {"messages": list(messages), "tools": list(tools) if tools is not None else None}
    return parse_entry({**raw, "chat_template_kwargs": kwargs}, 0)


def _find(store: Store, lm: LoadedModel, prompt: WarmPrompt) -> PromptCache:
    """The snapshot the servers would pick for ``prompt``, read and checked (not yet copied)."""
    identity = lm.identity(default_digest_cache())
    infos, _bad = store.scan(identity, max_tokens=context_tokens(lm.path))
    by_key = {info.key: info for info in infos}
    keys = [warm_key(lm.tokenizer, identity, prompt, t) for t in (None, mlx_lm_tokenization())]
    tokens = keys[0].tokens
    info = next((by_key[k.key] for k in keys if k.key in by_key), None)
    if info is None:
        info = next((i for i in infos if _holds(store, i, tokens)), None)
    if info is None:
        raise _missing(store, identity, prompt, tokens, keys[0].key, lm)
    state = checked_state(store, info, identity, ModelShapes(lm))
    return PromptCache(state, tuple(store.read_tokens(info)))


def _holds(store: Store, info: SnapshotInfo, tokens: tuple[int, ...]) -> bool:
    try:
        return info.n_tokens == len(tokens) and tuple(store.read_tokens(info)) == tokens
    except SnapshotError:
        return False


def _missing(
    store: Store,
    identity: ModelIdentity,
    prompt: WarmPrompt,
    tokens: tuple[int, ...],
    key: str,
    lm: LoadedModel,
) -> SnapshotError:
    """Why no snapshot serves ``prompt``: another model's, a stale one of this entry, or none."""
    everything, _bad = store.scan(None)
    for info in everything:
        reason = foreign_reason(identity, info)
        if reason and info.n_tokens == len(tokens) and tuple(info.tokens) == tokens:
            return SnapshotError(
                str(info.path),
                f"holds these messages' {len(tokens)} tokens but was {reason}",
                f"build it for {lm.path} with `kvsnap build`",
            )
    # only an entry named by the caller can have snapshots of its own
    named = prompt.name != f"agent-{prompt.index}"
    stale = [i for i in everything if i.name == prompt.name and not foreign_reason(identity, i)]
    if named and stale:
        return SnapshotError(
            str(stale[0].path),
            f"is stale: built for warm prompt {prompt.name!r} from other messages, tools, "
            "template or kwargs than these",
            f"rebuild it with `kvsnap build AGENTS --model {lm.path} --out {store.root}`",
        )
    return SnapshotError(
        str(store.root),
        f"holds no snapshot of {lm.path} for these messages (key {key}, {len(tokens)} tokens)",
        f"build one with `kvsnap build AGENTS --model {lm.path} --out {store.root}`",
    )


def _require_same_model(
    file: Path, recorded: str | None, model: str | os.PathLike, lm: LoadedModel
) -> None:
    """The model a prompt-cache file names must be ``model``: the same folder or the same
    weights, config and tokenizer files."""
    if recorded is None:
        raise UsageError(
            f"{file} names no model in its metadata (mlx_lm.cache_prompt records one); it cannot "
            f"be checked against {model}"
        )
    if recorded == os.fspath(model):
        return
    try:
        other = resolve_model(recorded).path
    except KvsnapError as exc:
        raise UsageError(
            f"{file} was made for model {recorded!r}, not {os.fspath(model)!r} ({exc}); import "
            "it with the model it was made by"
        ) from None
    if other.resolve() == lm.path.resolve() or _same_files(other, lm.path):
        return
    raise UsageError(
        f"{file} was made for model {recorded!r} ({other}), not {os.fspath(model)!r} "
        f"({lm.path}); import it with the model it was made by"
    )


def _same_files(a: Path, b: Path) -> bool:
    digests = default_digest_cache()
    return (
        weights_digest(a, digests) == weights_digest(b, digests)
        and tokenizer_digest(a) == tokenizer_digest(b)
        and (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    )


def _imported_tokens(
    file: Path,
    metadata: dict,
    lm: LoadedModel,
    prompt: str | None,
    tokens: Sequence[int] | None,
) -> list[int]:
    bound = min(token_bound(lm) or INT32_IDS, INT32_IDS)
    if tokens is not None:
        return _checked_ids(file, "tokens", tokens, bound)
    if prompt is not None:
        # What mlx_lm.cache_prompt does with its --prompt.
        tokenizer = lm.tokenizer
        if getattr(tokenizer, "has_chat_template", False):
            messages = [{"role": "user", "content": prompt}]
            return list(
                tokenizer.apply_chat_template(
                    messages, add_generation_prompt=False, continue_final_message=True
                )
            )
        return list(tokenizer.encode(prompt))
    if TOKENS_FIELD in metadata:
        try:
            recorded = json.loads(metadata[TOKENS_FIELD])
        except ValueError:
            recorded = None
        return _checked_ids(file, TOKENS_FIELD, recorded, bound)
    raise UsageError(
        f"{file} does not record its tokens; pass prompt= (the --prompt given to "
        "mlx_lm.cache_prompt) or tokens="
    )


def _checked_ids(file: Path, field: str, ids: Any, bound: int) -> list[int]:
    """``ids`` when each is a token id of this model; else a SnapshotError naming the field and
    the first bad value (a bool or a float is no id; an id past the embedding reads garbage)."""
    fix = f"give the token ids the cache was made from, each in [0, {bound})"
    if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Sequence):
        raise SnapshotError(str(file), f"its {field} is not a list of token ids", fix)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise SnapshotError(str(file), f"its {field}[{i}] is {t!r}, not a token id", fix)
        if not 0 <= int(t) < bound:
            raise SnapshotError(
                str(file),
                f"its {field}[{i}] is {int(t)}, outside this model's vocabulary [0, {bound})",
                fix,
            )
    return [int(t) for t in ids]
