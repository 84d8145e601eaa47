"""Fixtures of the store tests: a real docker-registry on 127.0.0.1 (open, and behind Basic and
Bearer-token auth), and stores holding persisted conversations."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers.cli import run_kvsnap
from helpers.models import LONG_SYSTEM
from helpers.persist_servers import AGENTS as PERSIST_AGENTS
from helpers.persist_servers import SHARED_SYSTEM, Chat, serve, settle
from helpers.registry import REGISTRY_BIN, Registry


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    if not os.path.exists(REGISTRY_BIN):
        pytest.skip(
            "docker-registry is not installed (apt-get install docker-registry; .ci/run does)"
        )
    reg = Registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def auth_registry(tmp_path_factory):
    if not os.path.exists(REGISTRY_BIN):
        pytest.skip(
            "docker-registry is not installed (apt-get install docker-registry; .ci/run does)"
        )
    bcrypt = pytest.importorskip(
        "bcrypt", reason="python bcrypt is needed to write an htpasswd file"
    )
    tmp = tmp_path_factory.mktemp("auth-registry")
    htpasswd = tmp / "htpasswd"
    htpasswd.write_text(
        "alice:" + bcrypt.hashpw(b"s3cret-pw", bcrypt.gensalt(rounds=4)).decode() + "\n"
    )
    reg = Registry(tmp, htpasswd=htpasswd)
    yield reg
    reg.stop()


@pytest.fixture()
def no_ambient_credentials(monkeypatch, tmp_path):
    """Only the credentials a test gives: no user docker config, no KVSNAP_REGISTRY_* from
    outside (the registry test modules use it for every test: `pytestmark`)."""
    for name in ("KVSNAP_REGISTRY_USER", "KVSNAP_REGISTRY_PASSWORD", "KVSNAP_REGISTRY_PLAIN_HTTP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "kvsnap-cache"))


@pytest.fixture(scope="module")
def base(demo_models, tmp_path_factory):
    """(tmp, model, store): the model as "m", agents.json, and a store `kvsnap build` made
    for the two agents (each test works on a copy)."""
    tmp = tmp_path_factory.mktemp("persist")
    model = tmp / "m"
    model.symlink_to(demo_models.path("dense"), target_is_directory=True)
    (tmp / "agents.json").write_text(json.dumps(PERSIST_AGENTS))
    store = tmp / "built"
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache")}
    r = run_kvsnap("build", tmp / "agents.json", "--model", model, "--out", store, env=env)
    assert r.returncode == 0, r.stderr
    return tmp, model, store


@pytest.fixture(scope="module")
def conv_store(base, tmp_path_factory):
    """A store holding the agents and three persisted conversations: two on a system prompt
    no agent has (they share a block only conversations reach), one on the reviewer's."""
    tmp, model, _ = base
    root = tmp_path_factory.mktemp("conv") / "store"
    shutil.copytree(base[2], root)
    server = serve(model, root, tmp, "conv", "--persist-requests")
    try:
        chats = [Chat("s1", SHARED_SYSTEM), Chat("s2", SHARED_SYSTEM), Chat("r1", LONG_SYSTEM)]
        for chat in chats:
            chat.send(server.url)
        settle(server, root, 3)
    finally:
        server.stop()
    return root
