"""Start-up reads each snapshot once and re-tokenizes no unchanged warm prompt."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from helpers.cli import build_args, run_kvsnap
from helpers.models import LONG_SYSTEM

AGENTS = [
    {"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]},
    {
        "name": "planner",
        "messages": [
            {
                "role": "system",
                "content": "You are a planner agent. Plan each task step by step. " * 4,
            }
        ],
    },
]


def _built_world(tmp_path, model, monkeypatch) -> dict:
    """AGENTS built on ``model`` into ``tmp_path``'s store, with the cache dir in ``tmp_path``."""
    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    r = run_kvsnap(
        *build_args(agents, model, tmp_path / "snaps"),
        env={"KVSNAP_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return {"model": model, "agents": agents, "store": tmp_path / "snaps"}


@pytest.fixture()
def world(demo_models, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(demo_models.path("dense"), model)
    return _built_world(tmp_path, model, monkeypatch)


def _config(world, with_prompts: bool = True):
    """The engine's config for a start on ``world``'s store, without write-back."""
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.runtime.engine.engine import EngineConfig

    agents = world["agents"]
    prompts = {"warm_prompts": load_warm_prompts(agents), "warm_prompts_file": str(agents)}
    return EngineConfig(
        model=str(world["model"]),
        snapshots=str(world["store"]),
        write_back=False,
        **(prompts if with_prompts else {}),
    )


def _start(world):
    from kvsnap.runtime.engine.engine import Engine

    engine = Engine(_config(world))
    engine.start()
    assert engine.wait_warm(120)
    return engine


def test_each_pinned_snapshot_is_opened_and_parsed_once_to_index_and_once_to_restore(
    world, monkeypatch
):
    import kvsnap.snapshot.file
    import kvsnap.snapshot.header
    import kvsnap.store.reading

    parses: list[str] = []
    real_parse = kvsnap.store.reading.parse_header

    def counting_parse(f, size):
        parses.append(f.name)
        return real_parse(f, size)

    def no_reread(*args, **kwargs):
        raise AssertionError("a snapshot file was re-read for its tokens")

    import kvsnap.store.fileio
    from kvsnap.store.local import Store
    from kvsnap.store.paths import chain_relpaths

    records = sorted(str(p) for p in (world["store"] / "snapshots").iterdir())
    store = Store.open(world["store"])
    parts = sorted(
        {
            str(world["store"] / rel)
            for r in records
            for rel in chain_relpaths(store.inspect(Path(r)))
        }
    )
    monkeypatch.setattr(kvsnap.store.reading, "parse_header", counting_parse)
    # restores read whole files there
    monkeypatch.setattr(kvsnap.store.fileio, "parse_header", counting_parse)
    monkeypatch.setattr(kvsnap.store.reading, "read_header", no_reread)
    monkeypatch.setattr(kvsnap.snapshot.header, "tensor_bytes", no_reread)
    engine = _start(world)
    try:
        status = engine.status()
        assert status["snapshots"]["loaded"] == 2 and status["snapshots"]["prefilled"] == 0
        # One pass over the records to index; to restore, one read of each block and checkpoint,
        # however many records share it (the records' preamble block is read once).
        assert sorted(parses) == sorted(records + parts)
    finally:
        engine.shutdown()


def test_unchanged_warm_prompts_reuse_their_recorded_tokens(world, monkeypatch):
    import kvsnap.warm_key

    calls = []
    real = kvsnap.warm_key.warm_prefix
    monkeypatch.setattr(
        kvsnap.warm_key,
        "warm_prefix",
        lambda *a, **k: calls.append(a) or real(*a, **k),
    )
    engine = _start(world)
    try:
        status = engine.status()
        assert calls == [] and status["warmup"]["recipes_reused"] == 2
        assert status["snapshots"]["loaded"] == 2 and status["snapshots"]["prefilled"] == 0
    finally:
        engine.shutdown()


def test_a_template_edit_falls_back_to_the_full_computation(world, monkeypatch):
    import kvsnap.warm_key

    config = world["model"] / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = "{{ '<|edited|>' }}" + data["chat_template"]
    config.write_text(json.dumps(data))
    calls = []
    real = kvsnap.warm_key.warm_prefix
    monkeypatch.setattr(
        kvsnap.warm_key,
        "warm_prefix",
        lambda *a, **k: calls.append(a) or real(*a, **k),
    )
    engine = _start(world)
    try:
        status = engine.status()
        assert len(calls) == 2 and status["warmup"]["recipes_reused"] == 0
        # the old snapshots no longer match: prefilled afresh
        assert status["snapshots"]["prefilled"] == 2
    finally:
        engine.shutdown()


def test_a_recipe_whose_tokens_do_not_give_the_key_is_not_trusted(world, monkeypatch):
    import kvsnap.warm_key
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.store.local import Store
    from kvsnap.warm_key import recorded_prefix

    identity = load_model(world["model"]).identity()
    info = Store.open(world["store"], readonly=True).scan(identity)[0][0]
    # a header whose tokens do not give its key
    forged = dataclasses.replace(info, tokens=info.tokens[:-1])
    monkeypatch.setattr(kvsnap.warm_key, "warm_recipe", lambda *a: "same-recipe")
    assert (
        recorded_prefix({"same-recipe": info}, None, info.prompt_digest, identity, "")
        == info.tokens
    )
    assert recorded_prefix({"same-recipe": forged}, None, info.prompt_digest, identity, "") is None


@pytest.fixture(params=["dense", "hybrid"])
def arch_world(request, demo_models, tmp_path, monkeypatch):
    return _built_world(tmp_path, demo_models.path(request.param), monkeypatch)


def _slow_load_and_count_reads(engine_holder, monkeypatch):
    """The model load takes a second; every snapshot read says whether the model was loaded yet."""
    import time

    import kvsnap.runtime.model.loading
    import kvsnap.store.fileio
    import kvsnap.store.reading

    reads = []
    real_load = kvsnap.runtime.model.loading.load_model
    real_read = kvsnap.store.reading.read_part

    def slow_load(*a, **k):
        time.sleep(1.0)
        return real_load(*a, **k)

    def read(*a, **k):  # every block or checkpoint the restore reads
        reads.append(engine_holder[0].loaded.is_set())
        return real_read(*a, **k)

    monkeypatch.setattr(kvsnap.runtime.model.loading, "load_model", slow_load)
    monkeypatch.setattr(kvsnap.store.reading, "read_part", read)
    return reads


def _answer(engine, tokens):
    from kvsnap.runtime.engine.engine import GenerationRequest

    st = engine.submit(GenerationRequest(tokens=tokens, max_tokens=16), lambda *a: None)
    assert st.done.wait(120)
    return st


def test_snapshots_restored_during_the_model_load_answer_like_a_cold_start(arch_world, monkeypatch):
    from kvsnap.chat import request_tokens
    from kvsnap.runtime.engine.engine import Engine, EngineConfig

    holder: list = []
    reads = _slow_load_and_count_reads(holder, monkeypatch)
    warm = Engine(_config(arch_world))
    holder.append(warm)
    warm.start()
    cold = Engine(EngineConfig(model=str(arch_world["model"])))
    cold.start()
    try:
        assert warm.wait_warm(120) and cold.wait_warm(120)
        # every block and checkpoint of both pinned snapshots was read while the model loaded
        assert reads and not any(reads)
        status = warm.status()
        assert status["snapshots"]["loaded"] == 2 and status["warmup"]["prefetch_seconds"] > 0
        tokens = request_tokens(
            warm.lm.tokenizer,
            AGENTS[0]["messages"] + [{"role": "user", "content": "Check the parser."}],
        )
        got, want = _answer(warm, tokens), _answer(cold, tokens)
        assert got.cached_tokens > 100 and want.cached_tokens == 0
        assert got.text == want.text and got.completion_tokens == want.completion_tokens
    finally:
        warm.shutdown()
        cold.shutdown()


def test_a_corrupt_snapshot_found_during_the_overlapped_read_is_rejected_and_prefilled(
    world, monkeypatch
):
    from kvsnap.snapshot.file import read_header
    from kvsnap.store.local import Store
    from kvsnap.store.paths import chain_relpaths

    record = sorted((world["store"] / "snapshots").iterdir())[0]
    # its own last block (or checkpoint)
    victim = world["store"] / chain_relpaths(Store.open(world["store"]).inspect(record))[-1]
    header = read_header(victim)
    layer = next(iter(header.tensors.values()))
    data = bytearray(victim.read_bytes())
    data[header.data_start + layer.start + 5] ^= 0xFF  # one byte of KV: only the checksum can tell
    victim.write_bytes(bytes(data))
    holder: list = []
    reads = _slow_load_and_count_reads(holder, monkeypatch)
    from kvsnap.runtime.engine.engine import Engine

    engine = Engine(_config(world))
    holder.append(engine)
    engine.start()
    try:
        assert engine.wait_warm(120)
        assert reads[:2] == [False, False]
        snaps = engine.status()["snapshots"]
        assert snaps["loaded"] == 1 and snaps["prefilled"] == 1 and snaps["rejected"] == 1
        assert (
            snaps["rejected_reasons"][0]["file"] == str(victim)
            and "checksum" in snaps["rejected_reasons"][0]["reason"]
        )
    finally:
        engine.shutdown()


def test_the_two_thread_read_gives_the_same_bytes_and_names_a_truncation(
    world, monkeypatch, tmp_path
):
    import mlx.core as mx

    import kvsnap.snapshot.file
    from kvsnap.errors import SnapshotError
    from kvsnap.store.local import Store

    store = Store.open(world["store"], readonly=True)
    info = store.scan()[0][0]
    one = store.load_arrays(info)
    # the tiny files take the two-thread path too
    monkeypatch.setattr(kvsnap.snapshot.file, "PARALLEL_READ_MIN", 1024)
    two = store.load_arrays(info)
    assert one.keys() == two.keys() and all(mx.array_equal(one[k], two[k]) for k in one)
    # A file cut short after it was indexed: named, never served.
    data = info.path.read_bytes()
    info.path.write_bytes(data[: len(data) - 100])
    with pytest.raises(SnapshotError, match="truncated"):
        store.load_arrays(info)


def _start_and_record(world, with_prompts: bool) -> dict:
    """One start on ``world``'s store: the header parses, part reads and every ``mx.eval`` made
    before the engine was warm, by the module that called it."""
    import sys

    import mlx.core as mx

    import kvsnap.store.fileio
    import kvsnap.store.reading
    from kvsnap.runtime.engine.engine import Engine

    seen: dict = {"parses": [], "reads": [], "evals": []}
    holder: list = []
    real_parse, real_read = kvsnap.store.reading.parse_header, kvsnap.store.reading.read_part
    real_eval = mx.eval

    def parse(f, size):
        seen["parses"].append(f.name)
        return real_parse(f, size)

    def read(*a, **k):
        seen["reads"].append(str(a[1:3]))
        return real_read(*a, **k)

    def evaluate(*a, **k):
        if holder and not holder[0].warm.is_set():
            seen["evals"].append(sys._getframe(1).f_globals.get("__name__", "?"))
        return real_eval(*a, **k)

    config = _config(world, with_prompts)
    with pytest.MonkeyPatch.context() as patch:  # undone before the next start
        patch.setattr(kvsnap.store.reading, "parse_header", parse)
        patch.setattr(kvsnap.store.fileio, "parse_header", parse)
        patch.setattr(kvsnap.store.reading, "read_part", read)
        patch.setattr(mx, "eval", evaluate)
        engine = Engine(config)
        holder.append(engine)
        engine.start()
        try:
            assert engine.wait_warm(120)
            snaps = engine.status()["snapshots"]
            assert (snaps["loaded"], snaps["prefilled"], snaps["rejected"]) == (2, 0, 0), snaps
        finally:
            engine.shutdown()
    return {k: sorted(v) for k, v in seen.items()}


def test_regression_kv_snapshots_alone_does_the_work_of_warm_prompts(arch_world):
    """``--kv-snapshots`` alone was slower to warm than with ``--warm-prompts``
    on the same store. Both starts parse, read and evaluate the same things, and before warm
    nothing is evaluated but the model load and the store's reads: the shape check learned from
    an evaluated one-token pass put the model's first pass (its kernel compiles, ~1 s at 0.6B)
    before warm on both. The kernel priming runs one before warm on both, inside mlx-lm."""
    alone = _start_and_record(arch_world, with_prompts=False)
    with_prompts = _start_and_record(arch_world, with_prompts=True)
    assert alone == with_prompts
    assert alone["parses"] and alone["reads"]
    computed = [m for m in alone["evals"] if not m.startswith(("kvsnap.store.", "mlx_lm."))]
    where = "outside the model load and the store's reads"
    assert computed == [], f"evaluated before warm {where}: {computed}"


def _primed_then_served(config, events: list) -> None:
    """Start an engine on ``config``; as soon as it says warm, submit a 2-token request while
    the priming is held until that submit has happened; record the order of it all."""
    import threading

    from kvsnap.runtime.engine import batch_runner
    from kvsnap.runtime.engine.engine import Engine, GenerationRequest

    submitted = threading.Event()
    real = batch_runner.BatchRunner.prime_kernels
    engine = Engine(config)

    def prime(self):
        events.append(("prime", engine.warm.is_set()))
        assert submitted.wait(60), "the test never submitted its request"
        real(self)
        events.append(("primed", None))

    def on_event(state, kind, payload):
        if kind == "token" and ("token", None) not in events:
            events.append(("token", None))

    batch_runner.BatchRunner.prime_kernels = prime
    try:
        engine.start()
        assert engine.wait_warm(120)
        state = engine.submit(GenerationRequest(tokens=[5, 6], max_tokens=2), on_event)
        submitted.set()
        assert state.done.wait(120)
        assert state.finish_reason in ("length", "stop"), state.finish_reason
    finally:
        batch_runner.BatchRunner.prime_kernels = real
        submitted.set()
        engine.shutdown()


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_the_kernel_priming_runs_after_warm_and_before_the_first_request(
    demo_models, tmp_path, monkeypatch, arch
):
    """Issue 41: /health waited for the kernel priming (two model passes) before turning 200.
    It now runs after warm, and the engine takes no request before it has finished: a request
    sent the moment the engine says warm (here, while the priming is held) gets its first
    token after the priming, so it never pays mlx's kernel compile (1-3 s on a hybrid)."""
    from kvsnap.runtime.engine.engine import EngineConfig

    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    events: list = []
    _primed_then_served(EngineConfig(model=str(demo_models.path(arch))), events)
    assert events == [("prime", True), ("primed", None), ("token", None)], events


def test_the_kernel_priming_runs_for_a_start_from_snapshots_only(world, monkeypatch):
    """A start from snapshots has run no model pass either: it primes too, after warm; a
    start whose warm-up prefilled its warm prompts (no store) needs no priming."""
    from kvsnap.runtime.engine import batch_runner
    from kvsnap.runtime.engine.engine import Engine

    events: list = []
    _primed_then_served(_config(world), events)
    assert events == [("prime", True), ("primed", None), ("token", None)], events
    seen: list[bool] = []
    monkeypatch.setattr(batch_runner.BatchRunner, "prime_kernels", lambda self: seen.append(True))
    engine = Engine(dataclasses.replace(_config(world), snapshots=None))
    engine.start()
    try:
        assert engine.wait_warm(120)
        assert engine.status()["snapshots"]["prefilled"] == 2
    finally:
        engine.shutdown()
    assert seen == [], seen


def test_weights_read_after_warm_answer_as_weights_read_at_load(arch_world):
    """`kvsnap serve`'s start (``weights_after_warm``): the weights are mapped at load, so the
    engine is warm before they are read, and the engine thread reads them before its first
    request. Its answers are an eagerly loaded engine's, token for token, from snapshots and
    cold."""
    from kvsnap.chat import request_tokens
    from kvsnap.runtime.engine.engine import Engine

    config = _config(arch_world)
    lazy = Engine(dataclasses.replace(config, weights_after_warm=True))
    eager = Engine(config)
    # One engine at a time until both serve: a prefetch's unfilled buffers on one engine's
    # thread beside the other's mx.clear_cache hang the process (fileio.unfilled_buffer).
    lazy.start()
    try:
        assert lazy.wait_warm(120) and lazy.serving_started.wait(120) and lazy.failed is None
        eager.start()
        assert eager.wait_warm(120) and eager.serving_started.wait(120)
        for messages in (
            AGENTS[0]["messages"] + [{"role": "user", "content": "Check the parser."}],
            [{"role": "user", "content": "Say something else entirely."}],
        ):
            tokens = request_tokens(lazy.lm.tokenizer, messages)
            got, want = _answer(lazy, tokens), _answer(eager, tokens)
            assert got.finish_reason == want.finish_reason != "error", got.finish_reason
            assert (got.text, got.cached_tokens) == (want.text, want.cached_tokens)
    finally:
        lazy.shutdown()
        eager.shutdown()


def test_weights_unreadable_after_warm_end_the_engine_with_the_error(
    demo_models, tmp_path, monkeypatch
):
    """A weight file that cannot be read when the engine thread reads it (here truncated
    after the load mapped it) ends the engine as a failed warm-up does: ``failed`` names it,
    a request gets an error (never a hang), and nothing more is served."""
    import kvsnap.runtime.model.loading as loading
    from kvsnap.runtime.engine.engine import Engine, EngineConfig, GenerationRequest

    model = tmp_path / "model"
    shutil.copytree(demo_models.path("dense"), model)
    weights = next(model.glob("*.safetensors"))
    real_load = loading.load_model

    def load_then_truncate(*args, **kwargs):
        lm = real_load(*args, **kwargs)
        with open(weights, "r+b") as f:  # after the header and sizes were checked
            f.truncate(weights.stat().st_size // 2)
        return lm

    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "load_model", load_then_truncate)
    engine = Engine(EngineConfig(model=str(model), weights_after_warm=True))
    engine.start()
    try:
        assert engine.serving_started.wait(120)
        assert engine.failed is not None
        st = engine.submit(GenerationRequest(tokens=[1, 2, 3], max_tokens=4), lambda *a: None)
        assert st.done.wait(30) and st.finish_reason == "error"
    finally:
        engine.shutdown()


def test_a_prefetch_started_before_the_engine_is_all_the_engine_reads(world, monkeypatch):
    """`kvsnap serve` starts the snapshot prefetch before it imports mlx-lm and makes the
    engine (``startup.start_prefetch``): the engine takes that prefetch and its pool, reads no
    snapshot part again, and answers as a cold start does."""
    import kvsnap.store.reading
    from kvsnap.chat import request_tokens
    from kvsnap.runtime.engine.engine import Engine, EngineConfig
    from kvsnap.runtime.engine.startup import start_prefetch

    reads: list = []
    real_read = kvsnap.store.reading.read_part

    def read(*a, **k):
        reads.append(a)
        return real_read(*a, **k)

    monkeypatch.setattr(kvsnap.store.reading, "read_part", read)
    config = _config(world)
    early = start_prefetch(config)
    pool, prefetched = early
    assert prefetched.result(120) is not None
    read_early = len(reads)
    assert read_early > 0 and pool.nbytes > 0
    warm = Engine(config, early_prefetch=early)
    cold = Engine(EngineConfig(model=str(world["model"])))
    warm.start()
    cold.start()
    try:
        assert warm.wait_warm(120) and cold.wait_warm(120)
        assert len(reads) == read_early, "the engine read snapshot parts again"
        assert warm.status()["snapshots"]["loaded"] == 2
        tokens = request_tokens(
            warm.lm.tokenizer,
            AGENTS[0]["messages"] + [{"role": "user", "content": "Check the parser."}],
        )
        got, want = _answer(warm, tokens), _answer(cold, tokens)
        assert got.cached_tokens > 100 and want.cached_tokens == 0
        assert got.text == want.text
    finally:
        warm.shutdown()
        cold.shutdown()
