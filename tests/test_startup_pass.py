"""Start-up reads each snapshot once and re-tokenizes no unchanged warm prompt (issue 15)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from conftest import LONG_SYSTEM, run_kvsnap

AGENTS = [
    {"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]},
    {"name": "planner", "messages": [{"role": "system", "content": "You are a planner agent. Plan each task step by step. " * 4}]},
]


@pytest.fixture()
def world(demo_models, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(demo_models.path("dense"), model)
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    r = run_kvsnap("build", agents, "--model", model, "--out", tmp_path / "snaps", env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    return {"model": model, "agents": agents, "store": tmp_path / "snaps"}


def _start(world):
    from kvsnap.engine import Engine, EngineConfig
    from kvsnap.prompts import load_warm_prompts

    engine = Engine(EngineConfig(model=str(world["model"]), warm_prompts=load_warm_prompts(world["agents"]), warm_prompts_file=str(world["agents"]), snapshots=str(world["store"]), write_back=False))
    engine.start()
    assert engine.wait_warm(120)
    return engine


def test_each_pinned_snapshot_is_opened_and_parsed_once_to_index_and_once_to_restore(world, monkeypatch):
    import kvsnap.snapfile
    import kvsnap.snapheader
    import kvsnap.store

    parses: list[str] = []
    real_parse = kvsnap.store.parse_header

    def counting_parse(f, size):
        parses.append(f.name)
        return real_parse(f, size)

    def no_reread(*args, **kwargs):
        raise AssertionError("a snapshot file was re-read for its tokens")

    monkeypatch.setattr(kvsnap.store, "parse_header", counting_parse)
    monkeypatch.setattr(kvsnap.store, "read_header", no_reread)
    monkeypatch.setattr(kvsnap.snapheader, "tensor_bytes", no_reread)
    engine = _start(world)
    try:
        status = engine.status()
        assert status["snapshots"]["loaded"] == 2 and status["snapshots"]["prefilled"] == 0
        files = sorted(str(p) for p in (world["store"] / "snapshots").iterdir())
        assert sorted(parses) == sorted(files * 2)  # one pass to index, one read to restore
    finally:
        engine.shutdown()


def test_unchanged_warm_prompts_reuse_their_recorded_tokens(world, monkeypatch):
    import kvsnap.warmup

    calls = []
    real = kvsnap.warmup.warm_prefix
    monkeypatch.setattr(kvsnap.warmup, "warm_prefix", lambda *a, **k: calls.append(a) or real(*a, **k))
    engine = _start(world)
    try:
        status = engine.status()
        assert calls == [] and status["warmup"]["recipes_reused"] == 2
        assert status["snapshots"]["loaded"] == 2 and status["snapshots"]["prefilled"] == 0
    finally:
        engine.shutdown()


def test_a_template_edit_falls_back_to_the_full_computation(world, monkeypatch):
    import kvsnap.warmup

    config = world["model"] / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = "{{ '<|edited|>' }}" + data["chat_template"]
    config.write_text(json.dumps(data))
    calls = []
    real = kvsnap.warmup.warm_prefix
    monkeypatch.setattr(kvsnap.warmup, "warm_prefix", lambda *a, **k: calls.append(a) or real(*a, **k))
    engine = _start(world)
    try:
        status = engine.status()
        assert len(calls) == 2 and status["warmup"]["recipes_reused"] == 0
        assert status["snapshots"]["prefilled"] == 2  # the old snapshots no longer match: prefilled afresh
    finally:
        engine.shutdown()


def test_a_recipe_whose_tokens_do_not_give_the_key_is_not_trusted(world, monkeypatch):
    import kvsnap.warm_recipe
    from kvsnap.modeling import load_model
    from kvsnap.store import Store
    from kvsnap.warmup import recorded_prefix

    identity = load_model(world["model"]).identity()
    info = Store.open(world["store"], readonly=True).scan(identity)[0][0]
    forged = dataclasses.replace(info, tokens=info.tokens[:-1])  # a header whose tokens do not give its key
    monkeypatch.setattr(kvsnap.warm_recipe, "warm_recipe", lambda *a: "same-recipe")
    assert recorded_prefix({"same-recipe": info}, None, info.prompt_digest, identity, "") == info.tokens
    assert recorded_prefix({"same-recipe": forged}, None, info.prompt_digest, identity, "") is None
