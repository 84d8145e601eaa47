"""A store whose blocks were rewritten with another head dim never breaks
serving. A block's key does not hash its data, so an attacker rewrites the tensors and a fresh
checksum and the store still passes ``verify``, ``pack`` and ``unpack``. Served, the bad state
used to fail the whole batch step: every request in it got 500 and the entry was never dropped.

Real files, the real build, a real ``kvsnap serve`` on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
from helpers.cli import run_kvsnap
from helpers.forged import SYSTEMS, _agents, forge_agent
from helpers.stores import build_store

from kvsnap.store.local import Store

UNRELATED = [
    {"role": "system", "content": "Translate what follows into plain words."},
    {"role": "user", "content": "the cat sat"},
]


def _request(name: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEMS[name]},
        {"role": "user", "content": "Check the tests first."},
    ]


@pytest.fixture(scope="module")
def forged(demo_models, tmp_path_factory) -> dict:
    """A dense store of alpha, beta, gamma with alpha's and gamma's own blocks forged."""
    lm = demo_models.load("dense")
    tmp = tmp_path_factory.mktemp("forged")
    root = build_store(lm, tmp / "store", _agents(SYSTEMS))
    # alpha is pinned at warm-up; gamma, named by no warm prompt, loads on first hit
    warm = tmp / "warm.json"
    warm.write_text(json.dumps(_agents(["alpha", "beta"])))
    return {
        "root": root,
        "warm": warm,
        "alpha": forge_agent(root, "alpha"),
        "gamma": forge_agent(root, "gamma"),
        "model": demo_models.path("dense"),
    }


def test_forged_head_dim_blocks_still_pass_verify_without_a_model(forged):
    """What a store alone can prove: the forged blocks are self-consistent (the server must check
    shapes)."""
    r = run_kvsnap("verify", forged["root"])
    assert r.returncode == 0, r.stdout + r.stderr


def test_verify_with_the_model_names_the_forged_block_shapes(forged):
    r = run_kvsnap("verify", forged["root"], "--model", forged["model"])
    assert r.returncode == 1, r.stdout + r.stderr
    bad = [line for line in r.stdout.splitlines() if line.startswith("BAD")]
    assert len(bad) == 2 and all(
        "this model's cache holds float32[1, 2, T, 64]" in line for line in bad
    ), r.stdout
    assert "1 ok, 2 bad" in r.stdout, r.stdout


def _chat(client: httpx.Client, url: str, messages: list[dict]) -> httpx.Response:
    return client.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0},
    )


def _serve_all(model: Path, flags: list[str], log: Path) -> tuple[dict, dict]:
    """Answers to alpha's request alone, then gamma's and an unrelated request at once; and
    /v1/status."""
    from kvsnap.tools.serverproc import start_server

    server = start_server(
        model, ["--continuous-batching", "--served-model-name", "m", *flags], log, limit_s=300
    )
    try:
        server.wait_ready(120)
        out: dict = {}
        with httpx.Client(timeout=120) as client:
            out["alpha"] = _chat(client, server.url, _request("alpha"))

            def send(key: str, messages: list[dict]) -> None:
                out[key] = _chat(client, server.url, messages)

            threads = [
                threading.Thread(target=send, args=a)
                for a in (("gamma", _request("gamma")), ("unrelated", UNRELATED))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(150)
        return out, server.status()
    finally:
        server.stop()


def test_regression_forged_head_dim_blocks_are_dropped_and_never_fail_a_batch(forged, tmp_path):
    flags = [
        "--warm-prompts",
        str(forged["warm"]),
        "--kv-snapshots",
        str(forged["root"]),
        "--no-write-back",
    ]
    answers, status = _serve_all(forged["model"], flags, tmp_path / "forged.log")
    cold, _ = _serve_all(forged["model"], [], tmp_path / "cold.log")
    for key in ("alpha", "gamma", "unrelated"):
        assert answers[key].status_code == 200, (
            key,
            answers[key].text,
            (tmp_path / "forged.log").read_text()[-3000:],
        )
        got, want = answers[key].json(), cold[key].json()
        assert (
            got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        ), key
    rejected = status["snapshots"]["rejected_reasons"]
    names = {Path(r["file"]).name for r in rejected}
    store = Store.open(forged["root"])
    by_name = {store.inspect(p).name: p.name for p in store.snapshot_files()}
    assert {by_name["alpha"], by_name["gamma"]} <= names, rejected
    assert all("this model's cache holds" in r["reason"] for r in rejected), rejected
    # alpha prefilled, beta restored
    assert status["warmup"]["prefilled"] == 1 and status["warmup"]["from_snapshots"] == 1
    assert status["cache"]["load_errors"] >= 1  # gamma, dropped on its first hit


def test_verify_with_the_model_reports_another_models_records_and_exits_0(demo_models, tmp_path):
    """A sound store that also holds another model's records made `verify
    --model` exit 1."""
    root = build_store(
        demo_models.load("dense"), tmp_path / "store", _agents(["alpha"]), tmp_path / "a.json"
    )
    build_store(demo_models.load("mistral"), root, _agents(["beta"]), tmp_path / "b.json")
    r = run_kvsnap("verify", root, "--model", demo_models.path("dense"))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert sum(line.startswith("ok ") for line in lines) == 1 and any(
        line.startswith("other ") and "beta: built for another model" in line for line in lines
    ), r.stdout
    assert r.stdout.splitlines()[-1] == "1 ok, 0 bad, 1 for another model", r.stdout
