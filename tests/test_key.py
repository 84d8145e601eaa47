"""Snapshot identity: every input that changes the KV bytes changes the key; float noise does
not."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvsnap.chat import resolve_chat_template
from kvsnap.key import (
    DIGEST_CHUNK,
    DigestCache,
    KVSettings,
    hash_file,
    model_identity,
    prompt_identity,
    snapshot_key,
)
from kvsnap.prompts import parse_entry, warm_prefix

SYSTEM = [{"role": "system", "content": "You are a planner. Plan each step."}]


def _key(
    model_dir,
    settings=KVSettings(),
    layout=("KVCache",) * 4,
    tokens=(1, 2, 3),
    template_digest="t",
    digests=None,
):
    identity = model_identity(model_dir, "float32", layout, settings, digests or DigestCache())
    return snapshot_key(identity, template_digest, tokens)


@pytest.fixture()
def model_copy(demo_models, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(demo_models.path("dense"), dst)
    return dst


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipping_a_weight_byte_changes_the_key(model_copy):
    before = _key(model_copy)
    weights = model_copy / "model.safetensors"
    _flip_byte(weights, weights.stat().st_size - 7)
    assert _key(model_copy) != before


def test_a_weight_byte_past_the_first_digest_chunk_changes_the_key(model_copy):
    """Regression (mutation run): hashing only the first chunk of each weight file kept the old key.

    The demo weights (3.5 MB) fit in one default 8 MiB chunk, so the chunk is shrunk here.
    """
    chunk = 4096
    weights = model_copy / "model.safetensors"
    assert weights.stat().st_size > 3 * chunk
    before = _key(model_copy, digests=DigestCache(chunk_size=chunk))
    _flip_byte(weights, 2 * chunk + 17)
    after = _key(model_copy, digests=DigestCache(chunk_size=chunk))
    assert after != before, "a weight byte past the first chunk did not change the key"
    assert after == _key(model_copy), "the read size must not change the key"


def test_a_byte_past_the_default_digest_chunk_changes_the_file_digest(tmp_path):
    """The default read size too: a weight file longer than DIGEST_CHUNK, changed only past it."""
    weights = tmp_path / "model-00001-of-00002.safetensors"
    weights.write_bytes(bytes(DIGEST_CHUNK + 4096))
    before = hash_file(weights)
    _flip_byte(weights, DIGEST_CHUNK + 100)
    assert hash_file(weights) != before


def test_file_digests_do_not_depend_on_the_read_size(tmp_path):
    """Golden value: keys of existing stores stay the same whatever chunk size reads the weights."""
    blob = tmp_path / "blob"
    blob.write_bytes(bytes(range(256)) * 4099)
    assert {hash_file(blob, size) for size in (1000, 4096, 65537, DIGEST_CHUNK)} == {
        "3eb413071bb36356ebd7da7da24295f8"
    }
    with pytest.raises(ValueError, match="chunk_size must be a positive number of bytes, got 0"):
        hash_file(blob, 0)


def test_flipping_a_tokenizer_byte_changes_the_key(model_copy):
    before = _key(model_copy)
    tok = model_copy / "tokenizer.json"
    text = tok.read_text()
    tok.write_text(text.replace('"<|im_end|>"', '"<|im_eNd|>"', 1))
    assert _key(model_copy) != before


def test_editing_the_template_changes_the_key_through_the_tokens_and_the_template_digest(
    model_copy,
):
    from kvsnap.runtime.model.loading import load_model

    def key_of(path):
        lm = load_model(path)
        entry = parse_entry(SYSTEM, 0)
        tokens = warm_prefix(lm.tokenizer, entry).tokens
        digest = prompt_identity(resolve_chat_template(lm.tokenizer), None, None)
        return digest, _key(path, tokens=tokens, template_digest=digest)

    digest_before, before = key_of(model_copy)
    cfg_path = model_copy / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("<|im_start|>", "<|im_start|> ", 1)
    cfg_path.write_text(json.dumps(cfg))
    digest_after, after = key_of(model_copy)
    assert digest_after != digest_before and after != before


def test_config_kv_settings_layout_and_tokens_are_keyed(model_copy):
    base = _key(model_copy)
    assert _key(model_copy, settings=KVSettings(kv_bits=8)) != base
    assert _key(model_copy, settings=KVSettings(kv_bits=4, kv_group_size=32)) != _key(
        model_copy, settings=KVSettings(kv_bits=8, kv_group_size=32)
    )
    assert _key(model_copy, settings=KVSettings(kv_bits=8, kv_group_size=32)) != _key(
        model_copy, settings=KVSettings(kv_bits=8)
    )
    assert _key(model_copy, settings=KVSettings(kv_bits=8, quantized_kv_start=100)) != _key(
        model_copy, settings=KVSettings(kv_bits=8)
    )
    assert _key(model_copy, settings=KVSettings(max_kv_size=128)) != base
    assert _key(model_copy, layout=("KVCache", "RotatingKVCache") * 2) != base
    assert _key(model_copy, tokens=(1, 2, 4)) != base
    assert _key(model_copy, template_digest="u") != base
    cfg = model_copy / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert _key(model_copy) != base


def test_recorded_only_fields_do_not_change_the_key(model_copy):
    base = _key(model_copy)
    assert _key(model_copy, settings=KVSettings(prefill_step_size=128)) == base
    # Without KV quantization, group size and start do not matter.
    assert _key(model_copy, settings=KVSettings(kv_group_size=32, quantized_kv_start=9)) == base


def test_weight_digest_is_cached_by_inode_size_and_mtime(model_copy, tmp_path):
    cache = DigestCache(tmp_path / "digests.json")

    def identity(c):
        return model_identity(model_copy, "float32", ("KVCache",), KVSettings(), c)

    first = identity(cache)
    assert cache.misses == 1 and cache.hits == 0
    # A new process reads the cache file and does not re-hash.
    again = DigestCache(tmp_path / "digests.json")
    assert identity(again) == first and again.hits == 1 and again.misses == 0
    # Same size, new bytes, new mtime: re-hashed, new digest.
    weights = model_copy / "model.safetensors"
    _flip_byte(weights, weights.stat().st_size - 3)
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    third = DigestCache(tmp_path / "digests.json")
    assert identity(third).weights != first.weights and third.misses == 1


def test_tokens_digest_is_stable_across_implementations():
    """Golden value: a faster packing must not change any existing snapshot's key."""
    from kvsnap.key import pack_tokens, tokens_digest, unpack_tokens

    tokens = [1, -5, 70000, 2**31 - 1]
    assert tokens_digest(tokens) == "1c9788522fb1a72c87a3613666e3d4f1"
    assert unpack_tokens(pack_tokens(tokens)) == tokens


def test_the_key_formula_is_one_function_of_digests():
    """``snapshot_key`` (the writer) and ``key_from_digests`` (what a reader recomputes from a
    header) are one formula,
    and the codec version in it is format.py's."""
    from kvsnap.key import (
        ModelIdentity,
        key_from_digests,
        pack_tokens,
        tokens_digest,
        tokens_digest_of_bytes,
    )
    from kvsnap.snapshot import format as fmt

    identity = ModelIdentity(
        "a" * 32,
        "b" * 32,
        "c" * 32,
        "{}",
        "float32",
        None,
        None,
        None,
        None,
        ("KVCache",),
        mlx_lm_minor="0.32",
    )
    tokens = [5, -1, 2**31 - 1]
    assert identity.codec_version == fmt.CODEC_FORMAT_VERSION
    assert tokens_digest_of_bytes(pack_tokens(tokens)) == tokens_digest(tokens)
    assert key_from_digests(identity.digest, "p" * 32, tokens_digest(tokens), 3) == snapshot_key(
        identity, "p" * 32, tokens
    )
    assert key_from_digests(identity.digest, "p" * 32, tokens_digest(tokens), 4) != snapshot_key(
        identity, "p" * 32, tokens
    )


def test_the_cache_folder_is_kvsnap_cache_dir_then_xdg_cache_home_then_home(monkeypatch, tmp_path):
    from kvsnap.key import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("KVSNAP_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "kvsnap"
    # the XDG spec: a relative path in XDG_CACHE_HOME is invalid and ignored
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kvsnap"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kvsnap"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kvsnap"


def test_an_identitys_digest_is_computed_once_and_follows_its_fields(monkeypatch):
    """Issue 41 item 5: a start with 1,000 agents asked each identity for its digest ~5 times
    per agent, each time a deep copy of every field and a canonical JSON (0.2 ms of each
    agent's CPU). It is computed once per identity; a replaced field gives a new digest."""
    import dataclasses

    import kvsnap.key as key

    identity = key.ModelIdentity(
        "a" * 32, "b" * 32, "c" * 32, "{}", "float32", None, None, None, None, ("KVCache",) * 28
    )
    calls = []
    real = key.canonical_json
    monkeypatch.setattr(key, "canonical_json", lambda d: calls.append(1) or real(d))
    first = identity.digest
    assert all(identity.digest == first for _ in range(5))
    assert len(calls) == 1
    other = dataclasses.replace(identity, kv_bits=4, kv_group_size=32)
    assert other.digest != first and len(calls) == 2
    assert dataclasses.replace(other, kv_bits=None, kv_group_size=None).digest == first
