"""Store and file safety, through real files and the real CLI.

6  installs (unpack, pull) merge manifest records; ``gc`` then keeps every live snapshot.
7  crafted headers (a billion ``parts``, layers nested 5000 deep, ...) are named errors, fast,
   in bounded memory -- never a MemoryError or a RecursionError traceback.
10 a malformed manifest.json is one clear error from gc, verify, pack, build, unpack, pull.
11 registry credentials never reach a message, repr or log; a failing docker credential
   helper or docker config is reported with its name and (redacted) stderr.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest
from helpers.cli import no_traceback, run_kvsnap, run_kvsnap_in_1gib

# fixtures: a real docker-registry on 127.0.0.1
from helpers.registry import _push_raw
from helpers.stores import build_store, no_stage_dirs, store_files, tree

from kvsnap.errors import ManifestError, SnapshotError, StoreError
from kvsnap.key import snapshot_key, tokens_digest
from kvsnap.snapshot.file import CHECKSUM_KEY, OutTensor, read_header, write_snapshot
from kvsnap.snapshot.header import key_of, tokens_digest_of_bytes
from kvsnap.store.archive import pack, unpack
from kvsnap.store.local import MANIFEST, Store
from kvsnap.store.manifest import MAX_MANIFEST_BYTES, parse_manifest
from kvsnap.store.oci import (
    CredentialError,
    Credentials,
    Reference,
    RegistryUnreachableError,
    find_credentials,
    pull,
    push,
    redact,
)
from kvsnap.store.remote import resolve_kv_snapshots
from kvsnap.store.shipping import ShipError
from kvsnap.tools.serverproc import free_port

pytestmark = pytest.mark.usefixtures("no_ambient_credentials")

AGENTS_A = [
    {
        "name": "alpha",
        "messages": [
            {
                "role": "system",
                "content": "You are the alpha agent of store A. Review the code, then answer "
                "briefly.",
            }
        ],
    },
    {
        "name": "beta",
        "messages": [
            {
                "role": "system",
                "content": "You are the beta agent of store A. Plan the work in short steps.",
            }
        ],
    },
]
AGENTS_B = [
    {
        "name": "gamma",
        "messages": [
            {
                "role": "system",
                "content": "You are the gamma agent of store B. Summarise the logs you are given.",
            }
        ],
    },
    {
        "name": "delta",
        "messages": [
            {
                "role": "system",
                "content": "You are the delta agent of store B. Write the release notes.",
            }
        ],
    },
]
PASSWORD = "s3cret-pw"  # the auth_registry fixture's password for user alice


@pytest.fixture(scope="module")
def model_dir(demo_models) -> Path:
    return demo_models.path("dense")


@pytest.fixture(scope="module")
def built_a(lm, tmp_path_factory) -> Path:
    return build_store(lm, tmp_path_factory.mktemp("store-a") / "A", AGENTS_A)


@pytest.fixture(scope="module")
def built_b(lm, tmp_path_factory) -> Path:
    return build_store(lm, tmp_path_factory.mktemp("store-b") / "B", AGENTS_B)


@pytest.fixture()
def store_a(built_a, tmp_path) -> Path:
    """A private copy of store A (tests change it)."""
    import shutil

    dest = tmp_path / "A"
    shutil.copytree(built_a, dest)
    return dest


def one_line_error(r: subprocess.CompletedProcess, command: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvsnap {command}: error: "), r.stderr
    return lines[0]


def manifest_records(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text())["records"]


# --- 6. installs merge; gc keeps every record's snapshots --------------------------------------


def test_regression_unpack_into_a_store_keeps_its_records_and_gc_keeps_its_snapshots(
    store_a, built_b, model_dir, tmp_path
):
    """Pack B, unpack into A, gc A --yes used to delete A's own snapshots (0 ok, 2
    bad)."""
    own = store_files(store_a)
    archive = pack(built_b, tmp_path / "b.tar").archive
    r = run_kvsnap("unpack", archive, store_a)
    assert r.returncode == 0, r.stderr
    records = manifest_records(store_a)
    assert set(records) == set(manifest_records(built_b)) | set(
        json.loads(own[MANIFEST])["records"]
    )
    for rid, record in json.loads(own[MANIFEST])["records"].items():
        assert records[rid] == record  # A's own record, untouched
    for rid, record in manifest_records(built_b).items():
        assert records[rid] == record  # B's record, as shipped

    gc = run_kvsnap("gc", store_a, "--yes")
    assert gc.returncode == 0 and "removed 0 file(s)" in gc.stdout, gc.stdout
    for rel, data in own.items():
        if rel != MANIFEST:
            assert (store_a / rel).read_bytes() == data
    v = run_kvsnap("verify", store_a, "--model", model_dir)
    assert v.returncode == 0 and "4 ok, 0 bad" in v.stdout, v.stdout + v.stderr
    assert no_stage_dirs(tmp_path)


def test_an_install_of_a_newer_build_of_a_record_only_adds_and_gc_drops_nothing(
    store_a, lm, tmp_path
):
    """The same (model, agents file) record shipped again only adds (merges never
    shrink)."""
    agents_file = tmp_path / "b-agents.json"
    b = build_store(lm, tmp_path / "B", AGENTS_B, agents_file)
    unpack(pack(b, tmp_path / "v1.tar").archive, store_a)
    build_store(lm, b, AGENTS_B[:1], agents_file)  # v2 of B: delta left the agents file
    unpack(pack(b, tmp_path / "v2.tar").archive, store_a)
    doomed, _ = Store.open(store_a).gc(apply=True)
    assert doomed == []  # delta's entry stays in the store's record, so its files stay live
    assert len(Store.open(store_a).snapshot_files()) == 4  # A's two + gamma + delta
    for path in Store.open(store_a).snapshot_files():
        Store.open(store_a).verify_file(path)


def test_regression_pull_into_a_store_merges_and_gc_keeps_its_snapshots(
    registry, store_a, built_b, model_dir
):  # noqa: F811
    ref = registry.ref("safety/merge-b")
    assert run_kvsnap("push", built_b, ref).returncode == 0
    own = store_files(store_a)
    r = run_kvsnap("pull", ref, store_a)
    assert r.returncode == 0, r.stderr
    assert set(manifest_records(store_a)) == set(json.loads(own[MANIFEST])["records"]) | set(
        manifest_records(built_b)
    )
    gc = run_kvsnap("gc", store_a, "--yes")
    assert gc.returncode == 0 and "removed 0 file(s)" in gc.stdout, gc.stdout
    v = run_kvsnap("verify", store_a, "--model", model_dir)
    assert v.returncode == 0 and "4 ok, 0 bad" in v.stdout, v.stdout + v.stderr
    # Pulling again changes nothing: the manifest is fetched again (the merged one differs from it)
    # and merged into one that already holds B's record; no snapshot is downloaded.
    before = tree(store_a)
    again = run_kvsnap("pull", ref, store_a)
    shipped = len(store_files(built_b)) - 1  # B's records and blocks
    assert (
        again.returncode == 0
        and "1 file(s) downloaded" in again.stdout
        and f"{shipped} already there" in again.stdout
    ), again.stdout + again.stderr
    assert {k: v for k, v in tree(store_a).items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }


def test_an_install_into_a_store_with_a_damaged_manifest_changes_nothing(
    store_a, built_b, tmp_path
):
    (store_a / MANIFEST).write_text(json.dumps({"records": {"r": {"entries": ["snapshots/x"]}}}))
    before = tree(store_a)
    with pytest.raises(
        ShipError, match=r"entries\[0\] is a string 'snapshots/x'.*nothing was changed"
    ):
        unpack(pack(built_b, tmp_path / "b.tar").archive, store_a)
    assert tree(store_a) == before and no_stage_dirs(tmp_path)


def test_a_shipped_manifest_listing_a_snapshot_it_does_not_ship_is_refused(
    store_a, built_b, tmp_path
):
    archive = tmp_path / "partial.tar"
    files = store_files(built_b)
    with tarfile.open(archive, "w") as tar:
        for rel, data in files.items():
            # the manifest and only one of B's two snapshots
            if rel == MANIFEST or rel == sorted(files)[0]:
                info = tarfile.TarInfo(rel)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    before = tree(store_a)
    for dest in (store_a, tmp_path / "new"):
        r = run_kvsnap("unpack", archive, dest)
        line = one_line_error(r, "unpack")
        assert (
            "manifest.json lists snapshots/" in line
            and "which was not shipped" in line
            and "nothing was changed" in line
        )
    assert tree(store_a) == before and not (tmp_path / "new").exists() and no_stage_dirs(tmp_path)


# --- 10. one validating manifest reader --------------------------------------------------------

KEY = "0123456789abcdef0123456789abcdef"
BAD_MANIFESTS = {
    "entries-as-strings": (
        {"records": {"r": {"entries": ["snapshots/x.safetensors"]}}},
        r"records\['r'\]\.entries\[0\] is a string",
    ),
    "file-as-list": (
        {"records": {"r": {"entries": [{"name": "a", "file": ["snapshots", "x"]}]}}},
        r"entries\[0\]\.file is a list",
    ),
    "file-escapes": (
        {"records": {"r": {"entries": [{"file": "../../etc/passwd"}]}}},
        r"entries\[0\]\.file is a string '\.\./\.\./etc/passwd', expected a store path",
    ),
    "entries-as-object": (
        {"records": {"r": {"entries": {"file": f"snapshots/{KEY}.safetensors"}}}},
        r"entries is an object",
    ),
    "record-as-list": ({"records": {"r": [1, 2]}}, r"records\['r'\] is a list"),
    "records-as-list": ({"records": []}, r"records is a list"),
    "n-tokens-as-text": (
        {
            "records": {
                "r": {"entries": [{"file": f"snapshots/{KEY}.safetensors", "n_tokens": "12"}]}
            }
        },
        r"n_tokens is a string '12'",
    ),
    "kv-settings-nested": (
        {"records": {"r": {"kv_settings": {"kv_bits": {"a": 1}}}}},
        r"kv_settings\.kv_bits is an object",
    ),
    "format-as-text": ({"format": "2", "records": {}}, r"format is a string '2'"),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_regression_a_malformed_manifest_is_one_clear_error_from_gc_verify_pack(
    store_a, tmp_path, case
):
    """These were AttributeError / TypeError tracebacks."""
    doc, says = BAD_MANIFESTS[case]
    (store_a / MANIFEST).write_text(json.dumps(doc))
    before = tree(store_a)
    for args, command in (
        (["gc", store_a, "--yes"], "gc"),
        (["pack", store_a, "-o", tmp_path / "x.tar"], "pack"),
    ):
        r = run_kvsnap(*args)
        no_traceback(r)
        line = one_line_error(r, command)
        assert f"{store_a / MANIFEST} is not a kvsnap manifest" in line and re.search(says, line), (
            line
        )
        assert "restore it from a backup, or delete it and rebuild" in line
    v = run_kvsnap("verify", store_a)
    no_traceback(v)
    assert (
        v.returncode == 1 and f"BAD  {store_a / MANIFEST} is not a kvsnap manifest" in v.stdout
    ), v.stdout + v.stderr
    assert "2 ok, 1 bad" in v.stdout
    assert tree(store_a) == before and not (tmp_path / "x.tar").exists()


def test_a_build_refuses_a_malformed_manifest_before_prefilling(lm, store_a):
    (store_a / MANIFEST).write_text(json.dumps(BAD_MANIFESTS["entries-as-strings"][0]))
    before = tree(store_a)
    with pytest.raises(ManifestError, match=r"entries\[0\] is a string"):
        build_store(lm, store_a, AGENTS_A)
    assert tree(store_a) == before


def test_manifests_too_big_too_deep_or_not_utf8_are_refused_before_parsing(store_a):
    path = store_a / MANIFEST
    with open(path, "wb") as f:
        # sparse: the reader must refuse it by its size, not read it
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(
        ManifestError,
        match=rf"is {MAX_MANIFEST_BYTES + 1} bytes, over the {MAX_MANIFEST_BYTES}-byte limit",
    ):
        Store.open(store_a).gc(apply=True)
    for data, says in (
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"records": {"\xff": {}}}', "not valid JSON"),
        (b'{"records": {}, "x": ' + b"[" * 20 + b"]" * 20 + b"}", "nested more than 8 deep"),
    ):
        with pytest.raises(ManifestError, match=says):
            parse_manifest(data, "m.json")
    path.unlink()
    assert Store.open(store_a).referenced() == set()  # no manifest: nothing known to be live


@pytest.mark.parametrize("case", ["entries-as-strings", "file-as-list"])
def test_unpack_refuses_a_malformed_shipped_manifest_without_touching_the_destination(
    store_a, built_b, tmp_path, case
):
    archive = tmp_path / "bad.tar"
    with tarfile.open(archive, "w") as tar:
        for rel, data in store_files(built_b).items():
            data = json.dumps(BAD_MANIFESTS[case][0]).encode() if rel == MANIFEST else data
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    before = tree(store_a)
    for dest in (store_a, tmp_path / "new"):
        line = one_line_error(run_kvsnap("unpack", archive, dest), "unpack")
        assert (
            f"{archive}: manifest.json is not a kvsnap manifest" in line
            and f"nothing was changed in {dest}" in line
        ), line
    assert tree(store_a) == before and not (tmp_path / "new").exists() and no_stage_dirs(tmp_path)


def test_pull_refuses_a_malformed_manifest_without_touching_the_destination(
    registry, store_a, built_b, tmp_path
):  # noqa: F811
    ref = Reference.parse(registry.ref("safety/bad-manifest"))
    files = store_files(built_b)
    files[MANIFEST] = json.dumps(BAD_MANIFESTS["file-as-list"][0]).encode()
    _push_raw(ref, files)
    before = tree(store_a)
    for dest in (store_a, tmp_path / "new"):
        line = one_line_error(run_kvsnap("pull", str(ref), dest), "pull")
        assert (
            "manifest.json is not a kvsnap manifest" in line
            and r"entries[0].file is a list" in line
            and "nothing was changed" in line
        ), line
    assert tree(store_a) == before and not (tmp_path / "new").exists() and no_stage_dirs(tmp_path)
    # A copy already in place with the same bytes is checked too, not waved through.
    (store_a / MANIFEST).write_bytes(files[MANIFEST])
    line = one_line_error(run_kvsnap("pull", str(ref), store_a), "pull")
    assert "not a kvsnap manifest" in line


# --- 7. crafted headers: bounded before anything is built ---------------------------------------


def reforge(path: Path, **changes: str) -> None:
    """Rewrite a snapshot with some metadata changed and a fresh valid checksum: the key and
    checksum are
    plain xxh3, so anyone can do this."""
    header = read_header(path)
    data = path.read_bytes()
    tensors = [
        OutTensor(
            t.name,
            t.dtype,
            t.shape,
            memoryview(data[header.data_start + t.start : header.data_start + t.end]),
        )
        for t in header.tensors.values()
    ]
    meta = {k: v for k, v in header.metadata.items() if k != CHECKSUM_KEY}
    meta.update(changes)
    with open(path, "wb") as f:
        write_snapshot(f, tensors, meta)


def layers_of(path: Path) -> list:
    return json.loads(read_header(path).metadata["kvsnap.layers"])


def test_regression_a_billion_parts_is_refused_at_once_in_bounded_memory(store_a):
    """range(10**9) of tensor names was built before the checksum was read
    (MemoryError after 30 s)."""
    victim = Store.open(store_a).snapshot_files()[0]
    layers = layers_of(victim)
    layers[0] = {
        "class": "QuantizedKVCache",
        "offset": layers[0]["offset"],
        "parts": 10**9,
        "group_size": 64,
        "bits": 8,
    }
    reforge(victim, **{"kvsnap.layers": json.dumps(layers)})

    t0 = time.perf_counter()
    r = run_kvsnap_in_1gib("verify", store_a)
    no_traceback(r)
    assert time.perf_counter() - t0 < 20
    assert (
        r.returncode == 1
        and f"BAD  {victim}: kvsnap.layers[0].parts is 1000000000, expected an integer from 1 to"
        in r.stdout
    ), r.stdout + r.stderr
    assert "1 ok, 1 bad" in r.stdout

    tracemalloc.start()
    with pytest.raises(SnapshotError, match=r"parts is 1000000000"):
        Store.open(store_a).inspect(victim)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < victim.stat().st_size + (1 << 20), peak


def test_regression_layers_nested_5000_deep_are_a_named_problem_for_ls_verify_and_unpack(
    store_a, tmp_path
):
    """An uncaught RecursionError traceback from `ls` and `unpack`."""
    victim = Store.open(store_a).snapshot_files()[0]
    reforge(victim, **{"kvsnap.layers": "[" * 5000 + "]" * 5000})
    r = run_kvsnap("ls", store_a)
    no_traceback(r)
    assert (
        r.returncode == 0
        and "1 snapshot(s)" in r.stdout
        and f"unreadable: {victim}: kvsnap.layers is nested too deeply"
        in r.stdout.replace("\n", "")
    ), r.stdout
    r = run_kvsnap("verify", store_a)
    no_traceback(r)
    assert r.returncode == 1 and f"BAD  {victim}: kvsnap.layers is nested too deeply" in r.stdout

    archive = tmp_path / "deep.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(victim, arcname=f"snapshots/{victim.name}")
    r = run_kvsnap("unpack", archive, tmp_path / "new")
    no_traceback(r)
    line = one_line_error(r, "unpack")
    assert (
        f"snapshots/{victim.name}: kvsnap.layers is nested too deeply" in line
        and not (tmp_path / "new").exists()
    )


HOSTILE_LAYERS = {
    "cachelist-10-deep": (
        lambda n: [
            json.loads(
                '{"class":"CacheList","caches":[' * 10
                + '{"class":"KVCache","offset":%d}' % n
                + "]}" * 10
            )
        ],
        r"CacheList nested more than 4 deep",
    ),
    "arrays-billion-slots": (
        lambda n: [{"class": "ArraysCache", "size": 10**9, "present": []}],
        r"kvsnap\.layers\[0\]\.size is 1000000000, expected an integer from 0 to 256",
    ),
    "present-out-of-range": (
        lambda n: [{"class": "ArraysCache", "size": 2, "present": [0, 5]}],
        r"present is 5, expected an integer from 0 to 1",
    ),
    "5000-layers": (
        lambda n: [{"class": "KVCache", "empty": True}] * 5000,
        r"lists 5000 layers, over the 4096 limit|JSON objects is more than a \d+-byte file can "
        r"justify",
    ),
    "unknown-class": (
        lambda n: [{"class": "os.system"}],
        r"kvsnap\.layers\[0\]\.class is 'os\.system', not a cache class",
    ),
    "offset-as-text": (
        lambda n: [{"class": "KVCache", "offset": "12"}],
        r"kvsnap\.layers\[0\]\.offset is '12', expected an integer",
    ),
    "unknown-field": (
        lambda n: [{"class": "KVCache", "offset": n, "evil": 1}],
        r"has unknown field 'evil'",
    ),
    "not-a-list": (
        lambda n: {"class": "KVCache"},
        r"kvsnap\.layers is \{'class': 'KVCache'\}, expected a JSON list",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_LAYERS))
def test_hostile_layer_lists_are_refused_naming_field_and_value(store_a, case):
    victim = Store.open(store_a).snapshot_files()[0]
    n = Store.open(store_a).inspect(victim).n_tokens
    make, says = HOSTILE_LAYERS[case]
    reforge(victim, **{"kvsnap.layers": json.dumps(make(n))})
    with pytest.raises(SnapshotError, match=says) as exc:
        Store.open(store_a).verify_file(victim)
    assert exc.value.path == str(victim)


HOSTILE_FIELDS = {
    "n-tokens-underscore": (
        {"kvsnap.n_tokens": "2_5"},
        r"kvsnap\.n_tokens is '2_5', expected a decimal token count",
    ),
    "n-tokens-huge": ({"kvsnap.n_tokens": "9" * 5000}, r"kvsnap\.n_tokens is '9999"),
    "key-not-hex": (
        {"kvsnap.key": "../../etc/passwd"},
        r"kvsnap\.key is '\.\./\.\./etc/passwd', expected 32 lowercase hex digits",
    ),
    "name-too-long": (
        {"kvsnap.name": "x" * 5000},
        r"kvsnap\.name is 5000 characters, over the 4096 limit",
    ),
    "model-as-list": ({"kvsnap.model": "[1, 2]"}, r"kvsnap\.model is \[1, 2\], expected an object"),
    "model-deep": (
        {"kvsnap.model": "[" * 5000 + "]" * 5000},
        r"kvsnap\.model is nested too deeply",
    ),
    "recorded-as-list": (
        {"kvsnap.recorded": "[]"},
        r"kvsnap\.recorded is \[\], expected a JSON object",
    ),
    "recorded-created-number": (
        {"kvsnap.recorded": '{"created": 7}'},
        r"kvsnap\.recorded\.created is 7, expected a date string",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_FIELDS))
def test_hostile_metadata_fields_are_refused_naming_field_and_value(store_a, case):
    victim = Store.open(store_a).snapshot_files()[0]
    changes, says = HOSTILE_FIELDS[case]
    reforge(victim, **changes)
    with pytest.raises(SnapshotError, match=says):
        Store.open(store_a).verify_file(victim)
    r = run_kvsnap("ls", store_a, "--json")
    no_traceback(r)
    assert r.returncode == 0 and [p["file"] for p in json.loads(r.stdout)["problems"]] == [
        str(victim)
    ]


def test_a_consistent_header_whose_offset_lies_is_refused_after_the_checksum(store_a):
    victim = Store.open(store_a).snapshot_files()[0]
    layers = layers_of(victim)
    layers[0]["offset"] += 1000
    reforge(victim, **{"kvsnap.layers": json.dumps(layers)})
    with pytest.raises(
        SnapshotError,
        match=r"kvsnap\.layers\[0\]\.offset is \d+, but the snapshot holds \d+ tokens",
    ):
        Store.open(store_a).verify_file(victim)


def test_ls_shows_agent_names_that_look_like_markup(lm, tmp_path):
    """A name is data, never rich markup: '[/bold]' crashed `ls` with a MarkupError traceback."""
    root = build_store(
        lm, tmp_path / "S", [{"name": "[/bold] ops [red]", "messages": AGENTS_A[0]["messages"]}]
    )
    r = run_kvsnap("ls", root, env={"COLUMNS": "200"})
    no_traceback(r)
    assert r.returncode == 0 and "[/bold] ops [red]" in r.stdout, r.stdout + r.stderr


def test_the_tokens_digest_and_key_from_bytes_equal_key_py():
    """snapheader checks tokens from their bytes (no list of ints); the values must be key.py's,
    bit for bit."""
    import random
    import struct

    from kvsnap.key import ModelIdentity

    identity = ModelIdentity("w", "c", "t", "{}", "float32", None, None, None, None, ("KVCache",))
    rng = random.Random(7)
    for n in (0, 1, 5, 1000):
        tokens = [rng.randrange(-(2**31), 2**31) for _ in range(n)]
        raw = struct.pack(f"<{n}i", *tokens)
        assert tokens_digest_of_bytes(raw) == tokens_digest(tokens)
        assert key_of(identity, "p" * 32, tokens_digest(tokens), n) == snapshot_key(
            identity, "p" * 32, tokens
        )


# --- 11. credentials never shown; failing helpers reported -------------------------------------


def test_references_never_show_their_password():
    ref = Reference.parse(f"oci://alice:{PASSWORD}@reg.example.com:5000/team/snaps:v1")
    assert (ref.host, ref.repo, ref.tag) == ("reg.example.com:5000", "team/snaps", "v1")
    assert (ref.credentials.username, ref.credentials.password) == ("alice", PASSWORD)
    for shown in (str(ref), repr(ref), f"{ref!r} {[ref]}"):
        assert (
            PASSWORD not in shown
            and "alice" not in shown
            and "oci://***@reg.example.com:5000/team/snaps:v1" in shown
        )
    # same artifact, same cache folder
    assert ref == Reference.parse("oci://reg.example.com:5000/team/snaps:v1")
    for bad in (
        f"oci://alice:{PASSWORD}@bad host/team/snaps:v1",
        f"oci://alice:{PASSWORD}@reg.example.com/Team:v1",
        f"oci://alice:{PASSWORD}@reg.example.com/team",
        f"oci://alice:pa/{PASSWORD}@reg.example.com/team/snaps:bad tag",
        f"https://alice:{PASSWORD}@reg.example.com/x",
    ):
        with pytest.raises(Exception) as exc:
            Reference.parse(bad)
        assert (
            type(exc.value).__name__ == "UsageError"
            and PASSWORD not in str(exc.value)
            and "***" in str(exc.value)
        ), exc.value
    assert PASSWORD not in redact(
        f"Authorization: Basic {base64.b64encode(f'alice:{PASSWORD}'.encode()).decode()} "
        f'https://alice:{PASSWORD}@x {{"Secret": "{PASSWORD}"}}'
    )


def test_regression_pull_and_push_with_a_password_in_the_reference_never_print_it(
    auth_registry, built_b, tmp_path
):  # noqa: F811
    """`kvsnap pull oci://user:secret@host/…` printed the password."""
    ref = f"oci://alice:{PASSWORD}@{auth_registry.host}/private/redacted:v1"
    r = run_kvsnap("push", built_b, ref)
    assert r.returncode == 0 and PASSWORD not in r.stdout + r.stderr, r.stdout + r.stderr
    assert f"oci://***@{auth_registry.host}/private/redacted:v1" in r.stdout
    r = run_kvsnap("pull", ref, tmp_path / "pulled")
    assert r.returncode == 0 and PASSWORD not in r.stdout + r.stderr and "oci://***@" in r.stdout, (
        r.stdout + r.stderr
    )
    assert store_files(tmp_path / "pulled") == store_files(built_b)
    wrong = f"oci://alice:wrong-{PASSWORD}@{auth_registry.host}/private/redacted:v1"
    r = run_kvsnap("pull", wrong, tmp_path / "again")
    line = one_line_error(r, "pull")
    assert (
        "refused the credentials from the user:password in the reference" in line
        and PASSWORD not in r.stdout + r.stderr
    )
    dead = f"oci://alice:{PASSWORD}@127.0.0.1:{free_port()}/private/redacted:v1"
    for args, command in (
        (["pull", dead, tmp_path / "x"], "pull"),
        (["push", built_b, dead], "push"),
        (["pull", f"oci://alice:{PASSWORD}@bad host/x:v1", tmp_path / "x"], "pull"),
    ):
        r = run_kvsnap(*args)
        one_line_error(r, command)
        assert PASSWORD not in r.stdout + r.stderr, r.stderr


def test_serve_never_logs_the_password_of_its_kv_snapshots_reference(
    auth_registry, built_b, model_dir, tmp_path, caplog, monkeypatch
):  # noqa: F811
    ref = f"oci://alice:{PASSWORD}@{auth_registry.host}/private/serve:v1"
    push(built_b, Reference.parse(ref))
    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level("INFO", logger="kvsnap"):
        local = resolve_kv_snapshots(ref)  # what `serve --kv-snapshots` runs first
    assert store_files(Path(local)) == store_files(built_b)
    assert (
        f"pulled oci://***@{auth_registry.host}/private/serve:v1" in caplog.text
        and PASSWORD not in caplog.text
    )
    # The real command, registry unreachable and nothing cached: one line, no password.
    dead = f"oci://alice:{PASSWORD}@127.0.0.1:{free_port()}/private/serve:v1"
    r = run_kvsnap(
        "serve",
        model_dir,
        "--kv-snapshots",
        dead,
        env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache2")},
        timeout=120,
    )
    assert (
        r.returncode != 0
        and "cannot reach registry" in r.stderr
        and PASSWORD not in r.stdout + r.stderr
    ), r.stderr[-2000:]


def fake_helper(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(exist_ok=True)
    exe = folder / f"docker-credential-{name}"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(0o755)
    return exe


def docker_config(folder: Path, config: dict | str) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


def test_a_failing_credential_helper_is_named_with_its_redacted_stderr(
    auth_registry, built_b, tmp_path
):  # noqa: F811
    """A helper that failed was silently 'no credentials'."""
    bin_dir = tmp_path / "bin"
    fake_helper(
        bin_dir,
        "broken",
        f"echo 'keychain locked; last try https://alice:{PASSWORD}@x and Basic c2VjcmV0LXRva2Vu' "
        f">&2\nexit 3\n",
    )
    config = docker_config(tmp_path / "docker", {"credHelpers": {auth_registry.host: "broken"}})
    env = {"DOCKER_CONFIG": str(config), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = run_kvsnap("pull", auth_registry.ref("private/helper"), tmp_path / "dest", env=env)
    assert r.returncode == 2, r.stderr
    assert (
        "docker-credential-broken failed" in r.stderr
        and "(exit 3): keychain locked" in r.stderr
        and "needs credentials (HTTP 401)" in r.stderr
    ), r.stderr
    assert PASSWORD not in r.stderr + r.stdout and "c2VjcmV0LXRva2Vu" not in r.stderr
    assert not (tmp_path / "dest").exists()


def test_credential_helper_and_docker_config_failures_raise_named_errors(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    fake_helper(bin_dir, "nothing", "echo 'credentials not found in native keychain'\nexit 1\n")
    fake_helper(bin_dir, "garbage", "echo 'not json at all'\n")
    fake_helper(
        bin_dir, "good", 'cat >/dev/null; echo \'{"Username": "u", "Secret": "from-helper"}\'\n'
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    cases = {
        "nothing": None,  # the helper's own "not found": no credentials, no error
        "good": "from-helper",
        "garbage": r"docker-credential-garbage answered for reg\.example\.com with something that "
        r"is not JSON",
        "missing": r"names the credential helper docker-credential-missing for reg\.example\.com, "
        r"but it is not on PATH",
        "../../bin/sh": r"names the credential helper '\.\./\.\./bin/sh', not a helper name",
    }
    for i, (helper, expected) in enumerate(cases.items()):
        monkeypatch.setenv(
            "DOCKER_CONFIG", str(docker_config(tmp_path / f"docker-{i}", {"credsStore": helper}))
        )
        if expected is None:
            assert find_credentials("reg.example.com") is None
        elif not expected.startswith(("docker", "names")):
            assert find_credentials("reg.example.com").password == expected
        else:
            with pytest.raises(CredentialError, match=expected):
                find_credentials("reg.example.com")
    for i, (config, says) in enumerate(
        (
            ("{ not json", r"config\.json is not valid JSON"),
            ({"auths": ["x"]}, r"auths is list, not an object"),
            (
                {"auths": {"reg.example.com": {"auth": "%%%not-base64"}}},
                r"auths\['reg\.example\.com'\]\.auth is not base64 of USER:PASSWORD; run `docker "
                r"login reg\.example\.com` again",
            ),
        )
    ):
        folder = docker_config(tmp_path / f"cfg-{i}", config)
        monkeypatch.setenv("DOCKER_CONFIG", str(folder))
        with pytest.raises(CredentialError, match=says) as exc:
            find_credentials("reg.example.com")
        assert str(folder / "config.json") in str(exc.value)
    monkeypatch.setenv("KVSNAP_REGISTRY_USER", "env-user")
    monkeypatch.setenv("KVSNAP_REGISTRY_PASSWORD", "env-pw")
    assert (
        find_credentials("reg.example.com").source
        == "$KVSNAP_REGISTRY_USER/$KVSNAP_REGISTRY_PASSWORD"
    )  # env first: a broken config is skipped


def test_a_broken_docker_config_is_a_warning_for_an_open_registry(registry, built_b, tmp_path):
    ref = registry.ref("safety/open")
    assert run_kvsnap("push", built_b, ref).returncode == 0
    config = docker_config(tmp_path / "docker", "{ broken")
    r = run_kvsnap("pull", ref, tmp_path / "dest", env={"DOCKER_CONFIG": str(config)})
    assert r.returncode == 0, r.stderr
    assert (
        f"docker config {config / 'config.json'} is not valid JSON" in r.stderr
        and "going on without credentials" in r.stderr
    )
    assert store_files(tmp_path / "dest") == store_files(built_b)


def test_unreachable_errors_are_redacted(tmp_path):
    ref = Reference.parse(f"oci://alice:{PASSWORD}@127.0.0.1:{free_port()}/team/snaps:v1")
    with pytest.raises(RegistryUnreachableError) as exc:
        pull(ref, tmp_path / "dest", credentials=Credentials("alice", PASSWORD, "test"))
    assert (
        PASSWORD not in str(exc.value)
        and PASSWORD not in repr(exc.value)
        and "cannot reach registry" in str(exc.value)
    )
    assert not (tmp_path / "dest").exists()


def test_a_store_never_writes_a_name_its_reader_would_refuse(tmp_path):
    store = Store.open(tmp_path / "s", create=True)
    with (
        store.lock(),
        pytest.raises(
            StoreError,
            match=r"is 5000 characters, over the 4096 a snapshot may hold; give the agent a "
            r"shorter name",
        ),
    ):
        store.put(
            KEY,
            [OutTensor("tokens", "I32", (1,), memoryview(b"\0" * 4))],
            {"kvsnap.name": "x" * 5000},
        )
    assert store.snapshot_files() == [] and store.temp_files() == []


def test_every_cache_class_the_codec_writes_passes_the_layer_checks():
    """The bounds are strict (exact fields per class); every layout the codec really writes must
    pass them."""
    import mlx.core as mx
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
    )

    from kvsnap.snapshot.codec import encode_cache
    from kvsnap.snapshot.layer_list import check_offsets, expected_tensor_names

    def kv(n, dim=8):
        k = mx.random.normal((1, 2, n, dim), key=mx.random.key(n))
        return k, k + 1

    def fed(cache, n):
        for c in cache:
            for sub in c.caches if isinstance(c, CacheList) else [c]:
                if isinstance(sub, ArraysCache):
                    sub[1] = mx.zeros((1, 2, 4, 4))  # slot 0 left empty: "present" is [1]
                elif isinstance(sub, QuantizedKVCache):
                    sub.update_and_fetch(*kv(n, 64))
                else:
                    sub.update_and_fetch(*kv(n))
        return cache

    n = 12
    layouts = {
        "dense": [KVCache(), KVCache()],
        "rotating-wrapped": [RotatingKVCache(max_size=8, keep=2)],
        "quantized": [QuantizedKVCache(group_size=64, bits=8)],
        "hybrid": [ArraysCache(2), KVCache()],
        "chunked": [ChunkedKVCache(4), KVCache()],
        "cachelist": [
            CacheList(ArraysCache(2), KVCache()),
            CacheList(KVCache(), RotatingKVCache(max_size=8)),
        ],
    }
    for name, cache in layouts.items():
        arrays, layers = encode_cache(fed(cache, n), list(range(n)))
        names = set(arrays) - {"tokens"}
        layers = json.loads(json.dumps(layers))  # as the header holds them
        assert expected_tensor_names(layers, len(names)) == names, name
        check_offsets(layers, n)


def test_a_fifo_as_manifest_or_snapshot_is_refused_instead_of_hanging(store_a, tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: gc, verify and ls must not wait for
    one."""
    snapshot = Store.open(store_a).snapshot_files()[0]
    snapshot.unlink()
    os.mkfifo(snapshot)
    r = run_kvsnap("verify", store_a, timeout=60)
    assert r.returncode == 1 and f"BAD  {snapshot}: is not a regular file" in r.stdout, (
        r.stdout + r.stderr
    )
    (store_a / MANIFEST).unlink()
    os.mkfifo(store_a / MANIFEST)
    r = run_kvsnap("gc", store_a, "--yes", timeout=60)
    line = one_line_error(r, "gc")
    assert f"{store_a / MANIFEST} is not a regular file" in line
    from kvsnap.snapshot.file import FormatError, read_header

    with pytest.raises(FormatError, match="is not a regular file"):
        read_header(snapshot)


def test_verify_prints_a_name_with_control_characters_escaped(lm, tmp_path):
    """A name comes from a file: with a newline or an escape sequence it could forge a `verify`
    summary line."""
    root = build_store(
        lm, tmp_path / "S", [{"name": "x\n9 ok, 0 bad\x1b[2K", "messages": AGENTS_A[0]["messages"]}]
    )
    r = run_kvsnap("verify", root)
    assert (
        r.returncode == 0
        and r.stdout.splitlines()[-1] == "1 ok, 0 bad"
        and len(r.stdout.splitlines()) == 2
    ), r.stdout
    assert "'x\\n9 ok, 0 bad\\x1b[2K'" in r.stdout and "\x1b" not in r.stdout
