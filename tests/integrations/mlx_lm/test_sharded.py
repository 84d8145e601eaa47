"""A sharded mlx_lm.server (``mlx.launch -n 2 --backend ring`` over 127.0.0.1) warm from one store:
tensor parallel on a dense qwen3, pipeline on a hybrid qwen3_next of unequal stages; stores
built by one process and by two ranks, each served both ways; answers equal to a cold sharded
server; a damaged copy on one rank; evictions in step; a topology the snapshots cannot take."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.cli import build_args, run_kvsnap
from helpers.mlx_lm_route import AGENTS, SYSTEMS, _ask, _same_answers
from helpers.sharded import run_sharded, serve_sharded

pytestmark = pytest.mark.slow

READ_LINE = re.compile(r"rank (\d) of 2 \((tensor parallel|pipeline[^)]*)\) read ([\d.]+) MiB")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A dense qwen3 (2 KV heads: one per tensor-parallel rank) and a 3-layer hybrid qwen3_next
    (pipeline stages of 2 and 1 layers), each with a store built by one process."""
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    root = tmp_path_factory.mktemp("sharded")
    agents = root / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    models = {
        "dense": make_demo_model(root / "dense", DemoSpec(arch="dense")),
        "hybrid": make_demo_model(root / "hybrid3", DemoSpec(arch="hybrid", layers=3)),
    }
    stores = {}
    for name, model in models.items():
        stores[name] = root / f"store-{name}"
        r = run_kvsnap(*build_args(agents, model, stores[name], "--for", "mlx-lm"))
        assert r.returncode == 0, r.stderr
    return {"root": root, "agents": agents, "models": models, "stores": stores}


def _answers(server, max_tokens: int = 8) -> list[dict]:
    server.wait_ready(300)
    return [_ask(server, agent, "Please review the server code.", max_tokens) for agent in SYSTEMS]


def _served(model, extra: list[str], log: Path, env: dict | None = None) -> tuple[list, str]:
    launched = serve_sharded(model, extra, log, env=env)
    try:
        return _answers(launched.server), launched.server.log()
    finally:
        launched.stop()


def _prefix_tokens(store: Path) -> list[int]:
    """Each agent's warm prefix length, from the store's records (agents' order)."""
    records = json.loads((store / "manifest.json").read_text())["records"]
    entries = {e["name"]: e for rec in records.values() for e in rec["entries"]}
    return [entries[a["name"]]["n_tokens"] for a in AGENTS]


def _store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*.safetensors"))


@pytest.fixture(scope="module")
def cold(world):
    """What a cold sharded mlx_lm.server answers, per model."""
    out = {}
    root = world["root"]
    out["dense"] = _served(world["models"]["dense"], [], root / "cold-dense.log")[0]
    out["hybrid"] = _served(world["models"]["hybrid"], ["--pipeline"], root / "cold-h.log")[0]
    return out


@pytest.mark.parametrize("name,extra", [("dense", []), ("hybrid", ["--pipeline"])])
def test_a_store_built_by_one_process_starts_both_ranks_warm_answering_as_cold(
    world, cold, name, extra, tmp_path
):
    store = world["stores"][name]
    warm, log = _served(
        world["models"][name], [*extra, "--kv-snapshots", str(store)], tmp_path / "warm.log"
    )
    # the first request of every agent hits its whole prefix, and answers as a cold server does
    assert [a["cached"] for a in warm] == _prefix_tokens(store)
    _same_answers(warm, cold[name])
    # each rank read only its slice: under tensor parallelism about half the store each
    reads = {int(r): float(mib) * 2**20 for r, _, mib in READ_LINE.findall(log)}
    assert sorted(reads) == [0, 1], log[-3000:]
    if name == "dense":
        for nbytes in reads.values():
            assert nbytes <= _store_bytes(store) / 2 + 64 * 1024
    assert sum(reads.values()) <= _store_bytes(store) + 128 * 1024
    # blocks carry row digests: nothing was read whole
    assert log.count("(0 read whole)") == 2, log[-3000:]
    # rank 0 alone serves HTTP; the other follows its requests
    assert log.count("Starting httpd") == 1


def test_a_store_built_by_two_ranks_equals_a_single_build_and_serves_one_process(world, tmp_path):
    store = tmp_path / "sharded-store"
    rc, out = run_sharded(
        [*build_args(world["agents"], world["models"]["dense"], store, "--for", "mlx-lm")]
    )
    assert rc == 0 and "2 built" in out, out[-3000:]
    single = world["stores"]["dense"]
    names = sorted(p.relative_to(store).as_posix() for p in store.rglob("*.safetensors"))
    # the same keys: records, blocks
    assert names == sorted(p.relative_to(single).as_posix() for p in single.rglob("*.safetensors"))
    import mlx.core as mx

    for rel in names:
        if rel.startswith("blocks/"):
            a, b = mx.load(str(store / rel)), mx.load(str(single / rel))
            assert sorted(a) == sorted(b)
            for k in a:
                assert mx.allclose(a[k], b[k], atol=1e-4).item(), (rel, k)
    r = run_kvsnap("verify", store)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_store_built_by_two_ranks_serves_one_process_warm(world, tmp_path):
    from helpers.mlx_lm_route import _kvsnap_mlx_lm, _launch

    store = tmp_path / "sharded-store"
    rc, out = run_sharded(
        [*build_args(world["agents"], world["models"]["dense"], store, "--for", "mlx-lm")]
    )
    assert rc == 0, out[-3000:]
    server = _launch(
        _kvsnap_mlx_lm(str(world["models"]["dense"]), "--kv-snapshots", str(store)),
        tmp_path / "one.log",
    )
    try:
        server.wait_ready(300)
        warm = [_ask(server, a, "Please review the server code.") for a in SYSTEMS]
    finally:
        server.stop()
    assert [a["cached"] for a in warm] == _prefix_tokens(store)


def test_a_damaged_copy_on_one_rank_is_skipped_on_every_rank_with_one_warning(world, tmp_path):
    store = world["stores"]["dense"]
    records = json.loads((store / "manifest.json").read_text())["records"]
    reviewer = next(
        e for rec in records.values() for e in rec["entries"] if e["name"] == "reviewer"
    )
    from kvsnap.store.local import Store

    info = Store.open(store).inspect(store / reviewer["file"])
    block = f"blocks/{info.chain.blocks[0][0]}.safetensors"
    warm, log = _served(
        world["models"]["dense"],
        ["--kv-snapshots", str(store)],
        tmp_path / "damaged.log",
        env={"KVSNAP_FAULT_DAMAGED_COPY": f"1:{block}"},
    )
    # the reviewer is cold on both ranks (a hit on one and a miss on the other would hang):
    # only the few template tokens it shares with the planner's warm entry are cached
    prefixes = _prefix_tokens(store)
    assert warm[0]["cached"] < 16 < prefixes[0] and warm[1]["cached"] == prefixes[1]
    warnings = re.findall(r"rank 1 cannot use snapshot (\S+) \((.*)\): skipped on every rank", log)
    assert len(warnings) == 1 and warnings[0][0].endswith(reviewer["file"]), log[-3000:]
    assert block.split("/")[1] in warnings[0][1]


def test_warm_prompts_prefill_sharded_write_once_and_the_next_start_prefills_nothing(
    world, tmp_path
):
    store = tmp_path / "empty-store"
    extra = ["--kv-snapshots", str(store), "--warm-prompts", str(world["agents"])]
    first, log = _served(world["models"]["dense"], extra, tmp_path / "first.log")
    assert "0 from snapshots, 2 prefilled" in log, log[-3000:]
    # written once, under the single-process keys
    single = world["stores"]["dense"]
    assert sorted(p.name for p in (store / "snapshots").iterdir()) == sorted(
        p.name for p in (single / "snapshots").iterdir()
    )
    assert not list(store.glob(".kvsnap-rank-probe-*"))
    second, log = _served(world["models"]["dense"], extra, tmp_path / "second.log")
    assert "2 from snapshots, 0 prefilled" in log, log[-3000:]
    assert [a["cached"] for a in second] == _prefix_tokens(single)
    _same_answers(second, first)


def test_evictions_stay_in_step_across_unequal_pipeline_stages(world, cold, tmp_path):
    """Rank 0 holds the attention layer (its cache grows with tokens), rank 1 only SSM state: by
    their own bytes rank 0 would evict what rank 1 keeps, and the next request on that prefix
    would hit on one rank and miss on the other."""
    launched = serve_sharded(
        world["models"]["hybrid"],
        ["--pipeline", "--prompt-cache-bytes", "600000"],
        tmp_path / "evict.log",
    )
    try:
        server = launched.server
        server.wait_ready(300)
        turns = []
        for user in ("first question", "a second, different question", "first question"):
            turns.append(_ask(server, "reviewer", user, 4))
            turns.append(_ask(server, "planner", user, 4))
        log = server.log()
        assert server.proc.poll() is None, log[-3000:]
    finally:
        launched.stop()
    assert "Prompt Cache" in log
    # answers equal whatever was evicted: the third round asks the first round again
    assert [t["ids"] for t in turns[:2]] == [t["ids"] for t in turns[4:]]


def test_kvsnap_serve_and_vllm_mlx_refuse_two_ranks_in_one_line(world, tmp_path):
    rc, out = run_sharded(["serve", "--model", str(world["models"]["dense"])])
    assert "kvsnap serve runs as one process, not as 2 mlx.launch ranks" in out, out[-2000:]
    assert "kvsnap mlx-lm serve" in out and "Traceback" not in out
    rc, out = run_sharded(["vllm-mlx", "serve", str(world["models"]["dense"])])
    assert "vllm-mlx has no sharded mode" in out and "Traceback" not in out, out[-2000:]


def test_a_rank_that_cannot_take_a_tensor_parallel_topology_ends_the_launch(world, tmp_path):
    """The hybrid qwen3_next has no tensor-parallel sharding in mlx-lm: the launch ends with one
    line saying so, and writes nothing."""
    store = tmp_path / "store"
    rc, out = run_sharded(
        [*build_args(world["agents"], world["models"]["hybrid"], store, "--for", "mlx-lm")]
    )
    assert "does not support tensor parallelism" in out, out[-2000:]
    assert "Traceback" not in out
    assert not list(store.rglob("*.safetensors"))


@pytest.mark.parametrize("name,extra", [("dense", []), ("hybrid", ["--pipeline"])])
def test_a_store_built_by_two_ranks_serves_two_ranks_warm_answering_as_cold(
    world, cold, name, extra, tmp_path
):
    """Built sharded (heads or layers gathered to rank 0), the store has the single build's
    names and tensors within float tolerance, and starts a sharded server warm."""
    import mlx.core as mx

    store = tmp_path / "sharded-store"
    rc, out = run_sharded(
        [*build_args(world["agents"], world["models"][name], store, "--for", "mlx-lm"), *extra]
    )
    assert rc == 0 and "2 built" in out, out[-3000:]
    single = world["stores"][name]
    names = sorted(p.relative_to(store).as_posix() for p in store.rglob("*.safetensors"))
    assert names == sorted(p.relative_to(single).as_posix() for p in single.rglob("*.safetensors"))
    for rel in (n for n in names if not n.startswith("snapshots/")):
        a, b = mx.load(str(store / rel)), mx.load(str(single / rel))
        assert sorted(a) == sorted(b)
        assert all(mx.allclose(a[k], b[k], atol=1e-4).item() for k in a), rel
    warm, _ = _served(
        world["models"][name], [*extra, "--kv-snapshots", str(store)], tmp_path / "warm.log"
    )
    assert [a["cached"] for a in warm] == _prefix_tokens(store)
    _same_answers(warm, cold[name])
