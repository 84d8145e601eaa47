"""`kvsnap push / pull` and `serve --kv-snapshots oci://…` against a real registry on 127.0.0.1.

The registry is Debian's `docker-registry` (the CNCF distribution registry), started by a
session fixture with filesystem storage under a temp folder; `.ci/run` installs it. Tests
skip, saying why, only when its binary is missing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from helpers.cli import run_kvsnap
from helpers.registry import REGISTRY_BIN, Registry, _push_raw
from helpers.stores import AGENTS, build_store, flip_byte, no_stage_dirs, store_files, tree

from kvsnap.errors import UsageError
from kvsnap.store.local import MANIFEST, Store
from kvsnap.store.oci import (
    ARTIFACT_TYPE,
    EMPTY_CONFIG,
    OCI_MANIFEST,
    TITLE,
    Credentials,
    DigestMismatchError,
    Reference,
    RegistryAuthError,
    RegistryUnreachableError,
    find_credentials,
    pull,
    push,
)
from kvsnap.store.remote import resolve_kv_snapshots
from kvsnap.tools.serverproc import free_port, start_server

pytestmark = pytest.mark.usefixtures("no_ambient_credentials")


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory):
    """docker-registry with Bearer-token auth, trusting the signing certificate of a token service
    on 127.0.0.1."""
    if not os.path.exists(REGISTRY_BIN):
        pytest.skip(
            "docker-registry is not installed (apt-get install docker-registry; .ci/run does)"
        )
    from helpers.registry_token_service import TokenService

    tmp = tmp_path_factory.mktemp("token-registry")
    tokens = TokenService(users={"ci": "tok-pw"})
    reg = Registry(
        tmp, auth_yaml=tokens.registry_auth_yaml(tokens.write_bundle(tmp / "token-ca.pem"))
    )
    reg.tokens = tokens
    yield reg
    reg.stop()
    tokens.stop()


def one_line_error(r: subprocess.CompletedProcess, command: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvsnap {command}: error: "), r.stderr
    return lines[0]


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


# --- references and credentials (no registry) ------------------------------------------------


def test_references_parse_and_map_to_a_cache_folder(tmp_path):
    ref = Reference.parse("oci://registry.example.com:5000/team/kv-snaps:v1.2")
    assert (ref.host, ref.repo, ref.tag, ref.digest) == (
        "registry.example.com:5000",
        "team/kv-snaps",
        "v1.2",
        None,
    )
    assert str(ref) == "oci://registry.example.com:5000/team/kv-snaps:v1.2"
    assert (
        ref.cache_dir(tmp_path) == tmp_path / "registry.example.com_5000" / "team/kv-snaps" / "v1.2"
    )
    pinned = Reference.parse("oci://ghcr.io/org/snaps@sha256:" + "a" * 64)
    assert (
        pinned.digest == "sha256:" + "a" * 64
        and pinned.tag is None
        and pinned.cache_dir(tmp_path).name == "sha256_" + "a" * 64
    )
    assert str(Reference.parse("oci://localhost/snaps:latest").cache_dir()).startswith(
        str(tmp_path / "kvsnap-cache" / "oci")
    )
    for bad, says in (
        ("registry.example.com/team/snaps:v1", "is not an OCI reference"),
        ("oci://registry.example.com/team/snaps", "has no tag"),
        ("oci://registry.example.com/Team/snaps:v1", "is not a repository name"),
        ("oci://registry.example.com/team/snaps:bad tag", "is not a valid tag"),
        ("oci://registry.example.com/team/snaps@sha256:abc", "is not a sha256 digest"),
        ("oci:///team/snaps:v1", "is not a registry host"),
    ):
        with pytest.raises(UsageError, match=says):
            Reference.parse(bad)


def test_credentials_come_from_the_environment_or_docker_config_and_are_never_shown(
    monkeypatch, tmp_path
):
    assert find_credentials("reg.example.com") is None
    config = tmp_path / "docker"
    config.mkdir()
    auth = base64.b64encode(b"bob:pa:ss").decode()
    (config / "config.json").write_text(
        json.dumps(
            {
                "auths": {
                    "https://reg.example.com/v1/": {"auth": auth},
                    "other.example.com": {"username": "u", "password": "p"},
                }
            }
        )
    )
    monkeypatch.setenv("DOCKER_CONFIG", str(config))
    creds = find_credentials("reg.example.com")
    assert (creds.username, creds.password, creds.source) == ("bob", "pa:ss", "docker config.json")
    assert "pa:ss" not in repr(creds) and "bob" not in repr(creds)
    assert find_credentials("other.example.com").password == "p"
    assert find_credentials("third.example.com") is None
    monkeypatch.setenv("KVSNAP_REGISTRY_USER", "env-user")
    monkeypatch.setenv("KVSNAP_REGISTRY_PASSWORD", "env-pw")
    creds = find_credentials("reg.example.com")
    assert (creds.username, creds.password) == (
        "env-user",
        "env-pw",
    ) and "KVSNAP_REGISTRY_USER" in creds.source


def test_bearer_token_flow_against_a_real_registry(token_registry, built, tmp_path):
    """How ghcr.io and Docker Hub authenticate: the registry answers 401 Bearer, kvsnap asks the
    realm for a token with Basic credentials and retries with it. The registry checks the token's
    signature, issuer, audience and granted actions itself."""
    from helpers.registry_token_service import SERVICE, SigningKey, claims_for

    tokens = token_registry.tokens
    ref = Reference.parse(token_registry.ref("team/snaps"))
    creds = Credentials("ci", "tok-pw", "test")
    first_call = len(tokens.calls)
    report = push(built, ref, credentials=creds)
    # the empty config + 2 records, their blocks, manifest.json
    assert len(report.uploaded) == 1 + len(store_files(built))
    user, query = tokens.calls[first_call]
    assert (
        user == "ci"
        and ("service", SERVICE) in query
        and ("scope", "repository:team/snaps:pull,push") in query
    ), query
    pulled = pull(ref, tmp_path / "pulled", credentials=creds)
    assert len(pulled.downloaded) == len(store_files(built)) and store_files(
        tmp_path / "pulled"
    ) == store_files(built)
    r = run_kvsnap(
        "pull",
        str(ref),
        tmp_path / "cli-pulled",
        env={"KVSNAP_REGISTRY_USER": "ci", "KVSNAP_REGISTRY_PASSWORD": "tok-pw"},
    )
    assert r.returncode == 0 and "tok-pw" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert store_files(tmp_path / "cli-pulled") == store_files(built)

    with pytest.raises(RegistryAuthError, match=r"refused the credentials from test \(HTTP 401\)"):
        pull(ref, tmp_path / "again", credentials=Credentials("ci", "wrong", "test"))
    with pytest.raises(
        RegistryAuthError, match=r"needs credentials \(HTTP 401\); set KVSNAP_REGISTRY_USER"
    ):
        pull(ref, tmp_path / "again", credentials=None)
    assert not (tmp_path / "again").exists()

    # Negative control: the registry really checks tokens (a permissive one would pass the above).
    url = f"http://{token_registry.host}/v2/team/snaps/manifests/v1"
    pull_claims = claims_for("ci", ["repository:team/snaps:pull"])
    for token, status in (
        (tokens.signer.jwt(pull_claims), 200),
        # signed by a key outside the rootcertbundle
        (SigningKey.make("a forger").jwt(pull_claims), 401),
        # granted another repository
        (tokens.signer.jwt(claims_for("ci", ["repository:other/repo:pull"])), 401),
        # wrong audience
        (
            tokens.signer.jwt(
                claims_for("ci", ["repository:team/snaps:pull"], service="another-registry")
            ),
            401,
        ),
    ):
        assert (
            httpx.get(
                url,
                headers={"Accept": OCI_MANIFEST, "Authorization": f"Bearer {token}"},
                timeout=10,
            ).status_code
            == status
        )


# --- push, pull, verify ----------------------------------------------------------------------


def test_push_pull_verify_round_trip(registry, built, tmp_path):
    ref = registry.ref("team/snaps")
    pushed = run_kvsnap("push", built, ref)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    n = len(store_files(built))  # manifest.json, 2 records and the blocks they reach
    assert (
        f"{n + 1} blob(s) uploaded" in pushed.stdout
        and "0 already in the registry" in pushed.stdout
    )

    # The artifact: an OCI image manifest of type kvsnap store, the empty config, one layer per
    # file.
    doc = registry.manifest("team/snaps", "v1").json()
    assert (
        doc["mediaType"] == OCI_MANIFEST
        and doc["artifactType"] == ARTIFACT_TYPE
        and doc["config"] == EMPTY_CONFIG
    )
    layers = {layer["annotations"][TITLE]: layer for layer in doc["layers"]}
    assert set(layers) == set(store_files(built))
    for rel, layer in layers.items():
        assert (
            layer["digest"] == sha256(built / rel) and layer["size"] == (built / rel).stat().st_size
        )

    out = tmp_path / "pulled"
    r = run_kvsnap("pull", ref, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{n} file(s) downloaded" in r.stdout and "0 already there" in r.stdout
    assert store_files(out) == store_files(built)
    # a new store appears whole: no .lock, no temp files
    assert sorted(os.listdir(out)) == ["blocks", "checkpoints", MANIFEST, "snapshots"]
    assert {oct((out / d).stat().st_mode & 0o777) for d in ("", "snapshots", "blocks")} == {"0o700"}
    assert {
        oct(p.stat().st_mode & 0o777)
        for p in [out / MANIFEST, *(out / "snapshots").iterdir(), *(out / "blocks").iterdir()]
    } == {"0o600"}
    v = run_kvsnap("verify", out)
    assert v.returncode == 0 and "2 ok, 0 bad" in v.stdout, v.stdout
    assert no_stage_dirs(tmp_path)

    # Again: nothing to download, nothing touched; re-push: nothing uploaded, same manifest digest.
    before = tree(out)
    r = run_kvsnap("pull", ref, out)
    assert (
        r.returncode == 0
        and "0 file(s) downloaded" in r.stdout
        and f"{n} already there" in r.stdout
    )
    assert tree(out) == before
    since = registry.log_size()
    r2 = run_kvsnap("push", built, ref)
    assert (
        r2.returncode == 0
        and "0 blob(s) uploaded" in r2.stdout
        and f"{n + 1} already in the registry" in r2.stdout
    )
    assert registry.uploads(since) == []
    digest = re.compile(r"\((sha256:[0-9a-f]{64})\)")
    # same manifest digest
    assert digest.search(r2.stdout).group(1) == digest.search(pushed.stdout).group(1)


def test_repush_after_changing_one_agent_uploads_one_new_snapshot_blob(registry, lm, tmp_path):
    agents_file = tmp_path / "agents.json"
    agents = [dict(a) for a in AGENTS]
    store = build_store(lm, tmp_path / "snaps", agents, agents_file)
    ref = Reference.parse(registry.ref("ci/agents"))
    first = push(store, ref)
    replica = tmp_path / "replica"
    assert len(pull(ref, replica).downloaded) == len(store_files(store))

    # CI edits one agent, rebuilds the same store, pushes the same tag.
    agents[1] = {
        "name": "planner",
        "messages": [
            {
                "role": "system",
                "content": "You are a planner agent. Plan briefly, then list the steps.",
            }
        ],
    }
    build_store(lm, store, agents, agents_file)
    new_files = sorted(set(store_files(store)) - set(store_files(replica)))
    assert len([f for f in new_files if f.startswith("snapshots/")]) == 1 and any(
        f.startswith("blocks/") for f in new_files
    )
    since = registry.log_size()
    report = push(store, ref)
    # the new record, its new blocks and the changed manifest.json only
    assert sorted(report.uploaded) == sorted([*new_files, MANIFEST])
    unchanged = [f for f in store_files(store) if f not in new_files and f != MANIFEST]
    assert (
        sorted(report.skipped) == sorted(["config", *unchanged])
        and report.manifest_digest != first.manifest_digest
    )
    uploaded = registry.uploads(since)  # counted by the registry itself
    assert sorted(uploaded) == sorted([sha256(store / f) for f in [*new_files, MANIFEST]])

    # A replica pulls only what it lacks.
    again = pull(ref, replica)
    assert sorted(again.downloaded) == sorted([*new_files, MANIFEST]) and sorted(
        again.present
    ) == sorted(f for f in unchanged if f in again.present)
    have, want = store_files(replica), store_files(store)
    assert all(have.get(name) == data for name, data in want.items() if name != MANIFEST)
    # Installs never shrink a record: the replica's keeps the old planner entry too.
    ((rid, record),) = json.loads(want[MANIFEST])["records"].items()
    kept = json.loads(have[MANIFEST])["records"][rid]["entries"]
    assert all(e in kept for e in record["entries"]) and len(kept) == len(record["entries"]) + 1
    assert run_kvsnap("verify", replica).returncode == 0


def test_serve_from_oci_pulls_into_the_cache_and_the_first_request_hits(
    registry, built, demo_models, tmp_path, monkeypatch
):
    from kvsnap.tools.client import stream_chat

    ref = registry.ref("serve/snaps", "prod")
    assert run_kvsnap("push", built, ref).returncode == 0
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    cache = tmp_path / "cache"
    server = start_server(
        demo_models.path("dense"),
        ["--served-model-name", "m", "--warm-prompts", str(agents), "--kv-snapshots", ref],
        tmp_path / "serve.log",
        env={"KVSNAP_CACHE_DIR": str(cache)},
        limit_s=300,
    )
    try:
        server.wait_ready(120)
        log = server.log()
        pulled = cache / "oci" / registry.host.replace(":", "_") / "serve/snaps/prod"
        assert f"pulled {ref}" in log and f"{len(store_files(built))} file(s) downloaded" in log, (
            log[-2000:]
        )
        warmup = server.status()["warmup"]
        assert (warmup["from_snapshots"], warmup["prefilled"]) == (2, 0), warmup
        assert store_files(pulled) == store_files(built)
        with httpx.Client(timeout=120) as client:
            messages = AGENTS[1]["messages"] + [{"role": "user", "content": "Plan the release."}]
            result = stream_chat(client, server.url, "m", messages, max_tokens=4)
        assert result.cached_tokens > 0, result.usage
    finally:
        server.stop()
    # The next start reuses the cached files: resolving again downloads nothing.
    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(cache))
    before = tree(pulled)
    assert resolve_kv_snapshots(ref) == str(pulled)
    assert {k: v for k, v in tree(pulled).items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }


def test_serve_resolution_leaves_folders_alone_and_falls_back_to_an_earlier_pull(
    built, tmp_path, caplog
):
    assert resolve_kv_snapshots(None) is None and resolve_kv_snapshots(str(built)) == str(built)
    ref = f"oci://127.0.0.1:{free_port()}/team/snaps:v1"  # nothing listens there
    with pytest.raises(RegistryUnreachableError, match="cannot reach registry"):
        resolve_kv_snapshots(ref)
    cached = Reference.parse(ref).cache_dir()
    shutil.copytree(built, cached)
    with caplog.at_level("WARNING", logger="kvsnap"):
        assert resolve_kv_snapshots(ref) == str(cached)
    assert "starting from the copy pulled earlier" in caplog.text


# --- refused input: clear error, local store unchanged ----------------------------------------


def test_tampered_blob_is_refused_and_the_local_store_is_unchanged(registry, lm, tmp_path):
    # A store of its own, so the blob tampered with here is in no other test's artifact.
    agents_file = tmp_path / "agents.json"
    agents = [
        {
            "name": "tamper-a",
            "messages": [
                {"role": "system", "content": "You are the agent whose blob gets tampered with."}
            ],
        }
    ]
    store = build_store(lm, tmp_path / "snaps", agents, agents_file)
    ref_v1 = registry.ref("tamper/snaps", "v1")
    assert run_kvsnap("push", store, ref_v1).returncode == 0
    local = tmp_path / "local"
    assert run_kvsnap("pull", ref_v1, local).returncode == 0
    agents.append(
        {
            "name": "tamper-b",
            "messages": [{"role": "system", "content": "You are the second agent, added for v2."}],
        }
    )
    build_store(lm, store, agents, agents_file)
    ref_v2 = registry.ref("tamper/snaps", "v2")
    assert run_kvsnap("push", store, ref_v2).returncode == 0
    new_rel = (set(store_files(store)) - set(store_files(local))).pop()
    blob = registry.blob_data(sha256(store / new_rel))

    flip_byte(blob, blob.stat().st_size // 2)  # same size, other bytes
    before = tree(local)
    for dest in (local, tmp_path / "fresh"):
        line = one_line_error(run_kvsnap("pull", ref_v2, dest), "pull")
        assert (
            f"({new_rel}) hashes to sha256:" in line
            and "tampered or corrupt in the registry" in line
            and "nothing was changed" in line
        )
    assert tree(local) == before and not (tmp_path / "fresh").exists() and no_stage_dirs(tmp_path)

    blob.write_bytes(blob.read_bytes()[:-10])  # truncated
    line = one_line_error(run_kvsnap("pull", ref_v2, local), "pull")
    assert "not the" in line and "tampered or corrupt" in line
    assert tree(local) == before and no_stage_dirs(tmp_path)
    with pytest.raises(DigestMismatchError):
        pull(Reference.parse(ref_v2), local)


def test_a_blob_with_the_right_digest_but_a_bad_snapshot_checksum_is_refused(
    registry, built, tmp_path
):
    """The registry's digest only proves the bytes are what was pushed; each snapshot's own
    checksum is checked too."""
    good = Store.open(built).snapshot_files()[0]
    bad = bytearray(good.read_bytes())
    bad[-1] ^= 1  # in the data (a record is mostly header)
    ref = Reference.parse(registry.ref("forged/snaps"))
    _push_raw(
        ref, {f"snapshots/{good.name}": bytes(bad), MANIFEST: (built / MANIFEST).read_bytes()}
    )
    dest = tmp_path / "dest"
    shutil.copytree(built, dest)
    (dest / "snapshots" / good.name).unlink()
    before = tree(dest)
    line = one_line_error(run_kvsnap("pull", str(ref), dest), "pull")
    assert (
        re.search(rf"snapshots/{good.name}: (checksum mismatch|tokens do not match)", line)
        and "nothing was changed" in line
    )
    assert tree(dest) == before and no_stage_dirs(tmp_path)


# the same in-memory opener push uses


@pytest.mark.parametrize(
    "title",
    [
        "../evil.safetensors",
        "/tmp/kvsnap-evil-abs",
        "snapshots/../../evil.safetensors",
        ".lock",
        "snapshots/notakey.safetensors",
    ],
)
def test_layer_titles_that_escape_or_are_not_store_files_are_refused(
    registry, built, tmp_path, title
):
    ref = Reference.parse(registry.ref("escape/snaps", re.sub(r"[^a-z]", "", title) or "x"))
    _push_raw(ref, {title: b"evil bytes", MANIFEST: (built / MANIFEST).read_bytes()})
    dest = tmp_path / "work" / "dest"
    line = one_line_error(run_kvsnap("pull", str(ref), dest), "pull")
    assert "escapes the store folder" in line or "is not a store file" in line
    assert not dest.exists() and not (tmp_path / "work").exists()
    assert not list(tmp_path.rglob("evil*")) and not Path("/tmp/kvsnap-evil-abs").exists()


def test_missing_tag_and_missing_repository_are_clear_errors(registry, built, tmp_path):
    dest = tmp_path / "dest"
    shutil.copytree(built, dest)
    before = tree(dest)
    line = one_line_error(
        run_kvsnap("pull", registry.ref("team/snaps", "no-such-tag"), dest), "pull"
    )
    assert "tag no-such-tag not found in" in line and "kvsnap push" in line
    line = one_line_error(
        run_kvsnap("pull", registry.ref("no/such-repo", "v1"), tmp_path / "new"), "pull"
    )
    assert "not found" in line or "no repository" in line
    assert tree(dest) == before and not (tmp_path / "new").exists()


def test_unreachable_registry_is_a_clear_error(built, tmp_path):
    ref = f"oci://127.0.0.1:{free_port()}/team/snaps:v1"
    dest = tmp_path / "dest"
    shutil.copytree(built, dest)
    before = tree(dest)
    for args, command in ((["pull", ref, dest], "pull"), (["push", built, ref], "push")):
        line = one_line_error(run_kvsnap(*args), command)
        assert re.search(
            r"cannot reach registry 127\.0\.0\.1:\d+ \(ConnectError: .*refused\); "
            r"check the address",
            line,
        ), line
    assert tree(dest) == before


def test_push_refuses_a_bad_store_and_uploads_nothing(registry, built, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(built, bad)
    victim = Store.open(bad).snapshot_files()[0]
    flip_byte(victim, 1)  # in the data (a record is mostly header)
    since = registry.log_size()
    line = one_line_error(run_kvsnap("push", bad, registry.ref("bad/snaps")), "push")
    assert (
        victim.name in line
        and re.search("checksum mismatch|tokens do not match", line)
        and "refusing to ship" in line
    )
    assert registry.uploads(since) == [] and registry.manifest("bad/snaps", "v1").status_code == 404


def test_401_needs_or_refused_credentials_and_docker_config_login(
    auth_registry, built, tmp_path, monkeypatch
):
    ref = auth_registry.ref("private/snaps")
    dest = tmp_path / "dest"
    for args, command in ((["push", built, ref], "push"), (["pull", ref, dest], "pull")):
        line = one_line_error(run_kvsnap(*args), command)
        assert (
            f"registry {auth_registry.host} needs credentials (HTTP 401); set KVSNAP_REGISTRY_USER "
            f"and KVSNAP_REGISTRY_PASSWORD" in line
        )
    wrong = {"KVSNAP_REGISTRY_USER": "alice", "KVSNAP_REGISTRY_PASSWORD": "not-the-pw"}
    r = run_kvsnap("push", built, ref, env=wrong)
    line = one_line_error(r, "push")
    assert (
        "refused the credentials from $KVSNAP_REGISTRY_USER/$KVSNAP_REGISTRY_PASSWORD (HTTP 401)"
        in line
    )
    assert "not-the-pw" not in r.stdout + r.stderr
    assert (
        not dest.exists()
        and auth_registry.manifest("private/snaps", "v1", auth=("alice", "s3cret-pw")).status_code
        == 404
    )

    r = run_kvsnap(
        "push",
        built,
        ref,
        env={"KVSNAP_REGISTRY_USER": "alice", "KVSNAP_REGISTRY_PASSWORD": "s3cret-pw"},
    )
    assert r.returncode == 0 and "s3cret-pw" not in r.stdout + r.stderr, r.stderr
    docker = tmp_path / "docker"
    docker.mkdir()
    (docker / "config.json").write_text(
        json.dumps(
            {"auths": {auth_registry.host: {"auth": base64.b64encode(b"alice:s3cret-pw").decode()}}}
        )
    )
    r = run_kvsnap("pull", ref, dest, env={"DOCKER_CONFIG": str(docker)})
    assert r.returncode == 0 and "s3cret-pw" not in r.stdout + r.stderr, r.stderr
    assert store_files(dest) == store_files(built)


# --- progress and --json ---------------------------------------------------------------------


def test_push_and_pull_report_every_byte_they_move(registry, built, tmp_path):
    """The CLI's byte bar is fed by these callbacks: the bytes to move once the registry has
    answered, then chunks summing to them; a second push or pull moves and reports nothing."""
    ref = registry.ref("team/progress")
    totals: list[int] = []
    chunks: list[int] = []
    pushed = push(built, ref, on_bytes=chunks.append, on_total=totals.append)
    assert pushed.uploaded_bytes > 0 and totals == [pushed.uploaded_bytes]
    assert sum(chunks) == pushed.uploaded_bytes and min(chunks) > 0

    totals, chunks = [], []
    pulled = pull(ref, tmp_path / "out", on_bytes=chunks.append, on_total=totals.append)
    assert pulled.downloaded_bytes == sum(
        (built / rel).stat().st_size for rel in store_files(built)
    )
    assert totals == [pulled.downloaded_bytes] and sum(chunks) == pulled.downloaded_bytes

    totals, chunks = [], []
    assert pull(ref, tmp_path / "out", on_bytes=chunks.append, on_total=totals.append).present
    assert push(built, ref, on_bytes=chunks.append, on_total=totals.append).skipped
    assert totals == [0, 0] and chunks == []


def test_push_and_pull_json_print_one_object_with_the_documented_fields(registry, built, tmp_path):
    ref = registry.ref("team/json")
    r = run_kvsnap("push", built, ref, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {
        "store",
        "ref",
        "manifest_digest",
        "uploaded",
        "uploaded_bytes",
        "skipped",
    }
    assert doc["ref"] == ref and doc["store"] == str(built)
    assert doc["manifest_digest"].startswith("sha256:") and doc["skipped"] == []
    assert set(doc["uploaded"]) == set(store_files(built)) | {"config"}
    assert doc["uploaded_bytes"] > 0 and r.stderr == ""

    out = tmp_path / "pulled"
    r = run_kvsnap("pull", ref, out, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    pulled = json.loads(r.stdout)
    assert set(pulled) == {
        "ref",
        "store",
        "manifest_digest",
        "downloaded",
        "downloaded_bytes",
        "present",
        "resumed",
        "kept",
    }
    assert pulled["manifest_digest"] == doc["manifest_digest"]
    assert pulled["store"] == str(out) and set(pulled["downloaded"]) == set(store_files(built))
    assert pulled["downloaded_bytes"] == doc["uploaded_bytes"] - len(b"{}")
    assert pulled["present"] == pulled["resumed"] == pulled["kept"] == []
