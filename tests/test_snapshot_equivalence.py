"""A restored snapshot gives the same answers as a fresh prefill, for every cache type."""

from __future__ import annotations

import pytest

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache

from conftest import LONG_SYSTEM
from kvsnap.build import prefill
from kvsnap.key import prompt_identity
from kvsnap.prompts import parse_entry, request_tokens, resolve_chat_template, warm_prefix
from kvsnap.snapshot import decode_cache, encode_cache, to_out_tensors
from kvsnap.store import Store

CASES = [
    pytest.param("dense", {}, id="dense"),
    pytest.param("hybrid", {}, id="hybrid-ssm"),
    pytest.param("sliding", {}, id="sliding-window"),
    pytest.param("dense", {"kv_bits": 8}, id="kv-bits-8"),
    pytest.param("dense-q4", {}, id="4bit-weights"),
]
N_GEN = 32


def _continue(lm, cache, suffix, n=N_GEN):
    """Feed ``suffix`` then decode greedily; return (tokens, list of logits)."""
    s = lm.settings
    logits = lm.model(mx.array(suffix, dtype=mx.int32)[None], cache=cache)[:, -1, :]
    maybe_quantize_kv_cache(cache, s.quantized_kv_start, s.kv_group_size, s.kv_bits)
    tokens, all_logits = [], []
    for _ in range(n):
        all_logits.append(logits)
        tok = mx.argmax(logits, axis=-1)
        tokens.append(tok.item())
        logits = lm.model(tok[None], cache=cache)[:, -1, :]
        maybe_quantize_kv_cache(cache, s.quantized_kv_start, s.kv_group_size, s.kv_bits)
    return tokens, all_logits


def _request(lm, system=LONG_SYSTEM, user="Please check the server function and explain the fix."):
    entry = parse_entry([{"role": "system", "content": system}], 0)
    prefix = warm_prefix(lm.tokenizer, entry)
    full = request_tokens(lm.tokenizer, list(entry.messages) + [{"role": "user", "content": user}])
    assert tuple(full[: len(prefix.tokens)]) == prefix.tokens and len(full) > len(prefix.tokens)
    return entry, list(prefix.tokens), full


def _snapshot_roundtrip(lm, entry, tokens, tmp_path):
    """Capture, write through the store, read back with mlx: the real path."""
    from kvsnap.build import capture_snapshot

    store = Store.open(tmp_path / "store", create=True)
    identity = lm.identity()
    digest = prompt_identity(resolve_chat_template(lm.tokenizer), None, None)
    path = capture_snapshot(lm, store, identity, entry, digest, tokens)
    info = store.verify_file(path, identity)
    arrays = store.load_arrays(info)
    return decode_cache(arrays, info.layers), path


@pytest.mark.parametrize("name,settings", CASES)
def test_restored_snapshot_matches_fresh_prefill(demo_models, isolated_cache, tmp_path, name, settings):
    lm = demo_models.load(name, **settings)
    entry, warm, full = _request(lm)
    if name == "sliding":
        window = lm.config["sliding_window"]
        assert len(warm) > window, "the sliding-window case must overflow the window"
    restored, _ = _snapshot_roundtrip(lm, entry, warm, tmp_path)
    suffix = full[len(warm) :]

    # (a) bitwise against a fresh prefill split at the same boundary
    fresh = prefill(lm, warm)
    tok_fresh, logits_fresh = _continue(lm, fresh, suffix)
    tok_restored, logits_restored = _continue(lm, restored, suffix)
    assert tok_restored == tok_fresh
    for a, b in zip(logits_restored, logits_fresh):
        assert mx.array_equal(a, b).item()

    # (b) against a one-shot prefill of the whole request: same greedy tokens, close logits
    one_shot = lm.make_cache()
    tok_one, logits_one = _continue(lm, one_shot, full)
    assert tok_restored == tok_one
    if settings.get("kv_bits"):
        # 8-bit KV: the split request attends to quantized warm keys, the one-shot one
        # to full-precision keys within its chunk, so allow quantization noise.
        tol = 0.02 * mx.abs(logits_one[0]).max().item()
    else:
        tol = 1e-3 if name == "dense-q4" else 1e-4
    assert mx.allclose(logits_restored[0], logits_one[0], atol=tol, rtol=1e-4).item()


def test_altered_kv_with_recomputed_checksum_changes_logits(demo_models, isolated_cache, tmp_path):
    """Negative control: the equality above really looks at the restored state."""
    lm = demo_models.load("dense")
    entry, warm, full = _request(lm)
    restored, path = _snapshot_roundtrip(lm, entry, warm, tmp_path)
    suffix = full[len(warm) :]
    tok_ok, logits_ok = _continue(lm, restored, suffix, n=1)

    # Rewrite the file with one layer's values perturbed, through the real writer
    # (so the checksum matches), and check the logits move.
    store = Store(root=(tmp_path / "store").resolve())
    info = store.inspect(path)
    arrays = store.load_arrays(info)
    arrays["1.values"] = arrays["1.values"] * 1.5
    from kvsnap.snapfile import read_header

    metadata = {k: v for k, v in read_header(path).metadata.items() if k != "kvsnap.data_xxh3_128"}
    with store.lock():
        store.put(info.key, to_out_tensors(arrays), metadata)
    info2 = store.verify_file(path)  # passes: checksum recomputed
    altered = decode_cache(store.load_arrays(info2), info2.layers)
    _, logits_bad = _continue(lm, altered, suffix, n=1)
    assert not mx.allclose(logits_bad[0], logits_ok[0], atol=1e-4).item()


def test_capture_refuses_a_state_with_a_generated_token(demo_models):
    from kvsnap.snapshot import CaptureError

    lm = demo_models.load("hybrid")
    tokens = list(range(5, 25))
    cache = prefill(lm, tokens)
    lm.model(mx.array([[7]]), cache=cache)  # one decode step too many
    with pytest.raises(CaptureError, match="expected exactly 20"):
        encode_cache(cache, tokens)


@pytest.mark.parametrize("name,settings", CASES)
def test_snapshot_size_is_exact_kv_bytes(demo_models, isolated_cache, tmp_path, name, settings):
    lm = demo_models.load(name, **settings)
    entry, warm, _ = _request(lm)
    cache = prefill(lm, warm)
    arrays, _ = encode_cache(cache, warm)
    exact = sum(a.nbytes for a in arrays.values())  # KV sliced to the token count + tokens tensor
    _, path = _snapshot_roundtrip(lm, entry, warm, tmp_path)
    assert exact <= path.stat().st_size <= exact * 1.01 + 4096
