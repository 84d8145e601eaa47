"""A restored snapshot gives the same answers as a fresh prefill, for every cache type."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers.models import LONG_SYSTEM
from mlx_lm.generate import maybe_quantize_kv_cache

from kvsnap.chat import request_tokens, resolve_chat_template
from kvsnap.key import prompt_identity
from kvsnap.prompts import parse_entry, warm_prefix
from kvsnap.runtime.prefill.chunked import prefill, prefill_in_blocks
from kvsnap.snapshot.blocks import BlockSettings, plan_cuts
from kvsnap.snapshot.codec import decode_cache, encode_cache, to_out_tensors
from kvsnap.store.local import Store

CASES = [
    pytest.param("dense", {}, id="dense"),
    pytest.param("hybrid", {}, id="hybrid-ssm"),
    pytest.param("sliding", {}, id="sliding-window"),
    pytest.param("dense", {"kv_bits": 8}, id="kv-bits-8"),
    pytest.param("dense-q4", {}, id="4bit-weights"),
]
N_GEN = 32
# small, so every case composes several blocks (and, on hybrids, checkpoints)
BLOCKS = BlockSettings(64, 128)


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


def _snapshot_roundtrip(lm, entry, tokens, tmp_path, blocks=BLOCKS):
    """Capture, write through the store, read back with mlx: the real path."""
    from kvsnap.build.pipeline import capture_snapshot

    store = Store.open(tmp_path / "store", create=True)
    identity = lm.identity()
    digest = prompt_identity(resolve_chat_template(lm.tokenizer), None, None)
    from kvsnap.runtime.persist.writeback import ChainPlan

    path = capture_snapshot(lm, store, identity, entry, digest, tokens, plan=ChainPlan(blocks))
    assert blocks != BLOCKS or len(store.inspect(path).chain.blocks) > 2
    info = store.verify_file(path, identity)
    arrays = store.load_arrays(info)
    return decode_cache(arrays, info.layers), path


@pytest.mark.parametrize("name,settings", CASES)
def test_restored_snapshot_matches_fresh_prefill(
    demo_models, isolated_cache, tmp_path, name, settings
):
    lm = demo_models.load(name, **settings)
    entry, warm, full = _request(lm)
    if name == "sliding":
        window = lm.config["sliding_window"]
        assert len(warm) > window, "the sliding-window case must overflow the window"
    restored, _ = _snapshot_roundtrip(lm, entry, warm, tmp_path)
    suffix = full[len(warm) :]

    # (a) bitwise against a fresh prefill split at the same boundaries (the blocks' ends)
    fresh = prefill_in_blocks(lm, warm, [c.end for c in plan_cuts(len(warm), set(), BLOCKS)])
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

    # Rewrite the last block with one layer's values perturbed, through the real writer
    # (so the checksum matches), and check the logits move.
    from kvsnap.snapshot.file import read_header
    from kvsnap.store.paths import part_path
    from kvsnap.store.reading import read_part
    from kvsnap.store.writing import put_part

    store = Store(root=(tmp_path / "store").resolve())
    info = store.inspect(path)
    key, start, end = info.chain.blocks[-1]
    block = part_path(store, "block", key)
    _, arrays = read_part(store, "block", key, info.model_digest, start, end)
    arrays = dict(arrays)
    arrays["1.values"] = arrays["1.values"] * 1.5
    metadata = {k: v for k, v in read_header(block).metadata.items() if k != "kvsnap.xxh3_128"}
    with store.lock():
        put_part(store, "block", key, to_out_tensors(arrays), metadata)
    info2 = store.verify_file(path)  # passes: checksum recomputed
    altered = decode_cache(store.load_arrays(info2), info2.layers)
    _, logits_bad = _continue(lm, altered, suffix, n=1)
    assert not mx.allclose(logits_bad[0], logits_ok[0], atol=1e-4).item()


def test_capture_refuses_a_state_with_a_generated_token(demo_models):
    from kvsnap.snapshot.codec import CaptureError

    lm = demo_models.load("hybrid")
    tokens = list(range(5, 25))
    cache = prefill(lm, tokens)
    lm.model(mx.array([[7]]), cache=cache)  # one decode step too many
    with pytest.raises(CaptureError, match="expected exactly 20"):
        encode_cache(cache, tokens)


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _expected_state_bytes(config: dict, settings, n: int) -> int:
    """Bytes of exactly ``n`` tokens of KV (plus SSM state), from the model config alone: no
    encoder, no cache object."""
    layers, heads, head_dim = (
        config["num_hidden_layers"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    act = DTYPE_BYTES[config["torch_dtype"]]
    if settings.kv_bits:
        # Per token and head: packed uint32 codes, then one scale and one bias per group.
        per_vector = (
            head_dim * settings.kv_bits // 8 + 2 * (head_dim // settings.kv_group_size) * act
        )
    else:
        per_vector = head_dim * act
    if config["model_type"] == "qwen3_next":
        attention = layers // config["full_attention_interval"]
        conv_dim = (
            2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
            + config["linear_num_value_heads"] * config["linear_value_head_dim"]
        )
        ssm = (config["linear_conv_kernel_dim"] - 1) * conv_dim + config[
            "linear_num_value_heads"
        ] * config["linear_key_head_dim"] * config["linear_value_head_dim"]
        return attention * 2 * heads * n * per_vector + (layers - attention) * ssm * act
    if config["model_type"] == "gemma3_text":
        # Window layers keep window - 1 + the last chunk (so every token of it sees a full
        # window); the build prefills block by block, so the last chunk is the last block.
        full = layers // config["sliding_window_pattern"]
        last_chunk = n - plan_cuts(n, set(), BlockSettings())[-1].start
        kept = min(n, config["sliding_window"] - 1 + last_chunk)
        return full * 2 * heads * n * per_vector + (layers - full) * 2 * heads * kept * per_vector
    return layers * 2 * heads * n * per_vector


@pytest.mark.parametrize("name,settings", CASES)
def test_snapshot_size_is_exact_kv_bytes(demo_models, isolated_cache, tmp_path, name, settings):
    """Regression (mutation run): the expected size came from the encoder under test, so storing
    the padded buffer passed."""
    import json
    import struct

    lm = demo_models.load(name, **settings)
    entry, warm, _ = _request(lm)
    from kvsnap.store.paths import chain_relpaths

    # the defaults: one checkpoint, at the end
    _, path = _snapshot_roundtrip(lm, entry, warm, tmp_path, BlockSettings())
    info = Store(root=(tmp_path / "store").resolve()).inspect(path)
    data = 0
    # the record, its blocks and checkpoint
    for file in [path, *(tmp_path / "store" / rel for rel in chain_relpaths(info))]:
        raw = file.read_bytes()
        (header_len,) = struct.unpack("<Q", raw[:8])
        tensors = {
            k: v for k, v in json.loads(raw[8 : 8 + header_len]).items() if k != "__metadata__"
        }
        size = sum(end - start for start, end in (t["data_offsets"] for t in tensors.values()))
        assert len(raw) == 8 + header_len + size  # nothing but the header and the tensors
        if file == path:
            assert tensors["tokens"]["shape"] == [len(warm)] and size == 4 * len(warm)
        data += size
    expected = _expected_state_bytes(lm.config, lm.settings, len(warm)) + 4 * len(warm)
    assert data == expected, (
        f"{data} bytes of tensors, {expected} expected ({data / expected:.2f}x)"
    )
