"""Issue 24 items 3 and 9 in the integrations: `kvsnap mlx-lm serve` and `kvsnap vllm-mlx serve`
check every restored state against the loaded model before it is pinned or inserted, and their
start scan refuses records longer than the model's context, as `kvsnap serve` does.

A forged block (another head dim, checksum recomputed) used to become a protected mlx_lm.server
entry whose first hit killed mlx-lm's generation thread. Real files, the real build, a real
`kvsnap mlx-lm serve` and a plain mlx_lm.server on 127.0.0.1; vllm-mlx's insert path against
the stand-in prefix cache of tests/integrations/vllm_mlx/test_route.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from helpers.cli import run_kvsnap
from helpers.forged import SYSTEMS, _agents, forge_agent, forge_long_record
from helpers.mlx_lm_route import PLANNER, _kvsnap_mlx_lm, _launch
from helpers.models import LONG_SYSTEM
from helpers.stores import build_store
from helpers.vllm_mlx_route import FakePrefixCache, _venv_kvsnap
from helpers.vllm_mlx_route import _ask as vllm_ask
from helpers.vllm_mlx_route import _launch as vllm_launch
from helpers.vllm_mlx_route import _plan as warm_plan

from kvsnap.runtime.warmup.prefetch import context_tokens
from kvsnap.store.local import Store

SHAPE_WHY = "this model's cache holds float32[1, 2, T, 64]"


def _ask(server, name: str) -> dict:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEMS[name]},
            {"role": "user", "content": "Check the tests first."},
        ],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
    }
    # A forged entry used to kill mlx-lm's generation thread: the request then never answered.
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=90)
    assert r.status_code == 200, (name, r.text, server.log()[-3000:])
    out = r.json()
    return {
        "text": out["choices"][0]["message"]["content"],
        "ids": [t["id"] for t in out["choices"][0]["logprobs"]["content"]],
        "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def _serve(cmd: list[str], log: Path) -> tuple[dict, str]:
    server = _launch(cmd, log)
    try:
        server.wait_ready(180)
        answers = {name: _ask(server, name) for name in ("beta", "alpha")}
    finally:
        server.stop()
    return answers, server.log()


@pytest.fixture(scope="module")
def forged_for_mlx_lm(demo_models, tmp_path_factory) -> dict:
    """alpha and beta built `--for mlx-lm`; alpha's own blocks forged with half the head dim."""
    tmp = tmp_path_factory.mktemp("forged-mlx-lm")
    agents = tmp / "agents.json"
    agents.write_text(json.dumps(_agents(["alpha", "beta"])))
    model = demo_models.path("dense")
    r = run_kvsnap(
        "build", agents, "--model", model, "--out", tmp / "store", "--for", "mlx-lm", "--json"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    n_tokens = {e["name"]: e["n_tokens"] for e in json.loads(r.stdout)["entries"]}
    forge_agent(tmp / "store", "alpha")
    store = Store.open(tmp / "store")
    files = {store.inspect(p).name: p for p in store.snapshot_files()}
    return {"store": tmp / "store", "model": str(model), "n": n_tokens, "files": files}


@pytest.mark.slow
def test_regression_mlx_lm_serve_skips_a_forged_agent_and_answers_it_cold(
    forged_for_mlx_lm, tmp_path
):
    w = forged_for_mlx_lm
    warm, log = _serve(
        _kvsnap_mlx_lm(w["model"], "--kv-snapshots", str(w["store"])), tmp_path / "warm.log"
    )
    skipped = [line for line in log.splitlines() if "alpha skipped" in line]
    assert len(skipped) == 1 and str(w["files"]["alpha"]) in skipped[0], log[-3000:]
    assert SHAPE_WHY in skipped[0], skipped
    assert "1 skipped" in log and str(w["files"]["beta"]) not in "".join(skipped), log[-3000:]
    assert warm["beta"]["cached"] == w["n"]["beta"], log[-3000:]  # the good agent still hits
    assert warm["alpha"]["cached"] < w["n"]["alpha"] // 2, log[-3000:]
    cold, _ = _serve(
        [sys.executable, "-m", "mlx_lm", "server", "--model", w["model"]], tmp_path / "cold.log"
    )
    for name in ("alpha", "beta"):
        assert (warm[name]["text"], warm[name]["ids"]) == (cold[name]["text"], cold[name]["ids"])


# --- the same checks on the insert and warm paths, without a server --------------------------


@pytest.fixture(scope="module")
def forged_store(demo_models, tmp_path_factory) -> dict:
    """alpha and beta built for kvsnap serve's rendering (vllm-mlx uses them where the
    tokenizer adds no BOS); alpha's own blocks forged."""
    tmp = tmp_path_factory.mktemp("forged-vllm-mlx")
    root = build_store(demo_models.load("dense"), tmp / "store", _agents(["alpha", "beta"]))
    forge_agent(root, "alpha")
    store = Store.open(root)
    return {"root": root, "files": {store.inspect(p).name: p for p in store.snapshot_files()}}


def test_regression_vllm_mlx_insert_skips_a_forged_snapshot_and_inserts_the_good_one(
    forged_store, demo_models
):
    from kvsnap.integrations.vllm_mlx.insert import insert_snapshots

    lm = demo_models.load("dense")
    cache = FakePrefixCache(min_prefix_tokens=1)
    report = insert_snapshots(
        cache, lm.model, lm.tokenizer, str(lm.path), Store.open(forged_store["root"])
    )
    assert report.inserted == 1 and report.names == ["beta"], report
    [(path, why)] = report.skipped
    assert path == str(forged_store["files"]["alpha"]) and SHAPE_WHY in why, report.skipped
    assert all(c.keys.shape[-1] == 64 for state in cache.entries.values() for c in state)


def _warm_prompts(tmp_path: Path, names: list[str]):
    from kvsnap.prompts import parse_warm_prompts

    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(_agents(names)))
    return parse_warm_prompts(_agents(names), str(agents)), str(agents)


def test_regression_vllm_mlx_warm_plan_prefills_an_agent_whose_snapshot_is_forged(
    forged_store, demo_models, tmp_path
):
    lm = demo_models.load("dense")
    prompts, agents_file = _warm_prompts(tmp_path, ["alpha", "beta"])
    cache = FakePrefixCache(min_prefix_tokens=1)
    store = Store.open(forged_store["root"], readonly=True)
    report = warm_plan(lm, store, False, cache, prompts, agents_file).run()
    assert [(a.name, a.source) for a in report.agents] == [
        ("alpha", "prefilled"),
        ("beta", "snapshot"),
    ], report
    [warning] = report.warnings
    assert str(forged_store["files"]["alpha"]) in warning and SHAPE_WHY in warning, warning
    assert "prefilling instead" in warning
    assert all(c.keys.shape[-1] == 64 for state in cache.entries.values() for c in state)


def test_regression_mlx_lm_pin_store_skips_a_forged_snapshot(forged_store, demo_models):
    from kvsnap.integrations.mlx_lm.cache import PinnedPromptCache
    from kvsnap.integrations.mlx_lm.warm import pin_store
    from kvsnap.key import DigestCache

    lm = demo_models.load("dense")
    cache = PinnedPromptCache(4)
    store = Store.open(forged_store["root"], readonly=True)
    report = pin_store(cache, "m", store, lm.identity(DigestCache()), lm)
    assert (report.completed, report.skipped, cache.pinned_count) == (1, 1, 1), report
    [agent] = report.agents
    assert agent.name == "alpha" and agent.source == "skipped", agent
    assert str(forged_store["files"]["alpha"]) in agent.reason and SHAPE_WHY in agent.reason


# --- item 9: the integrations' scan is bounded by the model's context -----------------------


@pytest.fixture(scope="module")
def too_long(demo_models, tmp_path_factory) -> dict:
    """alpha's sound store plus a valid record named alpha, one token longer than the context."""
    tmp = tmp_path_factory.mktemp("too-long")
    lm = demo_models.load("dense")
    root = build_store(lm, tmp / "store", _agents(["alpha"]))
    context = context_tokens(lm.path)
    return {"root": root, "victim": forge_long_record(root, context + 1), "context": context}


def _over_context(too_long: dict) -> str:
    n = too_long["context"]
    return f"kvsnap.n_tokens is {n + 1}, over the {n} a record may hold here"


def test_regression_vllm_mlx_insert_refuses_a_record_longer_than_the_context(too_long, demo_models):
    from kvsnap.integrations.vllm_mlx.insert import insert_snapshots

    lm = demo_models.load("dense")
    report = insert_snapshots(
        FakePrefixCache(min_prefix_tokens=1),
        lm.model,
        lm.tokenizer,
        str(lm.path),
        Store.open(too_long["root"], readonly=True),
    )
    assert report.inserted == 1, report
    [(path, why)] = report.skipped
    assert path == str(too_long["victim"]) and _over_context(too_long) in why, report.skipped


def test_regression_mlx_lm_pin_store_refuses_a_record_longer_than_the_context(
    too_long, demo_models
):
    from kvsnap.integrations.mlx_lm.cache import PinnedPromptCache
    from kvsnap.integrations.mlx_lm.warm import pin_store
    from kvsnap.key import DigestCache

    lm = demo_models.load("dense")
    cache = PinnedPromptCache(4)
    store = Store.open(too_long["root"], readonly=True)
    report = pin_store(cache, "m", store, lm.identity(DigestCache()), lm)
    assert report.completed == 1 and cache.pinned_count == 1, report
    [rejected] = report.rejected
    assert rejected.startswith(str(too_long["victim"])) and _over_context(too_long) in rejected


def test_regression_warm_plans_never_take_a_record_longer_than_the_context_for_the_agent(
    too_long, demo_models, tmp_path
):
    """With the agent's own record gone, the too-long record named like it used to be read as a
    candidate (and named in a 'built for another rendering' warning); the bounded scan never
    returns it, so the agent is simply prefilled."""
    from kvsnap.integrations.mlx_lm.warm import MlxLmWarmPlan
    from kvsnap.profiles import mlx_lm_tokenization

    root = tmp_path / "store"
    shutil.copytree(too_long["root"], root)
    victim = root / "snapshots" / too_long["victim"].name
    for path in Store.open(root).snapshot_files():
        if path != victim:
            path.unlink()  # alpha's sound record
    lm = demo_models.load("dense")
    prompts, agents_file = _warm_prompts(tmp_path, ["alpha"])
    store = Store.open(root, readonly=True)
    plan = warm_plan(lm, store, False, FakePrefixCache(min_prefix_tokens=1), prompts, agents_file)
    report = plan.run()
    assert (report.prefilled, report.warnings) == (1, []), report
    # The same plan on mlx-lm's route, which has no vllm-mlx pins.
    fields = {k: v for k, v in plan.__dict__.items() if k not in ("pins", "agent_tokenization")}
    mlx_lm = MlxLmWarmPlan(**{**fields, "prefix_cache": _pins()})
    mlx_lm.tokenization = mlx_lm_tokenization(None)
    mlx_lm.model_key = "m"
    report = mlx_lm.run()
    assert (report.prefilled, report.warnings) == (1, []), report


def _pins():
    from kvsnap.integrations.mlx_lm.cache import PinnedPromptCache

    return PinnedPromptCache(4)


# --- kvsnap vllm-mlx serve, end to end in the cached vllm-mlx environment ---------------------

LONG_AGENTS = [
    {"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]},
    {"name": "planner", "messages": [{"role": "system", "content": PLANNER}]},
]


@pytest.fixture(scope="module")
def forged_for_vllm_mlx(vllm_mlx_python, tmp_path_factory) -> dict:
    """The demo model and a store of reviewer and planner built in vllm-mlx's environment
    (over its 128-token minimum prefix); the reviewer's own blocks forged."""
    tmp = tmp_path_factory.mktemp("forged-vllm-mlx-e2e")
    home = tmp / "home"
    home.mkdir()
    agents = tmp / "agents.json"
    agents.write_text(json.dumps(LONG_AGENTS))
    model = tmp / "dense"
    _venv_kvsnap(vllm_mlx_python, home, "demo-model", model)
    r = _venv_kvsnap(
        vllm_mlx_python, home, "build", agents, "--model", model, "--out", tmp / "store", "--json"
    )
    n_tokens = {e["name"]: e["n_tokens"] for e in json.loads(r.stdout)["entries"]}
    assert min(n_tokens.values()) > 128, n_tokens
    forge_agent(tmp / "store", "reviewer")
    store = Store.open(tmp / "store")
    files = {store.inspect(p).name: p for p in store.snapshot_files()}
    return {"python": str(vllm_mlx_python), "model": str(model), "store": tmp / "store"} | {
        "n": n_tokens,
        "files": files,
    }


def _vllm_mlx_answers(w: dict, cmd: list[str], tmp_path: Path, tag: str, env=None) -> tuple:
    home = tmp_path / f"home-{tag}"
    home.mkdir()
    server = vllm_launch(cmd, home, tmp_path / f"{tag}.log", env)
    try:
        server.wait_ready(180)
        # The good agent first: a forged entry would fail the batch of any request after it.
        answers = {
            a["name"]: vllm_ask(server, w["model"], "Check the tests first.", 12, a["messages"][0])
            for a in LONG_AGENTS[::-1]
        }
    finally:
        server.stop()
    return answers, server.log()


@pytest.mark.slow
def test_regression_vllm_mlx_serve_skips_a_forged_snapshot_and_answers_it_cold(
    forged_for_vllm_mlx, tmp_path
):
    from kvsnap.blas import find_openblas

    w = forged_for_vllm_mlx
    serve = [w["python"], "-m", "kvsnap", "vllm-mlx", "serve", w["model"], "--continuous-batching"]
    warm, log = _vllm_mlx_answers(w, [*serve, "--kv-snapshots", str(w["store"])], tmp_path, "warm")
    skipped = [line for line in log.splitlines() if "skipped snapshot" in line]
    assert len(skipped) == 1 and str(w["files"]["reviewer"]) in skipped[0], log[-3000:]
    assert SHAPE_WHY in skipped[0], skipped
    assert warm["planner"]["cached_tokens"] == w["n"]["planner"], log[-3000:]  # still hits
    assert warm["reviewer"]["cached_tokens"] < w["n"]["reviewer"] // 2, log[-3000:]
    blas = find_openblas()
    cold, _ = _vllm_mlx_answers(
        w,
        [w["python"], "-m", "vllm_mlx.cli", "serve", w["model"], "--continuous-batching"],
        tmp_path,
        "cold",
        {"LD_PRELOAD": blas} if blas else None,
    )
    assert {n: a["text"] for n, a in warm.items()} == {n: a["text"] for n, a in cold.items()}
