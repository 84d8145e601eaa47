"""hypothesis over the two file readers an attacker can feed: the snapshot header and manifest.json.

Structured strategies build a *valid* snapshot (or manifest) and then break it the way an
attacker would: hostile values in one field (huge counts, wrong types, deep nesting, long
strings), layers nested or multiplied, tensor entries bent, the length prefix and the
bytes cut or flipped; plus plain random bytes. Every example must end in the reader's own
error type (FormatError from the parser, SnapshotError / ManifestError from the store) or
in a valid result, never another exception, and ``tracemalloc``'s peak while reading must
stay under the file's size plus 1 MiB: a count written in a file never decides how much is
allocated. Timings are measured by scripts/measure_header_parse.py, not asserted here.
"""

from __future__ import annotations

import io
import json
import struct
import tempfile
import tracemalloc
from pathlib import Path

import pytest
from helpers.snapshot_meta import fixed_identity, snapshot_metadata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap.errors import ManifestError, SnapshotError
from kvsnap.key import pack_tokens
from kvsnap.snapshot.file import FormatError, OutTensor, parse_header, write_snapshot
from kvsnap.snapshot.header import inspect_header
from kvsnap.store.local import Store
from kvsnap.store.manifest import (
    merge_manifests,
    parse_manifest,
    read_manifest_file,
    referenced_files,
)

EXAMPLES = 1000
SLACK = 1 << 20  # the peak may exceed the file's size by at most this much
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

LAYER_FIELDS = [
    "class",
    "offset",
    "parts",
    "present",
    "size",
    "caches",
    "empty",
    "max_size",
    "keep",
    "idx",
    "group_size",
    "bits",
    "chunk_size",
    "start_position",
]
META_FIELDS = [
    "kvsnap.format",
    "kvsnap.key",
    "kvsnap.name",
    "kvsnap.model",
    "kvsnap.model_digest",
    "kvsnap.prompt_digest",
    "kvsnap.n_tokens",
    "kvsnap.tokens_digest",
    "kvsnap.layers",
    "kvsnap.recorded",
]
HOSTILE_NUMBERS = [10**9, 10**18, 2**63, 2**64 + 1, -1, -(2**63), 0, 1, 4097, 65537]

hostile_scalars = (
    st.integers(-(2**70), 2**70)
    | st.sampled_from(HOSTILE_NUMBERS + [True, False, None, 1.5, float("nan"), float("inf")])
    | st.text(max_size=30)
    | st.sampled_from(
        [
            "KVCache",
            "QuantizedKVCache",
            "ArraysCache",
            "CacheList",
            "RotatingKVCache",
            "ChunkedKVCache",
            "os.system",
            "",
            "9" * 5000,
            "x" * 5000,
        ]
    )
)
hostile_json = st.recursive(
    hostile_scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(LAYER_FIELDS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
nesting = st.integers(1, 3000).map(lambda d: "[" * d + "]" * d)


def _layer(kind: str, i: str, n: int) -> tuple[dict, dict[str, tuple[str, tuple[int, ...]]]]:
    """One layer's metadata and the tensors (name -> dtype, shape) it implies, as snapshot.py
    writes them."""
    kv = {f"{i}.keys": ("F32", (1, 1, n, 2)), f"{i}.values": ("F32", (1, 1, n, 2))}
    if kind == "KVCache":
        return {"class": "KVCache", "offset": n}, kv
    if kind == "RotatingKVCache":
        return {"class": "RotatingKVCache", "offset": n, "max_size": 64, "keep": 0, "idx": n}, kv
    if kind == "QuantizedKVCache":
        parts = {
            f"{i}.{kv_}.{j}": ("U32", (1, 1, n, 1)) for kv_ in ("keys", "values") for j in range(3)
        }
        return {
            "class": "QuantizedKVCache",
            "offset": n,
            "parts": 3,
            "group_size": 64,
            "bits": 8,
        }, parts
    if kind == "ArraysCache":
        return {"class": "ArraysCache", "size": 2, "present": [1]}, {
            f"{i}.state.1": ("F32", (1, 2, 2))
        }
    if kind == "ChunkedKVCache":
        return {"class": "ChunkedKVCache", "offset": n, "start_position": 0, "chunk_size": 64}, kv
    sub, tensors = _layer("KVCache", f"{i}.0", n)
    return {"class": "CacheList", "caches": [sub]}, tensors


@st.composite
def snapshots(draw) -> tuple[str, bytes]:
    """(file name, bytes): a valid snapshot, then zero to three hostile edits."""
    n = draw(st.integers(1, 40))
    tokens = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n))
    kinds = draw(
        st.lists(
            st.sampled_from(
                [
                    "KVCache",
                    "RotatingKVCache",
                    "QuantizedKVCache",
                    "ArraysCache",
                    "ChunkedKVCache",
                    "CacheList",
                ]
            ),
            min_size=1,
            max_size=4,
        )
    )
    layers, specs = [], {"tokens": ("I32", (n,))}
    for i, kind in enumerate(kinds):
        meta, tensors = _layer(kind, str(i), n)
        layers.append(meta)
        specs.update(tensors)
    metadata = snapshot_metadata(fixed_identity(kinds), tokens, "")
    key = metadata["kvsnap.key"]
    edits = draw(
        st.lists(
            st.sampled_from(
                [
                    "layer-field",
                    "layer-replace",
                    "layer-nest",
                    "layer-many",
                    "meta-value",
                    "meta-json",
                    "meta-nest",
                    "meta-drop",
                    "tensor-field",
                    "tensor-many",
                    "prefix",
                    "cut",
                    "flip",
                ]
            ),
            max_size=3,
        )
    )
    for edit in edits:
        if edit == "layer-field":
            target = draw(st.sampled_from(layers))
            if (
                isinstance(target, dict)
                and isinstance(target.get("caches"), list)
                and target["caches"]
                and draw(st.booleans())
            ):
                target = target["caches"][0]
            if isinstance(target, dict):
                target[draw(st.sampled_from(LAYER_FIELDS))] = draw(hostile_json)
        elif edit == "layer-replace":
            layers[draw(st.integers(0, len(layers) - 1))] = draw(hostile_json)
        elif edit == "layer-nest":
            depth = draw(st.integers(1, 50))
            inner = layers[0]
            for _ in range(depth):
                inner = {"class": "CacheList", "caches": [inner]}
            layers[0] = inner
        elif edit == "layer-many":
            layers[:] = [{"class": "KVCache", "empty": True}] * draw(
                st.sampled_from([2, 100, 1500])
            ) + layers
        elif edit == "meta-value":
            metadata[draw(st.sampled_from(META_FIELDS))] = draw(
                st.text(max_size=40)
                | st.sampled_from(["9" * 5000, "2_5", " 7", "٣", "-1", key.upper(), "0" * 32])
            )
        elif edit == "meta-json":
            metadata[
                draw(st.sampled_from(["kvsnap.model", "kvsnap.recorded", "kvsnap.layers"]))
            ] = json.dumps(draw(hostile_json))
        elif edit == "meta-nest":
            metadata[
                draw(st.sampled_from(["kvsnap.model", "kvsnap.recorded", "kvsnap.layers"]))
            ] = draw(nesting)
        elif edit == "meta-drop":
            metadata.pop(draw(st.sampled_from(META_FIELDS)), None)
    if not metadata.get("kvsnap.layers"):
        metadata["kvsnap.layers"] = json.dumps(layers)
    tensors = [
        OutTensor(
            name,
            dtype,
            shape,
            memoryview(pack_tokens(tokens) if name == "tokens" else bytes(4 * _prod(shape))),
        )
        for name, (dtype, shape) in specs.items()
    ]
    buf = io.BytesIO()
    write_snapshot(buf, tensors, metadata)  # a valid checksum: what any attacker can compute
    data = buf.getvalue()
    for edit in edits:  # header edits first, byte edits after: they may leave no header to edit
        if edit in ("tensor-field", "tensor-many"):
            data = _bend_tensors(data, edit, draw)
    for edit in edits:
        if edit == "prefix":
            data = (
                struct.pack(
                    "<Q",
                    draw(
                        st.integers(0, 2**64 - 1)
                        | st.sampled_from(
                            [0, 7, len(data), max(0, len(data) - 8), 16 << 20, (16 << 20) + 1]
                        )
                    ),
                )
                + data[8:]
            )
        elif edit == "cut":
            data = data[: draw(st.integers(0, len(data)))]
        elif edit == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    return f"{key}.safetensors", data


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _bend_tensors(data: bytes, edit: str, draw) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    names = [k for k in header if k != "__metadata__"]
    if edit == "tensor-field":
        entry = header[draw(st.sampled_from(names))]
        entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(
            hostile_json | st.lists(st.integers(0, 2**70), max_size=40)
        )
    else:
        for j in range(draw(st.sampled_from([10, 300, 3000]))):
            header[f"extra.{j}"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def _peak_of(call) -> tuple[object, int]:
    """(result or exception, tracemalloc's peak while ``call`` ran); tracing only then (it slows
    hypothesis 10x)."""
    tracemalloc.start()
    try:
        out = call()
    except Exception as exc:  # collected and checked by the caller against the allowed types
        out = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out, peak


@pytest.fixture(scope="module")
def fuzz_dir():
    with tempfile.TemporaryDirectory(prefix="kvsnap-fuzz-") as d:
        (Path(d) / "snapshots").mkdir()
        yield Path(d)


def _check_snapshot(root: Path, name: str, data: bytes) -> None:
    path = root / "snapshots" / name
    path.write_bytes(data)
    store = Store(root=root, readonly=True)

    def parse_and_inspect():
        return inspect_header(path, parse_header(io.BytesIO(data), len(data)))

    out, peak = _peak_of(parse_and_inspect)
    assert out is None or not isinstance(out, Exception) or isinstance(out, FormatError), repr(out)
    assert peak <= len(data) + SLACK, (peak, len(data))
    for call in (lambda: store.inspect(path), lambda: store.verify_file(path)):
        out, peak = _peak_of(call)
        assert not isinstance(out, Exception) or isinstance(out, SnapshotError), repr(out)
        assert peak <= len(data) + SLACK, (peak, len(data))


@pytest.mark.slow
@FUZZ
@given(case=snapshots())
def test_hostile_snapshot_headers_end_in_kvsnap_errors_within_bounded_memory(fuzz_dir, case):
    name, data = case
    _check_snapshot(fuzz_dir, name, data)


@pytest.mark.slow
@FUZZ
@given(
    data=st.binary(max_size=2048)
    | st.binary(min_size=8, max_size=512).map(lambda b: struct.pack("<Q", len(b)) + b)
)
def test_random_bytes_as_a_snapshot_end_in_kvsnap_errors(fuzz_dir, data):
    _check_snapshot(fuzz_dir, "0" * 32 + ".safetensors", data)


def test_the_fuzzed_base_snapshot_is_valid(fuzz_dir):
    """The strategies start from files the reader accepts: otherwise every example fails at the
    first check."""
    found = []

    @settings(max_examples=30, deadline=None)
    @given(case=snapshots())
    def collect(case):
        name, data = case
        path = fuzz_dir / "snapshots" / name
        path.write_bytes(data)
        try:
            Store(root=fuzz_dir, readonly=True).verify_file(path)
            found.append(name)
        except SnapshotError:
            pass

    collect()
    assert found, "no valid snapshot among the examples"


# --- manifest.json ---------------------------------------------------------------------------

HEX = st.text("0123456789abcdef", min_size=32, max_size=32)
good_entry = st.fixed_dictionaries(
    {"file": HEX.map(lambda k: f"snapshots/{k}.safetensors")},
    optional={
        "name": st.text(min_size=1, max_size=20),
        "key": HEX,
        "n_tokens": st.integers(0, 10**6) | st.none(),
        "coverage": st.floats(0, 1) | st.none(),
        "prompt_digest": HEX,
    },
)
good_record = st.fixed_dictionaries(
    {},
    optional={
        "entries": st.lists(good_entry, max_size=4),
        "model_digest": HEX,
        "model_path": st.text(min_size=1, max_size=30),
        "updated": st.just("2026-11-30T10:00:00Z"),
        "kv_settings": st.dictionaries(
            st.sampled_from(["kv_bits", "kv_group_size"]), st.integers(0, 64) | st.none()
        ),
    },
)
good_manifest = st.fixed_dictionaries(
    {"records": st.dictionaries(st.text(min_size=1, max_size=16), good_record, max_size=4)},
    optional={"format": st.integers(1, 3)},
)
MANIFEST_FIELDS = [
    "records",
    "entries",
    "file",
    "name",
    "key",
    "n_tokens",
    "coverage",
    "kv_settings",
    "format",
    "model_path",
    "updated",
]
manifest_json = st.recursive(
    hostile_scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(MANIFEST_FIELDS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def _set_anywhere(doc: object, draw) -> object:
    """Replace one value somewhere in ``doc`` (or ``doc`` itself) with a hostile one."""
    if not isinstance(doc, (dict, list)) or not doc or draw(st.integers(0, 3)) == 0:
        return draw(
            manifest_json
            | st.integers(1, 500).map(lambda d: json.loads("[" * d + "]" * d))
            | st.sampled_from(["../../etc/passwd", "snapshots/x.safetensors", "x" * 5000])
        )
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    k = draw(st.sampled_from(keys))
    doc[k] = _set_anywhere(doc[k], draw)
    return doc


@st.composite
def manifests(draw) -> bytes:
    doc = draw(good_manifest)
    for _ in range(draw(st.integers(0, 3))):
        doc = _set_anywhere(doc, draw)
    text = json.dumps(doc, allow_nan=True).encode()
    how = draw(st.sampled_from(["as-is", "as-is", "as-is", "cut", "bad-utf8", "deep", "long-int"]))
    if how == "cut":
        text = text[: draw(st.integers(0, len(text)))]
    elif how == "bad-utf8":
        text = text.replace(b'"', b'"\xff', 1)
    elif how == "deep":
        depth = draw(st.integers(100, 100_000))
        text = b'{"records": {}, "x": ' + b"[" * depth + b"]" * depth + b"}"
    elif how == "long-int":
        text = text.replace(b"{", b'{"format": ' + b"9" * 5000 + b", ", 1)
    return text


def _check_manifest(root: Path, data: bytes) -> None:
    out, peak = _peak_of(lambda: parse_manifest(data, "fuzz/manifest.json"))
    assert not isinstance(out, Exception) or isinstance(out, ManifestError), repr(out)
    assert peak <= len(data) + SLACK, (peak, len(data))
    if not isinstance(out, Exception):  # a manifest the reader accepts works everywhere it is used
        files = referenced_files(out)
        assert all(f.startswith("snapshots/") and f.endswith(".safetensors") for f in files)
        assert (
            merge_manifests(out, out) == out
            and referenced_files(merge_manifests({"records": {}}, out)) == files
        )
    path = root / "manifest.json"
    path.write_bytes(data)
    again, peak = _peak_of(lambda: read_manifest_file(path))
    assert type(again) is type(out) and (isinstance(out, Exception) or again == out)
    assert peak <= len(data) + SLACK, (peak, len(data))
    gc, _ = _peak_of(lambda: Store(root=root).referenced())
    assert not isinstance(gc, Exception) or isinstance(gc, ManifestError), repr(gc)


@pytest.mark.slow
@FUZZ
@given(data=manifests())
def test_hostile_manifests_end_in_manifest_errors_within_bounded_memory(fuzz_dir, data):
    _check_manifest(fuzz_dir, data)


@pytest.mark.slow
@FUZZ
@given(data=st.binary(max_size=1024))
def test_random_bytes_as_a_manifest_end_in_manifest_errors(fuzz_dir, data):
    _check_manifest(fuzz_dir, data)
