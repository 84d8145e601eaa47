"""import_prompt_cache of forged or foreign mlx-lm prompt-cache files (issue 39): a cache missing
a layer, bad token ids, non-finite KV, a file naming no model or made by a copy of the model with
another tokenizer, and a file for a key the store already holds with other content. Each is
refused by a SnapshotError or UsageError naming what is wrong, and a good snapshot already in the
store is never replaced."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.stores import AGENTS

import kvsnap
from kvsnap.errors import SnapshotError, UsageError
from kvsnap.store.local import Store


@pytest.fixture(scope="module")
def dense(demo_models):
    lm = demo_models.load("dense")
    return demo_models.path("dense"), lm, (lm.model, lm.tokenizer)


@pytest.fixture(scope="module")
def exported(dense, built, tmp_path_factory) -> Path:
    """AGENTS[0]'s snapshot exported with its model, template and tokens recorded."""
    path, _, loaded = dense
    file = tmp_path_factory.mktemp("exported") / "reviewer.safetensors"
    kvsnap.export_prompt_cache(built, path, AGENTS[0]["messages"], file, loaded=loaded)
    return file


def _rewrite(src: Path, dest: Path, layers=None, metadata=None, arrays=None) -> Path:
    """``src`` saved again as ``dest`` with mlx-lm's own writer: ``layers`` maps the cache list,
    ``metadata`` the metadata dict and ``arrays`` each layer's (keys, values)."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    cache, meta = load_prompt_cache(str(src), return_metadata=True)
    if arrays is not None:
        for c in cache:
            c.keys, c.values = arrays(c.keys, c.values)
    save_prompt_cache(
        str(dest), layers(cache) if layers else cache, metadata(dict(meta)) if metadata else meta
    )
    return dest


def _state(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*") if p.is_file()}


def _verified(store: Path) -> None:
    s = Store.open(store)
    for p in s.snapshot_files():
        s.verify_file(p)


def test_a_cache_missing_a_layer_is_refused_and_the_good_snapshot_is_kept(
    dense, built, exported, tmp_path
):
    """3 of the model's 4 layers: mlx-lm would generate with it (the missing layer's attention
    is simply not cached), answering differently from the model."""
    path, lm, loaded = dense
    assert len(lm.make_cache()) == 4
    forged = _rewrite(exported, tmp_path / "forged.safetensors", layers=lambda c: c[:3])
    with pytest.raises(SnapshotError, match="holds 3 layers, this model's cache has 4"):
        kvsnap.import_prompt_cache(forged, tmp_path / "fresh", path, loaded=loaded)
    assert not list((tmp_path / "fresh").rglob("*.safetensors"))

    store = tmp_path / "snaps"
    shutil.copytree(built, store)
    before = _state(store)
    with pytest.raises(SnapshotError, match="holds 3 layers"):
        kvsnap.import_prompt_cache(forged, store, path, loaded=loaded)
    assert _state(store) == before
    _verified(store)


def test_an_import_never_replaces_a_snapshot_that_verifies_with_other_content(
    dense, built, exported, tmp_path
):
    path, lm, loaded = dense
    store = tmp_path / "snaps"
    shutil.copytree(built, store)
    before = _state(store)
    # every layer, finite, right shapes: only the content tells it from the build's
    doubled = _rewrite(
        exported, tmp_path / "doubled.safetensors", arrays=lambda k, v: (k * 2, v * 2)
    )
    with pytest.raises(SnapshotError, match="already holds .* other content") as caught:
        kvsnap.import_prompt_cache(doubled, store, path, loaded=loaded)
    assert caught.value.fix and "kept" in str(caught.value)
    assert _state(store) == before
    _verified(store)

    # The same content imports as a no-op, under the build's key.
    (record,) = [i for i in Store.open(store).scan()[0] if i.name == AGENTS[0]["name"]]
    assert kvsnap.import_prompt_cache(exported, store, path, loaded=loaded) == record.key
    assert _state(store) == before


def test_a_damaged_snapshot_under_the_key_is_replaced_by_a_good_import(
    dense, built, exported, tmp_path
):
    from helpers.stores import flip_byte

    path, _, loaded = dense
    store = tmp_path / "snaps"
    shutil.copytree(built, store)
    (record,) = [i for i in Store.open(store).scan()[0] if i.name == AGENTS[0]["name"]]
    blocks = sorted((store / "blocks").rglob("*.safetensors"))
    for b in blocks:
        flip_byte(b, b.stat().st_size - 3)
    assert kvsnap.import_prompt_cache(exported, store, path, loaded=loaded) == record.key
    _, cached = kvsnap.load_prompt_cache(store, path, AGENTS[0]["messages"], loaded=loaded)
    assert len(cached) == record.n_tokens


@pytest.mark.parametrize(
    "bad, shown",
    [
        (-1, "-1"),
        (1.5, "1.5"),
        (True, "True"),
        ("vocab", "outside this model"),
        (10**12, str(10**12)),
    ],
)
@pytest.mark.parametrize("where", ["tokens", "kvsnap_tokens"])
def test_bad_token_ids_are_refused_naming_the_field(dense, exported, tmp_path, bad, shown, where):
    """Each is refused before anything is written: -1 and ids past the vocabulary index outside
    the embedding, 1.5 and true are not ids, 10**12 does not fit the int32 tokens tensor."""
    from mlx_lm.models.cache import load_prompt_cache

    path, lm, loaded = dense
    _, meta = load_prompt_cache(str(exported), return_metadata=True)
    ids = json.loads(meta["kvsnap_tokens"])
    bad = lm.model.args.vocab_size if bad == "vocab" else bad
    ids[len(ids) // 2] = bad
    store = tmp_path / "snaps"
    with pytest.raises(SnapshotError) as caught:
        if where == "tokens":
            kvsnap.import_prompt_cache(exported, store, path, tokens=ids, loaded=loaded)
        else:
            file = _rewrite(
                exported,
                tmp_path / "ids.safetensors",
                metadata=lambda m: {**m, "kvsnap_tokens": json.dumps(ids)},
            )
            kvsnap.import_prompt_cache(file, store, path, loaded=loaded)
    message = str(caught.value)
    assert where in message and shown in message, message
    assert not list(store.rglob("*.safetensors"))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_kv_is_refused_naming_the_tensor(dense, exported, tmp_path, value):
    import mlx.core as mx

    path, _, loaded = dense
    file = _rewrite(
        exported,
        tmp_path / "nan.safetensors",
        arrays=lambda k, v: (k, mx.full(v.shape, value, dtype=v.dtype)),
    )
    store = tmp_path / "snaps"
    with pytest.raises(SnapshotError, match=r"tensor 0\.values holds .*(NaN|infinite)"):
        kvsnap.import_prompt_cache(file, store, path, loaded=loaded)
    assert not list(store.rglob("*.safetensors"))


def test_a_file_naming_no_model_is_refused(dense, exported, tmp_path):
    """save_prompt_cache without metadata: nothing says which model made it."""
    path, _, loaded = dense
    bare = _rewrite(
        exported,
        tmp_path / "bare.safetensors",
        metadata=lambda m: {k: v for k, v in m.items() if k != "model"},
    )
    store = tmp_path / "snaps"
    with pytest.raises(UsageError, match="names no model in its metadata"):
        kvsnap.import_prompt_cache(bare, store, path, loaded=loaded)
    assert not list(store.rglob("*.safetensors"))


def test_a_file_from_a_copy_of_the_model_with_another_tokenizer_is_refused(
    dense, exported, tmp_path
):
    """Same weights and config, another tokenizer: the same ids are other text."""
    path, _, loaded = dense
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    file = _rewrite(
        exported, tmp_path / "copy.safetensors", metadata=lambda m: {**m, "model": str(copy)}
    )
    store = tmp_path / "snaps"
    with pytest.raises(UsageError, match="was made for model") as caught:
        kvsnap.import_prompt_cache(file, store, path, loaded=loaded)
    assert str(copy) in str(caught.value)
    assert not list(store.rglob("*.safetensors"))

    # the same files (tokenizer included) are the same model
    same = tmp_path / "same"
    shutil.copytree(path, same)
    file = _rewrite(
        exported, tmp_path / "same.safetensors", metadata=lambda m: {**m, "model": str(same)}
    )
    assert kvsnap.import_prompt_cache(file, store, path, loaded=loaded)
