"""`kvsnap mlx-lm serve` says, per agent, when a snapshot was built for another tokenization.

A store built `--for vllm-mlx`, or for mlx_lm.server with other `--chat-template-args`, or
for kvsnap serve while the server adds `--chat-template-args`, may hold tokens the server's
requests do not start with: each such agent gets one warning naming both profiles and the
build command that fits. Real servers on 127.0.0.1 (started, read, stopped), real stores.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers import mlx_lm_route as mlx_lm_tests
from helpers.cli import run_kvsnap

NO_THINKING = '{"enable_thinking": false}'


def _build(agents, model, out, *profile: str) -> None:
    r = run_kvsnap("build", agents, "--model", model, "--out", out, *profile, "--json")
    assert r.returncode == 0, r.stdout + r.stderr


def _start_log(cmd: list[str], log) -> str:
    """The log of a server started until its port opens, then stopped."""
    server = mlx_lm_tests._launch(cmd, log)
    try:
        server.wait_ready(180)
    finally:
        server.stop()
    return server.log()


def _agent_warnings(log: str) -> dict[str, str]:
    found = re.findall(r"\[kvsnap\] (reviewer|planner): snapshot \S+ (was built for .*)", log)
    return dict(found)


@pytest.fixture(scope="module")
def stores(demo_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("profiles")
    agents = root / "agents.json"
    agents.write_text(json.dumps(mlx_lm_tests.AGENTS))
    model = str(demo_models.path("dense"))
    for name, profile in (
        ("vllm", ("--for", "vllm-mlx")),
        ("mlx", ("--for", "mlx-lm")),
        ("kvsnap", ()),
    ):
        _build(agents, model, root / name, *profile)
    return root, agents, model


@pytest.mark.parametrize(
    "store, server_args, built, fix",
    [
        ("vllm", [], "vllm-mlx's (encoded with", "`kvsnap build … --for mlx-lm`"),
        (
            "mlx",
            ["--chat-template-args", NO_THINKING],
            "mlx-lm's (encoded without",
            f"`kvsnap build … --for mlx-lm --chat-template-args '{NO_THINKING}'`",
        ),
        (
            "kvsnap",
            ["--chat-template-args", NO_THINKING],
            "kvsnap serve's",
            f"`kvsnap build … --for mlx-lm --chat-template-args '{NO_THINKING}'`",
        ),
    ],
    ids=["vllm-mlx-store", "other-template-args", "kvsnap-store-with-args"],
)
def test_a_store_built_for_another_profile_warns_once_per_agent(
    stores, store, server_args, built, fix, tmp_path
):
    root, _, model = stores
    cmd = mlx_lm_tests._kvsnap_mlx_lm(model, "--kv-snapshots", str(root / store), *server_args)
    log = _start_log(cmd, tmp_path / "serve.log")
    warned = _agent_warnings(log)
    assert sorted(warned) == ["planner", "reviewer"], log[-3000:]
    for text in warned.values():
        assert text.startswith(f"was built for {built}"), text
        assert "this mlx_lm.server tokenizes as mlx-lm's" in text and fix in text, text
    assert mlx_lm_tests._warmup(log) == (2, 0), log[-3000:]  # pinned anyway


@pytest.mark.parametrize("store, server_args", [("mlx", []), ("kvsnap", [])])
def test_a_store_built_for_this_servers_rendering_pins_without_warning(
    stores, store, server_args, tmp_path
):
    root, _, model = stores
    cmd = mlx_lm_tests._kvsnap_mlx_lm(model, "--kv-snapshots", str(root / store), *server_args)
    log = _start_log(cmd, tmp_path / "serve.log")
    assert _agent_warnings(log) == {} and mlx_lm_tests._warmup(log) == (2, 0), log[-3000:]


def test_warm_prompts_prefill_an_agent_built_for_vllm_mlx_with_a_warning(tmp_path):
    """Llama-3's tokenizer adds BOS on encode: vllm-mlx's tokens differ, so each is prefilled."""
    model = str(mlx_lm_tests._llama_demo(tmp_path / "llama"))
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(mlx_lm_tests.AGENTS))
    _build(agents, model, tmp_path / "s", "--for", "vllm-mlx")
    cmd = mlx_lm_tests._kvsnap_mlx_lm(
        model, "--kv-snapshots", str(tmp_path / "s"), "--warm-prompts", str(agents)
    )
    log = _start_log(cmd, tmp_path / "serve.log")
    warned = _agent_warnings(log)
    assert sorted(warned) == ["planner", "reviewer"], log[-3000:]
    for text in warned.values():
        assert text.startswith("was built for vllm-mlx's (encoded with"), text
        assert "`kvsnap build … --for mlx-lm`; prefilling instead" in text, text
    assert mlx_lm_tests._warmup(log) == (0, 2), log[-3000:]


@pytest.mark.parametrize(
    "option", [["--chat-template", "{{ messages }}"], ["--use-default-chat-template"]]
)
def test_a_chat_template_other_than_the_models_own_is_refused(stores, option, tmp_path):
    """The snapshots hold the model's own template's tokens: another template never hits."""
    root, _, model = stores
    cmd = ["mlx-lm", "serve", "--model", model, "--kv-snapshots", root / "mlx", *option]
    r = run_kvsnap(*cmd, "--port", "1", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"drop {option[0]} (the snapshots hold the model's own chat" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
