"""Refactors change no byte: for the same inputs, keys, tensor bytes and every header field but
``kvsnap.recorded`` (and the checksum that covers it) of every record, block and checkpoint
equal the baseline (tests/fixtures/golden/summary.json, written by ``tests/golden_summary.py
--write`` when the format 3 block store landed, issue 17); and a store written before blocks
(format 2, at 18e6c05: fixtures/golden/store-dense) still loads, hits and answers like a cold server."""

from __future__ import annotations

import json
import shutil
from importlib.metadata import version

import httpx
import pytest
from conftest import run_kvsnap
from golden_summary import store_summary

from kvsnap.tools.serverproc import start_server

FIXTURES = __import__("pathlib").Path(__file__).with_name("fixtures") / "golden"
GOLDEN = json.loads((FIXTURES / "summary.json").read_text())
# golden store name -> (demo model in conftest.MODEL_SPECS, extra build flags)
CASES = {"dense": ("dense", []), "hybrid": ("hybrid", []), "sliding": ("sliding", []), "dense-q8": ("dense", ["--kv-bits", "8"])}


def _same_numerics() -> bool:
    """Tensor bytes are compared only under the mlx that made them: another mlx may round differently."""
    return version("mlx") == GOLDEN["mlx"] and version("mlx-lm") == GOLDEN["mlx_lm"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_rebuild_writes_the_golden_keys_headers_and_tensor_bytes(case, demo_models, tmp_path, isolated_cache):
    model, flags = CASES[case]
    store = tmp_path / "store"
    r = run_kvsnap("build", FIXTURES / "agents.json", "--model", demo_models.path(model), "--out", store, *flags, env={"KVSNAP_CACHE_DIR": str(isolated_cache)})
    assert r.returncode == 0, r.stdout + r.stderr
    got, want = store_summary(store), GOLDEN["stores"][case]
    assert sorted(got) == sorted(want), "snapshot keys changed: a refactor must not change what a key covers"
    for key, snap in want.items():
        assert got[key]["meta"] == snap["meta"], f"{case}/{key}: a header field changed"
        shapes = {name: (t["dtype"], t["shape"]) for name, t in got[key]["tensors"].items()}
        assert shapes == {name: (t["dtype"], t["shape"]) for name, t in snap["tensors"].items()}, f"{case}/{key}: tensor names, dtypes or shapes changed"
        if _same_numerics():
            assert got[key]["tensors"] == snap["tensors"], f"{case}/{key}: tensor bytes changed"


def test_the_golden_summary_sees_a_changed_byte(tmp_path):
    """The comparison above would notice one flipped byte of tensor data."""
    store = tmp_path / "store"
    shutil.copytree(FIXTURES / "store-dense", store)
    before = store_summary(store)
    path = next((store / "snapshots").glob("*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    after = store_summary(store)
    assert after[path.stem]["tensors"] != before[path.stem]["tensors"]


def test_a_store_written_before_issue_16_loads_hits_and_answers_like_a_cold_server(demo_models, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(FIXTURES / "store-dense", store)  # never touch the checked-in copy
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    r = run_kvsnap("verify", store, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    model = demo_models.path("dense")
    agents = json.loads((FIXTURES / "agents.json").read_text())
    warm = start_server(model, ["--continuous-batching", "--warm-prompts", str(FIXTURES / "agents.json"), "--kv-snapshots", str(store)], tmp_path / "warm.log", env=env, limit_s=300)
    cold = start_server(model, ["--continuous-batching"], tmp_path / "cold.log", env=env, limit_s=300)
    try:
        warm.wait_ready(120)
        cold.wait_ready(120)
        with httpx.Client(timeout=120) as client:
            report = client.get(f"{warm.url}/v1/status").json()["snapshots"]
            served = client.get(f"{warm.url}/v1/models").json()["data"][0]["id"]
            assert (report["loaded"], report["prefilled"], report["rejected"]) == (2, 0, 0), report
            for agent in agents:
                body = {"model": served, "messages": agent["messages"] + [{"role": "user", "content": "What now?"}], "max_tokens": 12, "temperature": 0}
                if "tools" in agent:
                    body["tools"] = agent["tools"]
                got, want = (client.post(f"{url}/v1/chat/completions", json=body) for url in (warm.url, cold.url))
                assert got.status_code == want.status_code == 200, got.text + want.text
                got, want = got.json(), want.json()
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    finally:
        warm.stop()
        cold.stop()
