"""The write path shared by build and the running server: a captured warm state -> key, tensors,
header -> an atomic put in the store plus its manifest record."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvsnap import __version__
from kvsnap.chat import resolve_chat_template
from kvsnap.key import (
    KVSettings,
    ModelIdentity,
    canonical_json,
    package_version,
    snapshot_key,
    tokens_digest,
)
from kvsnap.prompts import WarmPrompt
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.snapshot.blocks import (
    QUANTIZED_FORM,
    BlockSettings,
    chain_field,
    chain_of,
    checkpoint_key,
    kv_form,
    kv_form_at,
    plan_cuts,
    prefix_digests,
    without_checkpoint,
)
from kvsnap.snapshot.cache_classes import needs_checkpoints
from kvsnap.snapshot.format import CHECKPOINT_KIND, TOKENS, header_metadata, snapshot_relpath
from kvsnap.store.checking import bad_present_parts
from kvsnap.store.local import Store
from kvsnap.store.manifest import record_id, utc_now
from kvsnap.store.paths import has_part
from kvsnap.store.writing import Written, write_chain
from kvsnap.warm_key import warm_recipe

# mlx (here and through ``snapshot.codec``) is imported where it is used: ``kvsnap build``
# imports this module before its arguments are checked, and its usage errors need no mlx.


def recorded_fields(settings: KVSettings, tokenization: dict | None = None) -> dict:
    """Recorded, not keyed (the key has its own copy of the tokenization profile, here as canonical
    JSON text:
    recorded values are scalars)."""
    import mlx.core as mx

    extra = {"tokenization": canonical_json(tokenization)} if tokenization is not None else {}
    return {
        **extra,
        "prefill_step_size": settings.prefill_step_size,
        "backend": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "mlx": package_version("mlx"),
        "mlx_lm": package_version("mlx-lm"),
        "kvsnap": __version__,
        "created": utc_now(),
    }


def recipe_fields(
    lm: LoadedModel, identity: ModelIdentity, prompt: WarmPrompt, prompt_digest: str
) -> dict:
    """The warm recipe a later start can match to reuse these tokens without re-tokenizing
    (recorded, not keyed)."""
    recipe = warm_recipe(
        prompt, prompt_digest, identity.tokenizer, resolve_chat_template(lm.tokenizer, prompt.tools)
    )
    return {"warm_recipe": recipe} if recipe else {}


def snapshot_metadata(
    identity: ModelIdentity,
    prompt: WarmPrompt,
    prompt_digest: str,
    key: str,
    tokens: Sequence[int],
    layers: list,
    recorded: dict,
    chain: dict | None = None,
) -> dict[str, str]:
    """The header of one warm prompt's record (its fields are ``format.header_metadata``'s)."""
    return header_metadata(
        key=key,
        name=prompt.name,
        model=identity.as_dict(),
        model_digest=identity.digest,
        prompt_digest=prompt_digest,
        n_tokens=len(tokens),
        tokens_digest=tokens_digest(tokens),
        layers=layers,
        recorded=recorded,
        chain=chain,
    )


@dataclass
class ChainPlan:
    """How one warm prefix is cut into blocks, and what a write stored (filled by
    ``put_snapshot``)."""

    settings: BlockSettings = field(default_factory=BlockSettings)
    # depths where another warm prefix of this model leaves this one
    branches: frozenset = frozenset()
    # branch points cut at too (the build's choice: siblings share the block head they leave)
    splits: frozenset = frozenset()
    # end -> (arrays, layers) captured there (hybrids)
    checkpoints: dict = field(default_factory=dict)
    written: Written = field(default_factory=Written)
    # keys of parts to rewrite though present (bad ones); None: all (--force)
    replace: set | None = field(default_factory=set)
    # ends whose checkpoint the store already has (a build restored past them)
    stored: set = field(default_factory=set)
    # check the stored parts the chain names before naming them (the server's write-back: no
    # restore read them, and a bad one is rewritten rather than named again)
    check_stored: bool = False

    def keep_stored(self, store: Store, identity: ModelIdentity, tokens: Sequence[int]) -> None:
        """Forget stored checkpoints that are no longer in the store (the caller holds the lock)."""
        ends = sorted(self.stored)
        digests = prefix_digests(tokens, ends)
        form = kv_form_at(len(tokens), identity)
        self.stored = {
            e
            for e, d in zip(ends, digests)
            if has_part(store, CHECKPOINT_KIND, checkpoint_key(identity.digest, d, form))
        }

    def links(
        self,
        identity: ModelIdentity,
        tokens: Sequence[int],
        hybrid: bool,
        captured_only: bool = True,
        form: str | None = None,
    ) -> list:
        """The chain. ``captured_only``: a planned checkpoint whose state was not captured is left
        out (the server's write-back captures only the end). ``form``: the captured state's KV
        form; None, before the prefill, the one a prefill of ``tokens`` ends in."""
        form = kv_form_at(len(tokens), identity) if form is None else form
        links = chain_of(
            identity.digest,
            tokens,
            plan_cuts(len(tokens), set(self.branches), self.settings, self.splits),
            hybrid,
            form,
        )
        if form == QUANTIZED_FORM:
            # A state below the quantization start is unquantized: it is no checkpoint of a
            # quantized chain (restoring one there would differ from a fresh prefill anyway).
            start = identity.quantized_kv_start or 0
            links = [
                without_checkpoint(link) if link.checkpoint_key and link.end < start else link
                for link in links
            ]
        if not captured_only:
            return links
        keep = set(self.checkpoints) | self.stored | {len(tokens)}
        return [
            link if link.checkpoint_key is None or link.end in keep else without_checkpoint(link)
            for link in links
        ]


def snapshot_payload(
    lm: LoadedModel,
    identity: ModelIdentity,
    prompt: WarmPrompt,
    prompt_digest: str,
    tokens: Sequence[int],
    cache: list,
    tokenization: dict | None,
    plan: ChainPlan,
) -> tuple:
    """(key, arrays, layers, links, record tensors, record header) of a captured warm state."""
    from kvsnap.snapshot.codec import encode_cache, to_out_tensors

    key = snapshot_key(identity, prompt_digest, tokens)
    arrays, layers = encode_cache(cache, tokens)
    links = plan.links(identity, tokens, needs_checkpoints(layers), form=kv_form(layers, identity))
    recorded = (
        recorded_fields(lm.settings, tokenization)
        | lm.origin_fields()
        | recipe_fields(lm, identity, prompt, prompt_digest)
    )
    metadata = snapshot_metadata(
        identity,
        prompt,
        prompt_digest,
        key,
        tokens,
        layers,
        recorded,
        chain_field(links, plan.settings),
    )
    return key, arrays, layers, links, to_out_tensors({TOKENS: arrays[TOKENS]}), metadata


def profile_record_id(model_digest: str, agents_file: str, tokenization: dict | None) -> str:
    """One manifest record per (model, agents file, server profile); kvsnap's own keeps its old
    id."""
    if tokenization is None:
        return record_id(model_digest, agents_file)
    return record_id(f"{model_digest}|{tokenization['server']}", agents_file)


def manifest_entry(
    name: str,
    key: str,
    n_tokens: int,
    coverage: float | None,
    prompt_digest: str,
    tokenization: dict | None = None,
) -> dict:
    """One manifest entry: the snapshot a warm prompt has, by its store-relative path."""
    extra = {"tokenization": tokenization} if tokenization is not None else {}
    return {
        "name": name,
        "key": key,
        "file": snapshot_relpath(key),
        "n_tokens": n_tokens,
        "coverage": coverage,
        "prompt_digest": prompt_digest,
        **extra,
    }


def record_upsert(
    lm: LoadedModel, identity: ModelIdentity, agents_file: str, entry: dict
) -> Callable[[dict], dict]:
    """A manifest update that puts ``entry`` into this (model, agents file) record."""

    def apply(record: dict) -> dict:
        entries = [e for e in record.get("entries", []) if e.get("name") != entry["name"]]
        s = lm.settings
        return {
            "model_digest": identity.digest,
            "model_path": str(lm.path),
            "agents_file": str(Path(agents_file).resolve()),
            "kv_settings": {
                "kv_bits": s.kv_bits,
                "kv_group_size": s.kv_group_size,
                "quantized_kv_start": s.quantized_kv_start,
                "max_kv_size": s.max_kv_size,
            },
            "updated": utc_now(),
            "entries": sorted(entries + [entry], key=lambda e: e["name"]),
        }

    return apply


def put_snapshot(
    lm: LoadedModel,
    store: Store,
    identity: ModelIdentity,
    prompt: WarmPrompt,
    prompt_digest: str,
    tokens: Sequence[int],
    cache: list,
    tokenization: dict | None = None,
    on_commit: Callable[[Path], None] | None = None,
    plan: ChainPlan | None = None,
) -> Path:
    """Encode a captured state, write the blocks and checkpoints the store lacks, then the record.

    Under the store lock: the record lands after every part it names, and ``on_commit(path)``
    runs right after it, so a manifest record written there is in place before a concurrent
    ``gc`` can look. ``plan.written`` counts what was new."""
    plan = plan or ChainPlan()
    with store.lock():
        # What a restore found may be gone (a gc between it and this lock): the chain names
        # only checkpoints still stored or captured, decided where no gc can run.
        plan.keep_stored(store, identity, tokens)
        key, arrays, layers, links, record_tensors, metadata = snapshot_payload(
            lm, identity, prompt, prompt_digest, tokens, cache, tokenization, plan
        )
        if plan.check_stored and plan.replace is not None:
            plan.replace = plan.replace | bad_present_parts(store, identity.digest, links)
        plan.written = write_chain(
            store,
            identity.digest,
            links,
            arrays,
            layers,
            plan.checkpoints,
            dense=not needs_checkpoints(layers),
            replace=plan.replace,
        )
        path = store.put(key, record_tensors, metadata)
        if on_commit is not None:
            on_commit(path)
        return path


def commit_snapshot(
    lm: LoadedModel,
    store: Store,
    identity: ModelIdentity,
    prompt: WarmPrompt,
    prompt_digest: str,
    tokens: Sequence[int],
    cache: list,
    agents_file: str,
    tokenization: dict | None = None,
) -> Path:
    """Write an already-prefilled warm state back to the store (the server's write-back), with its
    manifest record."""

    def record(path: Path) -> None:
        entry = manifest_entry(
            prompt.name, path.stem, len(tokens), None, prompt_digest, tokenization
        )
        store.update_record(
            profile_record_id(identity.digest, agents_file, tokenization),
            record_upsert(lm, identity, agents_file, entry),
        )

    return put_snapshot(
        lm,
        store,
        identity,
        prompt,
        prompt_digest,
        tokens,
        cache,
        tokenization,
        on_commit=record,
        plan=ChainPlan(check_stored=True),
    )
