"""One owner for every file fact: kvsnap/snapshot/format.py.

Bumping a version there changes, together, what the writer puts in a header, what the reader
accepts, the key and the OCI media types; the store path ``snapshots/<key>.safetensors`` is
spelled nowhere else; the header bytes stay what they were before the owner existed.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from helpers.snapshot_meta import fixed_identity

from kvsnap.errors import SnapshotError, StoreError
from kvsnap.key import ModelIdentity, snapshot_key, tokens_digest
from kvsnap.snapshot import format as fmt
from kvsnap.snapshot.blocks import BlockSettings, chain_field, chain_of, plan_cuts
from kvsnap.snapshot.file import OutTensor, write_snapshot
from kvsnap.store.foreign import foreign_reason
from kvsnap.store.local import Store

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvsnap"
IDENTITY = fixed_identity(("KVCache", "ArraysCache"), "bfloat16", max_kv_size=4096)
TOKENS = [1, 2, 3, 70000, -5]
LAYERS = [{"class": "KVCache", "offset": 5}, {"class": "ArraysCache", "size": 2, "present": [1]}]
RECORDED = {"created": "2026-11-30T00:00:00Z", "backend": "cpu", "prefill_step_size": 512}


def _metadata(
    identity: ModelIdentity = IDENTITY, tokens: list[int] = TOKENS, chain: dict | None = None
) -> dict[str, str]:
    key = snapshot_key(identity, "d" * 32, tokens)
    layers = [{**LAYERS[0], "offset": len(tokens)}, LAYERS[1]]
    return fmt.header_metadata(
        key=key,
        name="reviewer ü",
        model=identity.as_dict(),
        model_digest=identity.digest,
        prompt_digest="d" * 32,
        n_tokens=len(tokens),
        tokens_digest=tokens_digest(tokens),
        layers=layers,
        recorded=RECORDED,
        chain=chain,
    )


def _tensors(tokens: list[int] = TOKENS) -> list[OutTensor]:
    n = len(tokens)
    return [
        OutTensor("tokens", "I32", (n,), memoryview(struct.pack(f"<{n}i", *tokens))),
        OutTensor("0.keys", "BF16", (1, 1, n, 2), memoryview(bytes(range(4 * n)))),
        OutTensor("0.values", "BF16", (1, 1, n, 2), memoryview(bytes(range(4 * n, 8 * n)))),
        OutTensor("1.state.1", "F32", (1, 2), memoryview(bytes(8))),
    ]


# --- the bytes did not move --------------------------------------------------------------------


def test_header_fields_key_and_file_bytes_equal_what_the_code_before_the_owner_wrote():
    """Values taken from kvsnap at db19354 (writeback.snapshot_metadata + snapfile.write_snapshot)
    for these inputs."""
    meta = _metadata()
    assert meta["kvsnap.key"] == "97739ae25852c0c3331e9c8445709189"
    assert IDENTITY.digest == "05e5e36e8e2e0c345072cb1806662e5e"
    assert meta["kvsnap.tokens_digest"] == "03d7279b28d80d10faf051b7c63ddd8b"
    assert list(meta) == list(fmt.REQUIRED_META[:2]) + ["kvsnap.name"] + list(
        fmt.REQUIRED_META[2:]
    ) + ["kvsnap.recorded"]
    assert meta["kvsnap.model"].startswith('{"codec_version": 1, "config": "bbbb')
    assert (
        meta["kvsnap.layers"]
        == '[{"class": "KVCache", "offset": 5}, {"class": "ArraysCache", "size": 2, "present": '
        "[1]}]"
    )
    assert (
        meta["kvsnap.recorded"]
        == '{"backend": "cpu", "created": "2026-11-30T00:00:00Z", "prefill_step_size": 512}'
    )
    f = io.BytesIO()
    assert write_snapshot(f, _tensors(), meta) == "e622054d3bc3f8d25464216040be5dae"
    assert xxhash.xxh3_128_hexdigest(f.getvalue()) == "538eff7f753a261178b1b1eac961fb3a"


def test_header_fields_are_the_schema():
    assert set(_metadata()) == set(fmt.REQUIRED_META) | set(fmt.OPTIONAL_META)
    assert set(fmt.HEADER_FIELDS) == set(fmt.REQUIRED_META) | set(fmt.OPTIONAL_META) | {
        fmt.CHAIN
    } | set(fmt.PART_META) | {
        "kvsnap.layers",
        fmt.KV_FORM,
        fmt.ROW_DIGESTS,
        fmt.TENANT,
        fmt.CHECKSUM_KEY,
    }
    part = fmt.part_metadata(
        kind=fmt.CHECKPOINT_KIND,
        key="a" * 32,
        model_digest="b" * 32,
        start=0,
        end=4,
        prefix_digest="c" * 32,
        layers=[],
    )
    assert set(part) == set(fmt.PART_META) | {"kvsnap.layers"}


def test_every_header_field_the_package_names_is_in_the_schema():
    """A ``"kvsnap.<field>"`` string anywhere in the package is one format.py declares (catches a
    typo'd or private field)."""
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(
            re.findall(r"""(?<!getLogger\()["'](kvsnap\.[a-z_0-9]+)["']""", path.read_text())
        )  # logger names are not fields
    modules = {
        f"kvsnap.{p.relative_to(PACKAGE).with_suffix('').as_posix().replace('/', '.')}"
        for p in PACKAGE.rglob("*.py")
    }
    fields = {
        n
        for n in named
        if n not in modules and n.rsplit(".", 1)[0] not in modules and n not in {"kvsnap.__main__"}
    }
    assert fields - set(fmt.HEADER_FIELDS) == set()


# --- one spelling of the store path -------------------------------------------------------------


# A string that builds a snapshot's name or path: the folder, key or suffix interpolated.
BUILT_PATH = re.compile(r"snapshots/\{|\{SNAPSHOTS\}/\{|\}\.safetensors|\{SUFFIX\}")
# ... or joined as a bare literal: root / "snapshots", key + ".safetensors"
PATH_PARTS = {"snapshots", ".safetensors"}


def _path_spellings(source: str) -> list[tuple[int, str]]:
    """(line, code) of every place ``source`` spells a snapshot path itself; docstrings and
    messages that
    only describe it ("STORE/snapshots/<key>.safetensors") are not spellings."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) or (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            if BUILT_PATH.search(ast.get_source_segment(source, node) or ""):
                found.append((node.lineno, ast.get_source_segment(source, node)))
        joined = (
            [node.left, node.right]
            if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Add))
            else []
        )
        joined += (
            node.args
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join"
            else []
        )
        if any(isinstance(part, ast.Constant) and part.value in PATH_PARTS for part in joined):
            found.append((node.lineno, ast.get_source_segment(source, node)))
    return sorted(set(found))  # an f-string's parts can report its line again


def test_the_snapshot_path_is_spelled_only_by_the_owner():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != PACKAGE / "snapshot" / "format.py":
            found += [
                f"{path.relative_to(ROOT)}:{line}: {code[:80]}"
                for line, code in _path_spellings(path.read_text())
            ]
    assert found == [], (
        "build store paths with kvsnap.snapshot.format (snapshot_relpath, relpath_of_file, "
        "SNAPSHOTS) or Store.snapshots_dir"
    )


def test_the_path_check_finds_a_planted_spelling():
    for planted in (
        'f"snapshots/{key}.safetensors"',
        'root / "snapshots"',
        'f"{SNAPSHOTS}/{name}"',
        'key + ".safetensors"',
        'os.path.join(root, "snapshots")',
    ):
        assert _path_spellings(planted), planted
    for description in (
        '"give STORE/snapshots/<key>.safetensors"',
        'f"{root}: no {SNAPSHOTS}/"',
        'folder.name != "snapshots"',
        '{"snapshots": []}',
    ):
        assert not _path_spellings(description), description


def test_relpath_helpers_agree_with_the_manifest_pattern():
    key = "0123456789abcdef0123456789abcdef"
    rel = fmt.snapshot_relpath(key)
    assert rel == "snapshots/0123456789abcdef0123456789abcdef.safetensors"
    assert fmt.SNAPSHOT_REL_RE.fullmatch(rel) and len(rel) == fmt.SNAPSHOT_REL_MAX
    assert rel == fmt.relpath_of_file(fmt.snapshot_filename(key))
    assert not fmt.SNAPSHOT_REL_RE.fullmatch(fmt.snapshot_relpath(key.upper()))


# --- one check each, used by every caller -------------------------------------------------------


def test_not_a_store_is_one_message_for_every_caller(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        StoreError,
        match=r"is not a kvsnap store \(no manifest.json, no snapshots/\); give the folder passed "
        r"to `kvsnap build --out`",
    ):
        Store.open(tmp_path / "empty").require_store()
    store = Store.open(tmp_path / "s", create=True)
    assert store.require_store() is store


def test_missing_files_are_listed_files_the_folder_lacks(tmp_path):
    store = Store.open(tmp_path / "s", create=True)
    keys = ["0" * 32, "1" * 32]
    meta = _metadata()
    with store.lock():
        store.put(keys[0], _tensors(), meta)
        store.update_record(
            "r",
            lambda r: {
                "entries": [
                    {"name": f"a{i}", "file": fmt.snapshot_relpath(k)} for i, k in enumerate(keys)
                ]
            },
        )
    assert store.missing_files() == [fmt.snapshot_relpath(keys[1])]
    assert store.missing_files(set()) == []


def test_foreign_reason_names_the_fields_that_differ(tmp_path):
    store = Store.open(tmp_path / "s", create=True)
    meta = _metadata()
    with store.lock():
        path = store.put(meta["kvsnap.key"], _tensors(), meta)
    info = store.inspect(path)
    assert foreign_reason(None, info) is None and foreign_reason(IDENTITY, info) is None
    other = fixed_identity(("KVCache", "ArraysCache"), weights="e" * 32, max_kv_size=4096)
    assert (
        foreign_reason(other, info)
        == "built for another model or KV setting (differs in: kv_dtype, weights)"
    )
    with pytest.raises(
        SnapshotError,
        match=r"built for another model or KV setting \(differs in: kv_dtype, weights\)",
    ) as exc:
        store.verify_file(path, other)
    assert exc.value.fix == "rebuild it for this model, or run `kvsnap gc` to drop it"
    _, problems = store.scan(other)
    assert [p.reason for p in problems] == [foreign_reason(other, info)]


def test_one_dtype_table():
    from kvsnap.snapshot import file

    assert file.DTYPE_SIZES is fmt.DTYPE_SIZES
    assert {name: size for name, (_, size) in fmt.DTYPES.items()} == fmt.DTYPE_SIZES


# --- bumping a version in the one place ---------------------------------------------------------

BUMP_CHECK = r"""
import io, json, struct, sys
from pathlib import Path
import kvsnap
assert Path(kvsnap.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), kvsnap.__file__
from kvsnap.errors import SnapshotError
from kvsnap.key import ModelIdentity, snapshot_key, tokens_digest
from kvsnap.snapshot.blocks import BlockSettings, chain_field, chain_of, plan_cuts
from kvsnap.snapshot.format import header_metadata
from kvsnap.store.local import Store
from kvsnap.store.manifest import empty_manifest
# what push labels layers with
from kvsnap.store.oci.artifact import ARTIFACT_TYPE, MANIFEST_MEDIA_TYPE, SNAPSHOT_MEDIA_TYPE
from kvsnap.snapshot.file import OutTensor

identity = ModelIdentity(
    "a" * 32, "b" * 32, "c" * 32, "{}", "float32", None, None, None, None, ("KVCache",),
    mlx_lm_minor="0.32",
)
tokens = [1, 2, 3]
key = snapshot_key(identity, "d" * 32, tokens)
cuts = plan_cuts(3, set(), BlockSettings())
chain = chain_field(chain_of(identity.digest, tokens, cuts, False), BlockSettings())
meta = header_metadata(
    key=key, name="a", model=identity.as_dict(), model_digest=identity.digest,
    prompt_digest="d" * 32, n_tokens=3, tokens_digest=tokens_digest(tokens),
    layers=[{"class": "KVCache", "offset": 3}], recorded={}, chain=chain,
)
store = Store.open(sys.argv[2], create=True)
with store.lock():
    token_bytes = memoryview(struct.pack("<3i", *tokens))
    path = store.put(key, [OutTensor("tokens", "I32", (3,), token_bytes)], meta)
# the header: the version is what is checked (its blocks are not written here)
own = store.inspect(path)
refused = []
for old in sorted(Path(sys.argv[3]).glob("snapshots/*.safetensors")):
    try:
        store.inspect(old)
    except SnapshotError as exc:
        refused.append(exc.reason)
print(json.dumps({
    "key": key, "codec_version": identity.codec_version, "format_field": meta["kvsnap.format"],
    "verified": own.key, "refused": refused, "snapshot_media": SNAPSHOT_MEDIA_TYPE,
    "manifest_media": MANIFEST_MEDIA_TYPE, "artifact": ARTIFACT_TYPE,
    "manifest_format": empty_manifest()["format"],
}))
"""


def _run_bumped(tmp_path: Path, edits: dict[str, int]) -> dict:
    """Run BUMP_CHECK against a copy of the package whose format.py has ``edits`` (constant -> new
    value)."""
    copy = tmp_path / "pkg"
    shutil.copytree(PACKAGE, copy / "kvsnap", ignore=shutil.ignore_patterns("__pycache__"))
    owner = copy / "kvsnap" / "snapshot" / "format.py"
    text = owner.read_text()
    for name, value in edits.items():
        text, n = re.subn(rf"^{name} = \d+", f"{name} = {value}", text, flags=re.M)
        assert n == 1, f"{name} is not assigned once at the top of format.py"
    owner.write_text(text)
    old_store = tmp_path / "old"  # written by the unbumped package: a v2 whole file and a v3 record
    store = Store.open(old_store, create=True)
    meta = _metadata()
    tokens = TOKENS[:3]
    record = _metadata(
        tokens=tokens,
        chain=chain_field(
            chain_of(IDENTITY.digest, tokens, plan_cuts(3, set(), BlockSettings()), True),
            BlockSettings(),
        ),
    )
    with store.lock():
        store.put(meta["kvsnap.key"], _tensors(), meta)
        store.put(record["kvsnap.key"], _tensors(tokens)[:1], record)
    env = {**os.environ, "PYTHONPATH": str(copy)}
    r = subprocess.run(
        [sys.executable, "-c", BUMP_CHECK, str(copy), str(tmp_path / "new"), str(old_store)],
        capture_output=True,
        text=True,
        env=env,
        cwd=copy,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_bumping_the_format_version_moves_writer_reader_and_media_type_together(tmp_path):
    now = _run_bumped(tmp_path / "same", {})
    assert (now["format_field"], now["snapshot_media"], now["refused"]) == (
        "3",
        "application/vnd.kvsnap.snapshot.v3+safetensors",
        [],
    )
    bumped = _run_bumped(tmp_path / "bumped", {"FORMAT_VERSION": 4})
    # it writes v4 and reads it back
    assert bumped["format_field"] == "4" and bumped["verified"] == bumped["key"]
    assert bumped["snapshot_media"] == "application/vnd.kvsnap.snapshot.v4+safetensors"
    # The whole-file format stays readable (kvsnap migrate's input); the record format it replaced
    # does not.
    assert bumped["refused"] == [
        "snapshot format version '3' is not one this kvsnap reads (2 or 4); rebuild it with this "
        "kvsnap"
    ]
    # the file format is not keyed: an old record is refused by version, not missed
    assert bumped["key"] == now["key"]


def test_bumping_the_codec_version_changes_every_key_and_identity(tmp_path):
    now = _run_bumped(tmp_path / "same", {})
    bumped = _run_bumped(tmp_path / "bumped", {"CODEC_FORMAT_VERSION": 2})
    assert (now["codec_version"], bumped["codec_version"]) == (1, 2)
    assert bumped["key"] != now["key"] and bumped["verified"] == bumped["key"]


def test_bumping_the_manifest_format_moves_the_written_value_and_its_media_type(tmp_path):
    bumped = _run_bumped(tmp_path, {"MANIFEST_FORMAT": 3, "OCI_ARTIFACT_VERSION": 2})
    assert (
        bumped["manifest_format"] == 3
        and bumped["manifest_media"] == "application/vnd.kvsnap.manifest.v3+json"
    )
    assert bumped["artifact"] == "application/vnd.kvsnap.store.v2"
