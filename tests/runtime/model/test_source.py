"""`--model ORG/NAME`: hub ids resolved through a Hugging Face cache laid out by hand, offline.

The cache is built exactly as huggingface_hub writes it (models--ORG--NAME/blobs/<sha256 or git
sha1>, snapshots/<commit>/<file> -> ../../blobs/<name>, refs/<branch> holding the commit) from
the tiny demo models; HF_HOME points at it and HF_HUB_OFFLINE=1, so nothing can download.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.cli import run_kvsnap
from helpers.hub import add_snapshot, git_blob_sha1
from helpers.models import LONG_SYSTEM

from kvsnap.errors import ModelError, UsageError
from kvsnap.key import DigestCache, KVSettings, hash_file, hub_blob_sha256, model_identity
from kvsnap.runtime.model.source import HUB_ALLOW_PATTERNS, ResolvedModel, resolve_model
from kvsnap.tools.serverproc import free_port, start_server

REPO = "org/tiny-chat"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
AGENTS = [{"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]}]


@pytest.fixture(scope="module")
def models(demo_models) -> dict[str, Path]:
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    return {
        "a": demo_models.path("dense"),
        "b": make_demo_model(demo_models.root / "dense-seed1", DemoSpec(seed=1)),
    }


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, models) -> Path:
    """main (and tag v1) -> model a at COMMIT_A; tag v2 -> model b at COMMIT_B."""
    home = tmp_path_factory.mktemp("hf-home")
    add_snapshot(home / "hub", REPO, models["a"], COMMIT_A, refs=("main", "v1"))
    add_snapshot(home / "hub", REPO, models["b"], COMMIT_B, refs=("v2",))
    return home


@pytest.fixture(scope="module")
def env(hf_home, tmp_path_factory) -> dict:
    return {
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "KVSNAP_CACHE_DIR": str(tmp_path_factory.mktemp("digests")),
        "COLUMNS": "200",
    }


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def store_keys(store: Path) -> set[str]:
    return {p.stem for p in (store / "snapshots").glob("*.safetensors")}


# --- resolution ------------------------------------------------------------------------------


def test_allow_patterns_are_mlx_lms():
    """The files an id resolves to are the files `mlx_lm.load(ID)` would fetch."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    assert list(HUB_ALLOW_PATTERNS) == list(DEFAULT_ALLOW_PATTERNS)


def test_an_id_resolves_to_the_cached_snapshot_of_main(hf_home):
    source = resolve_model(REPO, cache_dir=hf_home / "hub")
    assert source == ResolvedModel(
        hf_home / "hub" / "models--org--tiny-chat" / "snapshots" / COMMIT_A, REPO, COMMIT_A
    )
    assert (source.path / "model.safetensors").is_symlink()


@pytest.mark.parametrize(
    "revision, commit",
    [("v2", COMMIT_B), (COMMIT_B, COMMIT_B), ("v1", COMMIT_A), ("main", COMMIT_A)],
)
def test_revision_picks_the_snapshot_of_that_tag_or_commit(hf_home, revision, commit):
    assert resolve_model(REPO, revision, cache_dir=hf_home / "hub").commit == commit


def test_the_other_revision_has_the_identity_of_its_own_files(hf_home, models):
    """--revision v2 is model b, byte for byte: the same identity as model b's folder, not
    main's."""

    def ident(path):
        return model_identity(path, "float32", ("KVCache",), KVSettings(), DigestCache())

    v2 = resolve_model(REPO, "v2", cache_dir=hf_home / "hub")
    assert ident(v2.path) == ident(models["b"]) != ident(models["a"])


@pytest.mark.parametrize(
    "name, revision, error, message",
    [
        (
            "org/missing",
            None,
            ModelError,
            r"model 'org/missing' is not a local folder, and the Hugging Face cache .*/hub has no "
            r"complete snapshot of it \(revision main\); HF_HUB_OFFLINE is set, so nothing is "
            r"downloaded; fetch it with `hf download org/missing`",
        ),
        (REPO, "v9", ModelError, r"revision v9\).*`hf download org/tiny-chat --revision v9`"),
        (
            REPO,
            "../../../etc",
            UsageError,
            r"--revision '\.\./\.\./\.\./etc' is not a branch, tag or commit name",
        ),
        (
            "./no-such-folder",
            None,
            ModelError,
            r"model directory './no-such-folder' does not exist; give a local mlx-lm model "
            r"directory or a hub id",
        ),
        (
            "./no-such-folder",
            "main",
            UsageError,
            r"--revision 'main' applies to hub ids, but './no-such-folder' is a local path",
        ),
    ],
)
def test_what_cannot_resolve_says_why_in_one_line(hf_home, name, revision, error, message):
    with pytest.raises(error, match=message) as info:
        resolve_model(name, revision, cache_dir=hf_home / "hub")
    assert "\n" not in str(info.value)


def test_a_cached_snapshot_without_weights_is_not_a_model(tmp_path, models):
    """An interrupted download left config.json only: say so offline instead of failing inside
    mlx-lm."""
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(models["a"] / "config.json", partial / "config.json")
    add_snapshot(tmp_path / "hub", "org/partial", partial, COMMIT_A)
    with pytest.raises(
        ModelError,
        match=r"'org/partial' is not a local folder, and the Hugging Face cache .* has no complete "
        r"snapshot",
    ):
        resolve_model("org/partial", cache_dir=tmp_path / "hub")


def test_a_download_that_cannot_connect_is_one_line_too(tmp_path):
    """Online (HF_HUB_OFFLINE unset) with the hub unreachable: a refused loopback port stands in
    for it."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.update(
        HF_HOME=str(tmp_path / "empty-hf"),
        HF_ENDPOINT=f"http://127.0.0.1:{free_port()}",
        HF_HUB_ETAG_TIMEOUT="2",
        HF_HUB_DOWNLOAD_TIMEOUT="2",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvsnap", "serve", "org/not-cached"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    line = one_error_line(proc)
    assert re.search(
        r"kvsnap serve: error: model 'org/not-cached' is not a local folder, the Hugging Face "
        r"cache .*empty-hf/hub has no complete snapshot of it \(revision main\), and the download "
        r"failed \(.*\); fetch it with `hf download org/not-cached`",
        line,
    ), line


def test_a_proxy_that_refuses_is_one_line_too(tmp_path):
    """huggingface_hub re-raises proxy errors as the HTTP client's own type (not an OSError)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def refuse() -> None:
        for _ in range(8):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: "
                    b"0\r\nConnection: close\r\n\r\n"
                )

    threading.Thread(target=refuse, daemon=True).start()
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.update(
        HF_HOME=str(tmp_path / "empty-hf"),
        HTTPS_PROXY=f"http://127.0.0.1:{port}",
        HF_ENDPOINT="https://hub.invalid",
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvsnap", "serve", "org/behind-proxy"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    finally:
        listener.close()
    line = one_error_line(proc)
    assert re.search(
        r"model 'org/behind-proxy' is not a local folder, .*and the download failed \(ProxyError: "
        r".*\); fetch it with `hf download org/behind-proxy`",
        line,
    ), line


def test_a_cached_id_resolves_online_without_a_network_call(hf_home):
    """Cache first: with HF_HUB_OFFLINE unset, a cached snapshot is used as is (no hub round trip
    at every start)."""
    script = f"""
import sys
def guard(event, args):
    if event in ("socket.connect", "socket.getaddrinfo"):
        raise RuntimeError(f"network use: {{event}} {{args[:2]}}")
sys.addaudithook(guard)
from kvsnap.runtime.model.source import resolve_model
print(resolve_model({REPO!r}, "v2").commit)
"""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env["HF_HOME"] = str(hf_home)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == COMMIT_B, proc.stderr[-3000:]


def test_loading_never_sets_hf_hub_offline_nor_touches_the_network(models):
    """kvsnap no longer forces offline mode; loading a folder (what an id resolves to) opens no
    socket anyway."""
    script = f"""
import os, sys
def guard(event, args):
    if event in ("socket.connect", "socket.getaddrinfo"):
        raise RuntimeError(f"network use: {{event}} {{args[:2]}}")
sys.addaudithook(guard)
from kvsnap.runtime.model.loading import load_model
lm = load_model({str(models["a"])!r})
offline = [k for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if k in os.environ]
assert not offline, offline
print("loaded", lm.path)
"""
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]


# --- blob names stand in for hashing, only where they can be trusted ------------------------------


def test_a_blob_name_checked_once_spares_hashing_a_copy_of_the_cache(hf_home, models, tmp_path):
    """A copy of the cache (new inodes and mtimes: another machine, an image layer) is not
    re-hashed."""
    digests = tmp_path / "digests.json"
    first = DigestCache(digests)
    snap_a = resolve_model(REPO, cache_dir=hf_home / "hub").path
    value = first.digest(snap_a / "model.safetensors")
    assert value == hash_file(models["a"] / "model.safetensors")  # the existing digest, unchanged
    assert (first.misses, first.blob_hits) == (1, 0)

    copy = tmp_path / "copy-hub"
    shutil.copytree(hf_home / "hub", copy, symlinks=True)
    again = DigestCache(digests)
    weights = copy / "models--org--tiny-chat" / "snapshots" / COMMIT_A / "model.safetensors"
    assert weights.is_symlink() and hub_blob_sha256(weights) is not None
    assert again.digest(weights) == value
    assert (again.hits, again.misses, again.blob_hits) == (0, 0, 1)

    # Same bytes by path, same identity: blob names never enter the key.
    def ident(path, c):
        return model_identity(path, "float32", ("KVCache",), KVSettings(), c)

    assert ident(weights.parent, DigestCache(digests)) == ident(models["a"], DigestCache())


def test_a_blob_whose_size_differs_from_what_its_name_was_checked_with_is_hashed(hf_home, tmp_path):
    digests = tmp_path / "digests.json"
    DigestCache(digests).digest(
        resolve_model(REPO, cache_dir=hf_home / "hub").path / "model.safetensors"
    )
    copy = tmp_path / "copy-hub"
    shutil.copytree(hf_home / "hub", copy, symlinks=True)
    weights = copy / "models--org--tiny-chat" / "snapshots" / COMMIT_A / "model.safetensors"
    weights.resolve().write_bytes(weights.read_bytes() + b"\0" * 8)  # damaged in place, same name
    cache = DigestCache(digests)
    assert cache.digest(weights) == hash_file(weights) and (cache.misses, cache.blob_hits) == (1, 0)


def test_a_blob_not_named_by_the_sha256_of_its_bytes_never_teaches_its_name(tmp_path, models):
    """A damaged cache at first sight: the real bytes are hashed, and the name is not remembered."""
    fake = hashlib.sha256(b"other bytes").hexdigest()
    snap = add_snapshot(
        tmp_path / "hub",
        "org/damaged",
        models["a"],
        COMMIT_A,
        blob_name=lambda f, data: fake if f.suffix == ".safetensors" else git_blob_sha1(data),
    )
    weights = snap / "model.safetensors"
    assert hub_blob_sha256(weights) == fake
    first = DigestCache(tmp_path / "digests.json")
    assert first.digest(weights) == hash_file(models["a"] / "model.safetensors")
    assert not any(
        k.startswith("sha256:") for k in json.loads((tmp_path / "digests.json").read_text())
    )
    copy = tmp_path / "copy-hub"
    shutil.copytree(tmp_path / "hub", copy, symlinks=True)
    again = DigestCache(tmp_path / "digests.json")
    again.digest(copy / "models--org--damaged" / "snapshots" / COMMIT_A / "model.safetensors")
    assert (again.misses, again.blob_hits) == (1, 0)


def test_only_sha256_named_blobs_in_a_hub_cache_count(hf_home, models, tmp_path):
    """Git-sha1 named (non-LFS) files, folders that are not a cache's blobs/, and plain files are
    hashed."""
    snap = hf_home / "hub" / "models--org--tiny-chat" / "snapshots" / COMMIT_A
    assert hub_blob_sha256(snap / "config.json") is None  # a 40-hex git blob sha1
    assert hub_blob_sha256(models["a"] / "model.safetensors") is None
    # a blobs/ folder outside models--*/
    elsewhere = tmp_path / "blobs" / hashlib.sha256(b"x").hexdigest()
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"x")
    link = tmp_path / "model.safetensors"
    link.symlink_to(elsewhere)
    assert hub_blob_sha256(link) is None


# --- the command line, across the process boundary ----------------------------------------------


@pytest.fixture(scope="module")
def stores_by_id_and_path(env, models, tmp_path_factory) -> dict:
    """The same agents built by id and by a plain local copy of the same files."""
    d = tmp_path_factory.mktemp("hub-build")
    agents = d / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    local = d / "local-copy"
    shutil.copytree(models["a"], local)
    by_id = run_kvsnap("build", agents, "--model", REPO, "--out", d / "by-id", env=env, timeout=180)
    by_path = run_kvsnap(
        "build", agents, "--model", local, "--out", d / "by-path", env=env, timeout=180
    )
    assert by_id.returncode == 0, by_id.stderr[-3000:]
    assert by_path.returncode == 0, by_path.stderr[-3000:]
    return {"agents": agents, "by_id": d / "by-id", "by_path": d / "by-path"}


def test_build_by_id_and_by_path_give_the_same_keys(stores_by_id_and_path):
    keys = store_keys(stores_by_id_and_path["by_id"])
    assert len(keys) == len(AGENTS) and keys == store_keys(stores_by_id_and_path["by_path"])


def test_the_header_records_repo_and_commit_for_people_not_in_the_key(stores_by_id_and_path, env):
    def recorded(store: Path) -> dict:
        (snapshot,) = (store / "snapshots").glob("*.safetensors")
        proc = run_kvsnap("inspect", snapshot, env=env)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    by_id, by_path = (
        recorded(stores_by_id_and_path["by_id"]),
        recorded(stores_by_id_and_path["by_path"]),
    )
    assert (by_id["recorded"]["model_repo"], by_id["recorded"]["model_commit"]) == (REPO, COMMIT_A)
    assert "model_repo" not in by_path["recorded"] and "model_commit" not in by_path["recorded"]
    assert by_id["key"] == by_path["key"] and by_id["model"] == by_path["model"]
    listed = json.loads(run_kvsnap("ls", stores_by_id_and_path["by_id"], "--json", env=env).stdout)[
        "snapshots"
    ]
    assert [(s["model_repo"], s["model_commit"]) for s in listed] == [(REPO, COMMIT_A)]
    table = run_kvsnap("ls", stores_by_id_and_path["by_id"], env=env).stdout
    assert f"{REPO}@{COMMIT_A[:7]}" in table, table


def test_verify_by_id_and_revision(stores_by_id_and_path, env):
    """The id names the same model as the folder; --revision v2 is another model, so its snapshots
    are foreign."""
    same = run_kvsnap(
        "verify", stores_by_id_and_path["by_path"], "--model", REPO, env=env, timeout=180
    )
    assert same.returncode == 0 and "1 ok, 0 bad" in same.stdout, same.stdout + same.stderr[-2000:]
    other = run_kvsnap(
        "verify",
        stores_by_id_and_path["by_id"],
        "--model",
        REPO,
        "--revision",
        "v2",
        env=env,
        timeout=180,
    )
    # nothing of this revision's was there to check: verify says so and fails
    assert other.returncode == 1 and "0 ok, 0 bad, 1 for another model" in other.stdout, (
        other.stdout + other.stderr[-2000:]
    )
    dangling = run_kvsnap("verify", stores_by_id_and_path["by_id"], "--revision", "v2", env=env)
    assert "--revision 'v2' needs --model" in one_error_line(dangling)


def test_unknown_id_fails_in_one_line_and_creates_nothing(
    stores_by_id_and_path, env, hf_home, tmp_path
):
    out = tmp_path / "never"
    line = one_error_line(
        run_kvsnap(
            "build",
            stores_by_id_and_path["agents"],
            "--model",
            "org/unknown",
            "--out",
            out,
            env=env,
        )
    )
    assert line.startswith("kvsnap build: error: model 'org/unknown' is not a local folder"), line
    assert f"{hf_home / 'hub'}" in line and "`hf download org/unknown`" in line, line
    assert not out.exists()
    line = one_error_line(
        run_kvsnap(
            "build",
            stores_by_id_and_path["agents"],
            "--model",
            REPO,
            "--revision",
            "v9",
            "--out",
            out,
            env=env,
        )
    )
    assert "`hf download org/tiny-chat --revision v9`" in line, line


def test_serve_by_id_answers_as_the_id_and_starts_warm_from_the_id_built_store(
    stores_by_id_and_path, env, tmp_path
):
    server = start_server(
        REPO,
        [
            "--warm-prompts",
            str(stores_by_id_and_path["agents"]),
            "--kv-snapshots",
            str(stores_by_id_and_path["by_path"]),
            "--no-write-back",
        ],
        tmp_path / "serve.log",
        env=env,
        limit_s=300,
    )
    try:
        server.wait_ready(120)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [REPO]
            status = client.get("/v1/status").json()
            assert status["snapshots"]["loaded"] == 1 and status["snapshots"]["prefilled"] == 0, (
                status
            )
            body = {
                "model": REPO,
                "max_tokens": 2,
                "messages": AGENTS[0]["messages"] + [{"role": "user", "content": "Review this."}],
            }
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == REPO
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        server.stop()
