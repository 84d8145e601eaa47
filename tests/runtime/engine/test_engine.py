"""The engine in process, on tiny dense and hybrid demo models.

The oracle for every answer is an engine with no snapshots, no warm prompts and no prefix
cache (``cache_memory_mb=0``), serving one request at a time: a fresh full prefill.
Greedy, 32 tokens; text and token count must match exactly.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.engine import assert_served_from_the_exact_snapshot_state, warm_entry
from helpers.models import LONG_SYSTEM

from kvsnap.blas import find_openblas

MAX_TOKENS = 32
PLANNER = (
    "You are a planner agent. Plan each task step by step, check the goal, list the tools you "
    "would call. " * 3
)
AGENTS = [
    {"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]},
    {
        "name": "planner",
        "messages": [
            {"role": "system", "content": PLANNER},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hello, what are we planning today?"},
        ],
    },
]
QUESTIONS = ["check the server code for errors", "hello world, plan the next step"]
ARCHES = ["dense", "hybrid"]


# --- worlds: a model, its agents file and a store built by kvsnap.build.pipeline ---------------


class World:
    def __init__(self, demo_models, root: Path, name: str, agents=AGENTS, **settings):
        from kvsnap.build.pipeline import build_snapshots
        from kvsnap.prompts import parse_warm_prompts
        from kvsnap.store.local import Store

        self.name = name
        self.model = demo_models.path(name)
        self.lm = demo_models.load(name, **settings)
        self.settings = self.lm.settings
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.agents_file = root / "agents.json"
        self.agents_file.write_text(json.dumps(agents))
        self.prompts = parse_warm_prompts(agents, str(self.agents_file))
        self.store = root / "snaps"
        report = build_snapshots(
            self.lm, self.prompts, Store.open(self.store, create=True), str(self.agents_file)
        )
        assert report.ok and report.count("built") == len(agents), report

    def tokens(self, messages) -> list[int]:
        from kvsnap.chat import request_tokens

        return request_tokens(self.lm.tokenizer, messages)

    def warm_tokens(self, index: int) -> tuple[int, ...]:
        from kvsnap.prompts import warm_prefix

        return warm_prefix(self.lm.tokenizer, self.prompts.entries[index]).tokens

    def request(self, agent: int, question: str) -> list[int]:
        return self.tokens(AGENTS[agent]["messages"] + [{"role": "user", "content": question}])

    def copy_store(self, dest: Path) -> Path:
        shutil.copytree(self.store, dest)
        return dest


class Engines:
    """Starts engines and shuts every one of them down at the end of the scope."""

    def __init__(self):
        self.started = []

    def start(
        self, world: World, warm: bool = True, snapshots: Path | str | None = "store", **config
    ):
        from kvsnap.runtime.engine.engine import Engine, EngineConfig

        if snapshots == "store":
            snapshots = world.store
        engine = Engine(
            EngineConfig(
                model=str(world.model),
                settings=config.pop("settings", world.settings),
                warm_prompts=config.pop("warm_prompts", world.prompts if warm else None),
                warm_prompts_file=config.pop(
                    "warm_prompts_file", str(world.agents_file) if warm else None
                ),
                snapshots=str(snapshots) if snapshots is not None else None,
                write_back=config.pop("write_back", False),
                **config,
            )
        )
        self.started.append(engine)
        engine.start()
        assert engine.wait_warm(120)
        return engine

    def shutdown(self):
        for engine in self.started:
            engine.shutdown()


@pytest.fixture(scope="module")
def module_engines():
    engines = Engines()
    yield engines
    engines.shutdown()


@pytest.fixture()
def engines():
    engines = Engines()
    yield engines
    engines.shutdown()


@pytest.fixture(scope="module")
def digest_dir(tmp_path_factory):
    """Keep the weight-digest cache out of the user's home for the whole module."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("kvsnap-cache")
    mp.setenv("KVSNAP_CACHE_DIR", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def worlds(demo_models, tmp_path_factory, digest_dir):
    made = {}

    def get(name: str, **settings) -> World:
        key = (name, tuple(sorted(settings.items())))
        if key not in made:
            made[key] = World(
                demo_models, tmp_path_factory.mktemp(f"world-{name}"), name, **settings
            )
        return made[key]

    return get


@pytest.fixture(scope="module")
def oracle(worlds, module_engines):
    """Answers from a fresh full prefill, one request at a time (memoised)."""
    cold = {}
    answers = {}

    def answer(world: World, tokens, max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        key = (world.name, world.settings, tuple(tokens), max_tokens)
        if key not in answers:
            wk = (world.name, world.settings)
            if wk not in cold:
                cold[wk] = module_engines.start(
                    world, warm=False, snapshots=None, cache_memory_mb=0
                )
            st = serve(cold[wk], tokens, max_tokens)
            assert st.cached_tokens == 0
            answers[key] = (st.text, st.completion_tokens)
        return answers[key]

    return answer


def submit(engine, tokens, max_tokens: int = MAX_TOKENS, on_event=None):
    from kvsnap.runtime.engine.engine import GenerationRequest

    return engine.submit(
        GenerationRequest(tokens=list(tokens), max_tokens=max_tokens),
        on_event or (lambda s, k, p: None),
    )


def finish(state, timeout: float = 120.0):
    assert state.done.wait(timeout), "the request did not finish"
    assert state.finish_reason in ("stop", "length"), (state.finish_reason, state.text)
    assert state.completion_tokens > 0
    return state


def serve(engine, tokens, max_tokens: int = MAX_TOKENS):
    """One request alone: submit and wait."""
    return finish(submit(engine, tokens, max_tokens))


def answer_of(state) -> tuple[str, int]:
    return state.text, state.completion_tokens


def assert_accounting(engine, states):
    """The engine's measured prompt-token counter equals prompt - cached summed over the requests.

    (Per request, computed is set as prompt - cached, so only the measured counter can disagree.)
    """
    tokens = engine.status()["tokens"]
    assert tokens["computed"] == sum(st.prompt_tokens - st.cached_tokens for st in states), tokens
    assert tokens["prompt"] == sum(st.prompt_tokens for st in states)
    assert tokens["cached"] == sum(st.cached_tokens for st in states)
    assert tokens["computed_source"].startswith("measured"), tokens


# --- 1. first request per agent after a start from snapshots ---------------------------


@pytest.mark.parametrize("arch", ARCHES + ["sliding"])
def test_first_request_per_agent_computes_only_its_suffix_and_matches_a_full_prefill(
    arch, worlds, engines, oracle
):
    world = worlds(arch)
    engine = engines.start(world)
    snaps = engine.status()["snapshots"]
    assert snaps["loaded"] == 2 and snaps["prefilled"] == 0 and snaps["rejected"] == 0, snaps
    states = []
    for agent in range(len(AGENTS)):
        tokens = world.request(agent, QUESTIONS[0])
        warm = world.warm_tokens(agent)
        assert tuple(tokens[: len(warm)]) == warm
        st = serve(engine, tokens)
        assert st.cached_tokens == len(warm) and st.cache_source == "snapshot"
        assert st.prompt_tokens - st.cached_tokens < 20
        assert answer_of(st) == oracle(world, tokens)
        assert_served_from_the_exact_snapshot_state(engine, warm, tokens)
        states.append(st)
    assert_accounting(engine, states)


# --- 2 / 3. batching -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES + ["sliding"])
def test_concurrent_requests_each_equal_the_same_request_served_alone(
    arch, worlds, engines, oracle
):
    world = worlds(arch)
    engine = engines.start(world)
    seen = []

    def record(st, kind, payload):  # runs on the engine thread
        seen.append(engine.batch_size)

    requests = [world.request(a, q) for a in range(len(AGENTS)) for q in QUESTIONS]
    states = [submit(engine, t, on_event=record) for t in requests]
    for st in states:
        finish(st)
    assert max(seen) >= 2 and engine.status()["max_batch_size_seen"] >= 2
    for st, tokens in zip(states, requests):
        agent = requests.index(tokens) // 2
        assert st.cached_tokens >= len(world.warm_tokens(agent))
        assert answer_of(st) == oracle(world, tokens)
        assert_served_from_the_exact_snapshot_state(engine, world.warm_tokens(agent), tokens)
    assert_accounting(engine, states)


def test_restored_hybrid_request_batched_with_cold_requests_of_other_lengths(
    worlds, engines, oracle
):
    """Padding in a mixed batch never advances an SSM state: shorter and longer cold neighbours."""
    world = worlds("hybrid")
    engine = engines.start(world)
    restored = world.request(0, QUESTIONS[1])
    short_cold = world.tokens([{"role": "user", "content": "hi"}])
    long_cold = world.tokens(
        [{"role": "user", "content": "please review this function and explain each error " * 3}]
    )
    suffix = len(restored) - len(world.warm_tokens(0))
    assert len(short_cold) < suffix < len(long_cold)
    states = [submit(engine, t) for t in (restored, short_cold, long_cold)]
    for st in states:
        finish(st)
    assert states[0].cached_tokens == len(world.warm_tokens(0))
    assert states[1].cached_tokens == states[2].cached_tokens == 0
    assert engine.status()["max_batch_size_seen"] >= 3
    for st, tokens in zip(states, (restored, short_cold, long_cold)):
        assert answer_of(st) == oracle(world, tokens)


# --- 4. rejected snapshots fall back to prefill ------------------------------------------


def _flip_own_state_byte(store: Path, record: Path) -> Path:
    """Flip a byte in the last block of ``record`` (its tail: no other agent's); returns that
    block."""
    from kvsnap.store.local import Store
    from kvsnap.store.paths import chain_relpaths

    info = Store.open(store).inspect(record)
    block = store / [rel for rel in chain_relpaths(info) if rel.startswith("blocks/")][-1]
    _flip_data_byte(block)
    return block


def _flip_data_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    at = 8 + header + (len(raw) - 8 - header) // 2
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def foreign_store(demo_models, tmp_path_factory, digest_dir):
    """Snapshots of the same warm prompts for another dense demo model (other seed, same arch)."""
    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.prompts import parse_warm_prompts
    from kvsnap.runtime.model.loading import load_model
    from kvsnap.store.local import Store
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    root = tmp_path_factory.mktemp("foreign")
    lm = load_model(make_demo_model(root / "model", DemoSpec(arch="dense", seed=1)))
    agents = root / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    report = build_snapshots(
        lm,
        parse_warm_prompts(AGENTS, str(agents)),
        Store.open(root / "snaps", create=True),
        str(agents),
    )
    assert report.ok
    return root / "snaps"


@pytest.mark.parametrize("kind", ["foreign", "corrupt", "stale"])
def test_rejected_snapshots_are_reported_and_replaced_by_a_prefill(
    kind, worlds, engines, oracle, foreign_store, tmp_path
):
    from kvsnap.prompts import parse_warm_prompts

    world = worlds("dense")
    store = tmp_path / "snaps"
    agents = AGENTS
    if kind == "foreign":
        (store / "snapshots").mkdir(parents=True)
        for f in (foreign_store / "snapshots").iterdir():
            shutil.copy(f, store / "snapshots" / f.name)
        expect_rejected, expect_prefilled, reason = 2, 2, "built for another model"
    elif kind == "corrupt":
        world.copy_store(store)
        victim = sorted((store / "snapshots").iterdir())[0]
        _flip_own_state_byte(store, victim)
        expect_rejected, expect_prefilled, reason = 1, 1, "checksum"
    else:
        world.copy_store(store)
        agents = json.loads(json.dumps(AGENTS))
        agents[0]["messages"][0]["content"] = LONG_SYSTEM + " Be terse."
        expect_rejected, expect_prefilled, reason = 1, 1, "stale"
    prompts = parse_warm_prompts(agents, str(world.agents_file))
    engine = engines.start(world, snapshots=store, warm_prompts=prompts)
    snaps = engine.status()["snapshots"]
    assert snaps["rejected"] == expect_rejected, snaps
    assert all(
        reason in r["reason"] and r["file"].endswith(".safetensors")
        for r in snaps["rejected_reasons"]
    ), snaps
    assert snaps["prefilled"] == expect_prefilled and snaps["loaded"] == 2 - expect_prefilled, snaps
    states = []
    for agent in range(len(agents)):
        tokens = world.tokens(
            agents[agent]["messages"] + [{"role": "user", "content": QUESTIONS[0]}]
        )
        st = serve(engine, tokens)
        assert st.cached_tokens > 0 and st.cache_source in ("snapshot", "prefill")
        assert answer_of(st) == oracle(world, tokens)
        states.append(st)
    assert_accounting(engine, states)


def test_a_corrupt_snapshot_loaded_lazily_is_rejected_on_first_hit(
    worlds, engines, oracle, tmp_path
):
    world = worlds("dense")
    store = world.copy_store(tmp_path / "snaps")
    for f in (store / "blocks").iterdir():
        _flip_data_byte(f)
    engine = engines.start(world, snapshots=store, cache_memory_mb=0.001)  # nothing loads at start
    assert engine.status()["snapshots"]["rejected"] == 0
    tokens = world.request(0, QUESTIONS[0])
    st = serve(engine, tokens)
    assert st.cached_tokens == 0 and answer_of(st) == oracle(world, tokens)
    reviewer = engine.status()["snapshots"]["rejected_reasons"]
    assert reviewer and all("checksum" in r["reason"] for r in reviewer)
    # (a trimmable warm entry sharing a few leading tokens may have been tried next)
    tokens = world.request(1, QUESTIONS[0])
    st = serve(engine, tokens)  # the other agent too; the engine keeps serving
    assert st.cached_tokens == 0 and answer_of(st) == oracle(world, tokens)
    status = engine.status()
    # Two entries failed to load; a bad block they share is one rejected file, named once.
    assert status["cache"]["load_errors"] == 2 and 1 <= status["snapshots"]["rejected"] <= 2
    # the bad snapshots are gone (and request prefixes do not fit this budget)
    assert status["cache"]["entry_count"] == 0


# --- 5. honest accounting ------------------------------------------------------------------


def test_computed_tokens_come_from_mlx_lm_counter(worlds, engines):
    """The engine-wide counter moves by exactly the suffix the model ran, padding excluded."""
    from kvsnap.runtime.engine.accounting import prompt_counter

    world = worlds("dense")
    engine = engines.start(world)
    before = engine.status()["tokens"]["computed"]
    st = serve(engine, world.request(0, QUESTIONS[0]))
    assert engine.status()["tokens"]["computed"] - before == st.computed_tokens
    counter = engine.call(lambda: prompt_counter(engine._batch.gen))
    assert counter == st.computed_tokens - 1, (
        "mlx-lm counts the prefilled suffix; the last token runs in the decode step"
    )
    # A batch with very different suffix lengths (padding) counts only real tokens.
    states = [st] + [
        submit(engine, t)
        for t in (
            world.request(1, QUESTIONS[1]),
            world.tokens([{"role": "user", "content": "a long cold question " * 8}]),
        )
    ]
    for s in states[1:]:
        finish(s)
    assert_accounting(engine, states)


# --- 6. prefix reuse in the engine ------------------------------------------------------------


def test_multi_turn_reuses_the_first_turns_prompt_on_dense(worlds, engines, oracle):
    world = worlds("dense")
    engine = engines.start(world)
    first_messages = AGENTS[0]["messages"] + [{"role": "user", "content": QUESTIONS[0]}]
    first = serve(engine, world.tokens(first_messages))
    second_tokens = world.tokens(
        first_messages
        + [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "and the tests?"},
        ]
    )
    second = serve(engine, second_tokens)
    assert second.cached_tokens > len(world.warm_tokens(0)) and second.cache_source == "request"
    assert answer_of(second) == oracle(world, second_tokens)
    assert_accounting(engine, [first, second])


def checkpoint_below(engine, tokens) -> int:
    """The longest checkpoint entry (a branch point inside the warm prompts) a request of
    ``tokens`` can start from: a strict prefix of them; 0 if none."""
    inner = [
        len(e.tokens)
        for e in engine.prefix.entries
        if e.inner and len(e.tokens) < len(tokens) and tuple(tokens[: len(e.tokens)]) == e.tokens
    ]
    return max(inner, default=0)


def test_prompt_equal_to_a_cached_untrimmable_prefix_still_works(worlds, engines, oracle):
    world = worlds("hybrid")
    engine = engines.start(world)
    warm = list(world.warm_tokens(0))
    full = world.request(0, QUESTIONS[0])
    states = [serve(engine, full)]  # captures full[:-1], an untrimmable hybrid state
    # The warm prompt itself, or one diverging early, starts from the last checkpoint before its
    # end.
    for tokens, expect_cached in (
        (full[:-1], len(warm)),
        (warm, checkpoint_below(engine, warm)),
        (warm[:1] + [7], 0),
    ):
        st = serve(engine, tokens)
        assert st.cached_tokens == expect_cached, (len(tokens), st.cached_tokens)
        assert answer_of(st) == oracle(world, tokens)
        states.append(st)
    assert_accounting(engine, states)


def test_a_request_differing_from_an_untrimmable_snapshot_only_at_its_last_token_is_prefilled(
    worlds, engines, oracle
):
    """Regression (mutation run): strict prefix at lookup, end to end on the hybrid model, whose
    snapshots cannot be trimmed."""
    world = worlds("hybrid")
    engine = engines.start(world)
    warm = world.warm_tokens(0)
    tokens = world.request(0, QUESTIONS[0])
    # same prompt, other token at the snapshot's last position
    tokens[len(warm) - 1] = 100 if warm[-1] != 100 else 101
    st = serve(engine, tokens)
    # Never the whole snapshot (its last token differs): at most the checkpoint before it.
    below = checkpoint_below(engine, tokens[: len(warm) - 1] + [None])
    # Checkpoints sit on a fixed 256-token grid: these short agents may have none, so ``below`` may
    # be 0.
    assert 0 <= below < len(warm) - 1, below
    assert st.cached_tokens == below, (st.cached_tokens, st.cache_source)
    assert st.cache_source == ("snapshot" if below else ""), st.cache_source
    assert answer_of(st) == oracle(world, tokens)
    assert_accounting(engine, [st])


def test_one_shared_token_is_enough_for_a_hit(worlds, engines, oracle):
    world = worlds("dense")
    engine = engines.start(world, warm=False, snapshots=None)
    first = serve(engine, [5, 6, 7, 8])
    st = serve(engine, [5, 9, 9])
    assert st.cached_tokens == 1 and answer_of(st) == oracle(world, [5, 9, 9])
    assert_accounting(engine, [first, st])


def test_request_prefixes_are_evicted_within_the_budget_and_warm_entries_stay(
    worlds, engines, oracle
):
    world = worlds("dense")
    probe = engines.start(world)
    pinned_mb = probe.status()["cache"]["current_memory_mb"]
    probe.shutdown()
    budget = pinned_mb + 0.5  # room for a few short request prefixes (4 KiB per token here)
    engine = engines.start(world, cache_memory_mb=budget)
    states = []
    for i in range(6):
        tokens = world.tokens(
            [{"role": "user", "content": f"question number {i}: " + "check the data " * (4 + i)}]
        )
        st = serve(engine, tokens)
        assert st.cached_tokens < 8 and answer_of(st) == oracle(world, tokens)
        states.append(st)
        assert engine.status()["cache"]["current_memory_mb"] <= budget
    status = engine.status()["cache"]
    assert status["evictions"] >= 2, status
    warm = [e for e in engine.prefix.entries if e.pinned]
    assert len(warm) == 2 and all(e.loaded for e in warm)
    assert_accounting(engine, states)


def test_sequential_path_without_continuous_batching_matches(worlds, engines, oracle):
    world = worlds("hybrid")
    engine = engines.start(world, continuous_batching=False)
    states = [submit(engine, world.request(a, QUESTIONS[0])) for a in range(len(AGENTS))]
    for st, a in zip(states, range(len(AGENTS))):
        finish(st)
        assert st.cached_tokens == len(world.warm_tokens(a))
        assert answer_of(st) == oracle(world, world.request(a, QUESTIONS[0]))
    assert engine.status()["max_batch_size_seen"] == 1
    assert_accounting(engine, states)


# --- 7. loading policy ----------------------------------------------------------------------


def test_pinned_snapshots_beyond_the_budget_stay_indexed_and_load_on_first_hit(
    worlds, engines, oracle
):
    world = worlds("dense")
    engine = engines.start(world, cache_memory_mb=0.001)
    status = engine.status()
    assert status["snapshots"]["loaded"] == 0 and status["snapshots"]["indexed"] == 2, status[
        "snapshots"
    ]
    assert status["cache"]["entry_count"] == 2 and status["cache"]["lazy_loads"] == 0
    assert all(e.pinned and not e.loaded for e in engine.prefix.entries)
    tokens = world.request(0, QUESTIONS[0])
    st = serve(engine, tokens)
    assert st.cached_tokens == len(world.warm_tokens(0)) and answer_of(st) == oracle(world, tokens)
    assert engine.status()["cache"]["lazy_loads"] == 1
    assert (
        all(e.pinned for e in engine.prefix.entries if e.source == "snapshot")
        and len([e for e in engine.prefix.entries if e.source == "snapshot"]) == 2
    )


def test_kv_snapshots_alone_pins_every_matching_snapshot(worlds, engines, oracle):
    world = worlds("dense")
    engine = engines.start(world, warm=False)
    snaps = engine.status()["snapshots"]
    assert snaps["loaded"] == 2 and snaps["prefilled"] == 0 and snaps["indexed"] == 2
    assert len(engine.prefix.entries) == 2 and all(
        e.pinned and e.loaded and e.source == "snapshot" for e in engine.prefix.entries
    )
    for agent in range(len(AGENTS)):
        tokens = world.request(agent, QUESTIONS[1])
        st = serve(engine, tokens)
        assert st.cached_tokens == len(world.warm_tokens(agent)) and answer_of(st) == oracle(
            world, tokens
        )


def test_warm_prompts_without_snapshots_are_prefilled_written_back_and_loaded_next_start(
    worlds, engines, oracle, tmp_path
):
    world = worlds("dense")
    store = tmp_path / "fresh-snaps"
    first = engines.start(world, snapshots=store, write_back=True)
    snaps = first.status()["snapshots"]
    assert snaps["prefilled"] == 2 and snaps["written"] == 2 and snaps["write_back"] is True, snaps
    tokens = world.request(1, QUESTIONS[0])
    st = serve(first, tokens)
    assert st.cached_tokens == len(world.warm_tokens(1)) and st.cache_source == "prefill"
    assert answer_of(st) == oracle(world, tokens)
    first.shutdown()

    second = engines.start(world, snapshots=store, write_back=True)
    snaps = second.status()["snapshots"]
    assert (
        snaps["prefilled"] == 0
        and snaps["loaded"] == 2
        and snaps["written"] == 0
        and snaps["rejected"] == 0
    ), snaps
    st = serve(second, tokens)
    assert st.cache_source == "snapshot" and answer_of(st) == oracle(world, tokens)


@pytest.mark.parametrize("how", ["write_back_off", "readonly_store"])
def test_a_read_only_store_serves_and_says_it_cannot_write_back(
    how, worlds, engines, oracle, tmp_path
):
    from kvsnap.runtime.engine.engine import Engine, EngineConfig
    from kvsnap.store.local import Store

    world = worlds("dense")
    store = world.copy_store(tmp_path / "snaps")
    victim = sorted((store / "snapshots").iterdir())[0]
    victim.unlink()  # one warm prompt has no snapshot: it is prefilled, and cannot be written back
    if how == "write_back_off":
        engine = engines.start(world, snapshots=store, write_back=False)
    else:
        engine = Engine(
            EngineConfig(
                model=str(world.model),
                warm_prompts=world.prompts,
                warm_prompts_file=str(world.agents_file),
                snapshots=str(store),
                write_back=True,
            )
        )
        engines.started.append(engine)
        engine.store = Store.open(store, readonly=True)
        engine.start()
        assert engine.wait_warm(120)
    snaps = engine.status()["snapshots"]
    assert snaps["prefilled"] == 1 and snaps["loaded"] == 1 and snaps["written"] == 0
    assert snaps["write_back"] is False and snaps["write_back_note"], snaps
    assert not victim.exists() and len(list((store / "snapshots").iterdir())) == 1
    for agent in range(len(AGENTS)):
        tokens = world.request(agent, QUESTIONS[0])
        st = serve(engine, tokens)
        assert st.cached_tokens == len(world.warm_tokens(agent)) and answer_of(st) == oracle(
            world, tokens
        )


# --- 8. cancel ---------------------------------------------------------------------------------


def test_a_cancelled_request_frees_its_slot_and_the_engine_keeps_serving(worlds, engines, oracle):
    world = worlds("dense")
    engine = engines.start(world)
    started = threading.Event()

    def on_event(st, kind, payload):
        if st.completion_tokens >= 2:
            started.set()

    long_a = submit(engine, world.request(0, QUESTIONS[0]), max_tokens=100_000, on_event=on_event)
    long_b = submit(engine, world.request(1, QUESTIONS[0]), max_tokens=100_000)
    assert started.wait(60)
    assert engine.status()["batch_size"] == 2
    engine.cancel(long_a)
    assert long_a.done.wait(30) and long_a.finish_reason == "cancelled"
    deadline = time.monotonic() + 30
    while engine.status()["batch_size"] != 1:
        assert time.monotonic() < deadline, "the cancelled request still holds its slot"
        time.sleep(0.01)
    assert long_b.finish_reason is None
    tokens = world.request(1, QUESTIONS[1])
    st = serve(engine, tokens)
    assert answer_of(st) == oracle(world, tokens)
    engine.cancel(long_b)
    assert long_b.done.wait(30) and long_b.finish_reason == "cancelled"
    deadline = time.monotonic() + 30
    while engine.status()["batch_size"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_shutdown_ends_running_requests(worlds, engines):
    world = worlds("dense")
    engine = engines.start(world, warm=False, snapshots=None)
    st = submit(engine, [5, 6, 7], max_tokens=100_000)
    deadline = time.monotonic() + 30
    while st.completion_tokens < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.shutdown()
    assert engine.stopped.is_set() and st.done.is_set() and st.finish_reason == "cancelled"


@pytest.mark.parametrize("batching", [True, False])
def test_a_request_that_fails_to_start_errors_alone_and_the_engine_keeps_serving(
    batching, worlds, engines, oracle
):
    world = worlds("dense")
    engine = engines.start(world, continuous_batching=batching)
    real_fetch = engine.prefix.fetch

    def fetch(tokens, *rest):
        if list(tokens) == [9, 9, 9]:
            raise RuntimeError("injected")
        return real_fetch(tokens, *rest)

    engine.prefix.fetch = fetch
    good_tokens = world.request(0, QUESTIONS[0])
    bad = [
        submit(engine, [9, 9, 9]),
        submit(engine, [], max_tokens=4),
        submit(engine, [5, 6], max_tokens=0),
    ]
    good = submit(engine, good_tokens)
    for st in bad:
        assert st.done.wait(30) and st.finish_reason == "error"
    assert answer_of(finish(good)) == oracle(world, good_tokens)
    # the slot is freed once the finished request's prompt + reply is kept, just after its end
    deadline = time.monotonic() + 30
    while engine.status()["batch_size"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_request_whose_sampler_raises_errors_alone_and_its_batch_goes_on_issue_39(
    worlds, engines, oracle, monkeypatch
):
    """A sampler that raises (mlx-lm's top_k check did, for one tenant's top_k) used to fail
    the whole step: every request in the batch got an error."""
    from kvsnap.runtime.engine import batch_runner
    from kvsnap.runtime.engine.engine import GenerationRequest

    real = batch_runner.make_request_sampler

    def make(temperature, top_p=1.0, seed=None, top_k=0, min_p=0.0):
        if seed != 666:
            return real(temperature, top_p, seed, top_k, min_p)

        def broken(logprobs):
            raise ValueError("injected sampler failure")

        return broken

    monkeypatch.setattr(batch_runner, "make_request_sampler", make)
    world = worlds("dense")
    engine = engines.start(world)
    good_tokens = world.request(0, QUESTIONS[0])
    good = submit(engine, good_tokens)
    errors = []
    bad = engine.submit(
        GenerationRequest(world.request(1, QUESTIONS[1]), MAX_TOKENS, temperature=1.0, seed=666),
        lambda s, k, p: errors.append(p) if k == "error" else None,
    )
    seeded = GenerationRequest(good_tokens, 8, temperature=1.0, seed=5)
    other = engine.submit(seeded, lambda s, k, p: None)
    assert bad.done.wait(60) and bad.finish_reason == "error", bad.finish_reason
    assert errors == ["ValueError: injected sampler failure"]
    assert answer_of(finish(good)) == oracle(world, good_tokens)
    finish(other)
    assert answer_of(finish(serve(engine, good_tokens))) == oracle(world, good_tokens)
    assert engine.status()["batch_size"] == 0


def test_submit_after_shutdown_fails_at_once(worlds, engines):
    engine = engines.start(worlds("dense"), warm=False, snapshots=None)
    engine.shutdown()
    st = submit(engine, [5, 6, 7])
    assert st.done.is_set() and st.finish_reason == "error"


# --- 9. quantized KV (sequential path) ------------------------------------------------------


def test_kv_bits_8_from_snapshots_matches_kv_bits_8_without(worlds, engines, oracle):
    world = worlds("dense", kv_bits=8)
    engine = engines.start(world)
    snaps = engine.status()["snapshots"]
    assert snaps["loaded"] == 2 and snaps["prefilled"] == 0, snaps
    # (on the engine thread: the states' arrays live on its mlx stream)
    assert engine.call(
        lambda: all(
            type(c).__name__ == "QuantizedKVCache"
            for e in engine.prefix.entries
            for c in engine.prefix.copy_state(e.state)
        )
    )
    states = []
    for agent in range(len(AGENTS)):
        tokens = world.request(agent, QUESTIONS[0])
        st = serve(engine, tokens)
        assert st.cached_tokens == len(world.warm_tokens(agent))
        assert answer_of(st) == oracle(world, tokens)
        states.append(st)
    assert engine.status()["max_batch_size_seen"] == 1  # quantized KV runs one request at a time
    assert_accounting(engine, states)


def test_a_store_built_without_kv_bits_is_not_used_by_a_kv_bits_engine(worlds, engines, oracle):
    plain = worlds("dense")
    quantized = worlds("dense", kv_bits=8)
    engine = engines.start(quantized, snapshots=plain.copy_store(quantized.root / "plain-copy"))
    snaps = engine.status()["snapshots"]
    assert snaps["loaded"] == 0 and snaps["prefilled"] == 2 and snaps["rejected"] == 2, snaps
    assert all(
        "KV setting" in r["reason"] and "kv_bits" in r["reason"] for r in snaps["rejected_reasons"]
    )
    tokens = quantized.request(0, QUESTIONS[0])
    assert answer_of(serve(engine, tokens)) == oracle(quantized, tokens)


# --- 10. warm-prompt concurrency -----------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES + ["sliding"])
def test_warm_prompts_concurrency_prefills_together_and_answers_stay_the_same(
    arch, worlds, engines, oracle, tmp_path
):
    world = worlds(arch)
    store = tmp_path / "snaps"
    engine = engines.start(world, snapshots=store, write_back=True, warm_prompts_concurrency=2)
    status = engine.status()
    assert status["snapshots"]["prefilled"] == 2 and status["snapshots"]["written"] == 2
    assert status["warmup"]["prefill_concurrency"] == 2
    for agent in range(len(AGENTS)):
        entry = warm_entry(engine, world.warm_tokens(agent))
        assert entry is not None and entry.source == "prefill" and entry.pinned
        tokens = world.request(agent, QUESTIONS[0])
        st = serve(engine, tokens)
        assert st.cached_tokens == len(world.warm_tokens(agent)) and answer_of(st) == oracle(
            world, tokens
        )
    # The written-back snapshots are as good as built ones.
    again = engines.start(world, snapshots=store)
    assert again.status()["snapshots"]["loaded"] == 2
    tokens = world.request(1, QUESTIONS[1])
    assert answer_of(serve(again, tokens)) == oracle(world, tokens)


def test_clear_prefix_cache_rewarms_from_snapshots(worlds, engines, oracle):
    world = worlds("dense")
    engine = engines.start(world)
    serve(engine, world.request(0, QUESTIONS[0]))
    assert len(engine.prefix) == 3  # two warm entries and the captured request prefix
    assert engine.clear_prefix_cache(rewarm=True) == 3  # returns once the engine has cleared
    assert len(engine.prefix) == 2  # the warm set is indexed again at once; loads follow in steps
    deadline = time.monotonic() + 30
    while engine.status()["rewarm_in_progress"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    status = engine.status()
    assert status["rewarms"] == 1 and len(engine.prefix) == 2
    # Counters add up over re-warms: two more loads, no prefill.
    assert (
        status["snapshots"]["loaded"] == 4
        and status["snapshots"]["prefilled"] == 0
        and status["snapshots"]["rejected"] == 0
    )
    tokens = world.request(1, QUESTIONS[0])
    st = serve(engine, tokens)
    assert st.cache_source == "snapshot" and answer_of(st) == oracle(world, tokens)


# --- a hit's copies ----------------------------------------------------------------------

LONG_AGENT = [{"name": "long", "messages": [{"role": "system", "content": LONG_SYSTEM * 8}]}]


@pytest.fixture(scope="module")
def long_world(demo_models, tmp_path_factory, digest_dir):
    """One agent whose cached tokens outweigh what a tiny model's short step allocates."""
    return World(demo_models, tmp_path_factory.mktemp("world-long"), "dense", agents=LONG_AGENT)


def _cached_bytes(engine, warm) -> int:
    """The bytes of the warm entry's cached tokens, as a request's copy holds them."""
    from kvsnap.snapshot.codec import cache_nbytes_of

    entry = warm_entry(engine, warm)
    return engine.call(lambda: cache_nbytes_of(engine.prefix.copy_state(entry.state)))


def test_regression_a_hit_copies_its_cached_tokens_once(long_world, engines, oracle):
    """A hit copied every cached token three times before its first token: a materialized copy,
    then mlx-lm's growth of a batch buffer sized to the prompt exactly, then the gather that
    moves a request from prompt processing to decoding; the prompt prefix it kept was one more
    copy. Counted in bytes: at its peak the request held 1.47 times its cached tokens in new
    memory (2.2 keeping its prefix); one copy with room for 256 more tokens is 1.15 times, and
    the prefix it keeps shares the warm blocks, copying only its own tokens."""
    import mlx.core as mx

    from kvsnap.runtime.engine.engine import GenerationRequest

    engine = engines.start(long_world)
    warm = long_world.warm_tokens(0)
    tokens = long_world.tokens(LONG_AGENT[0]["messages"] + [{"role": "user", "content": "hi"}])
    cached = _cached_bytes(engine, warm)

    def reset() -> int:
        mx.synchronize()
        mx.reset_peak_memory()
        return mx.get_active_memory()

    for capture in (False, False, True):  # the first and a second request alike
        before = engine.call(reset)
        request = GenerationRequest(tokens=tokens, max_tokens=2, capture=capture)
        st = finish(engine.submit(request, lambda s, k, p: None))
        assert st.cached_tokens == len(warm) and st.cache_source == "snapshot"
        grown = engine.call(mx.get_peak_memory) - before
        assert grown < 1.3 * cached, f"a hit on {cached} bytes allocated {grown} bytes"
    kept = [e.tokens for e in engine.prefix.entries if e.source == "request"]
    # its prompt + the 2 tokens generated (issue 41: it superseded the prompt's entry)
    assert len(kept) == 1 and len(kept[0]) == len(tokens) + 2
    assert kept[0][: len(tokens)] == tuple(tokens)
    # the kept prefix (the warm blocks and its own tokens) serves the next turn
    longer = tokens + [tokens[-1]] * 3
    st = serve(engine, longer)
    same = next((i for i, (a, b) in enumerate(zip(kept[0], longer)) if a != b), len(kept[0]))
    assert st.cache_source == "request" and st.cached_tokens == same
    assert answer_of(st) == oracle(long_world, longer)


def test_concurrent_hits_on_one_long_prefix_read_it_shared_and_answer_as_cold(
    long_world, engines, oracle
):
    """Requests admitted together on one warm hit of at least MIN_SHARED_TOKENS go into the
    batch reading it shared (no private copy each: issue 41 item 1), and each answers as a
    fresh prefill of its own prompt."""
    from kvsnap.runtime.engine.batch_cache import MIN_SHARED_TOKENS

    engine = engines.start(long_world)
    warm = long_world.warm_tokens(0)
    assert len(warm) >= MIN_SHARED_TOKENS
    prompts = [
        long_world.tokens(LONG_AGENT[0]["messages"] + [{"role": "user", "content": q}])
        for q in QUESTIONS[:3]
    ]
    states = [submit(engine, tokens) for tokens in prompts]
    for st, tokens in zip(states, prompts):
        finish(st)
        assert st.cached_tokens == len(warm) and answer_of(st) == oracle(long_world, tokens)
    assert engine.status()["shared_prefix_rows"] == len(prompts)


def test_a_request_walks_the_prefix_trie_once_issue_42(worlds, engines):
    """The batch runner looked a request's tokens up again after its fetch, to find the warm
    blocks its kept prefix shares; the fetch's match now goes with the copy: one lookup."""
    world = worlds("dense")
    engine = engines.start(world)
    tokens = world.request(0, QUESTIONS[1])
    prefix = engine.prefix
    real = prefix.lookup
    walks: list[tuple] = []

    def lookup(tokens, *rest, **kwargs):
        walks.append(tuple(tokens))
        return real(tokens, *rest, **kwargs)

    prefix.lookup = lookup  # on the instance, as the fetch above is replaced
    try:
        st = serve(engine, tokens)
    finally:
        del prefix.lookup
    assert st.cached_tokens == len(world.warm_tokens(0)) and st.cache_source == "snapshot"
    assert walks == [tuple(tokens)]


def test_two_continuations_of_one_warm_prefix_interleaved_stay_independent(worlds, engines, oracle):
    """No shared mutable cache: a request that hits a warm entry while another hit of it is
    decoding gets the answer of a fresh prefill, so does the other, and the warm entry's state
    is bitwise what it was."""
    import mlx.core as mx
    import numpy as np

    from kvsnap.snapshot.codec import encode_cache

    world = worlds("dense")
    engine = engines.start(world)
    warm = world.warm_tokens(0)
    entry = warm_entry(engine, warm)

    def stored() -> dict:  # on the engine thread, as numpy arrays the test thread can read
        arrays, _ = encode_cache(engine.prefix.copy_state(entry.state), warm)
        mx.eval(arrays)
        return {k: np.array(v) for k, v in arrays.items()}

    before = engine.call(stored)
    first, second = world.request(0, QUESTIONS[0]), world.request(0, QUESTIONS[1])
    later: list = []
    decoding: list[int] = []

    def on_first(st, kind, payload):  # engine thread: the second starts while the first decodes
        if kind == "token" and not later:
            later.append(submit(engine, second))
        if kind == "token" and later and not later[0].done.is_set():
            decoding.append(st.completion_tokens)

    st_first = finish(submit(engine, first, on_event=on_first))
    st_second = finish(later[0])
    assert len(decoding) >= 2, "the first request did not decode while the second started"
    for st, tokens in ((st_first, first), (st_second, second)):
        assert st.cached_tokens == len(warm) and answer_of(st) == oracle(world, tokens)
    after = engine.call(stored)
    assert sorted(after) == sorted(before)
    assert all(np.array_equal(after[k], before[k]) for k in before)


@pytest.mark.skipif(
    find_openblas() is None or not sys.platform.startswith("linux"),
    reason="Debian's libopenblas0-pthread is not installed",
)
@pytest.mark.parametrize("decode_threads", [1, 0])
def test_a_step_that_only_decodes_runs_on_one_blas_thread_and_prompts_on_all_issue_41(
    decode_threads, worlds, engines, oracle
):
    """A decode step's thin matmuls split over OpenBLAS's threads waited for each thread's
    wake-up: on a busy host a step took 4x as long. Steps that compute a prompt keep every
    thread; --decode-blas-threads 0 keeps them for decoding too."""
    from kvsnap.blas import openblas_threads
    from kvsnap.runtime.engine.engine import GenerationRequest

    blas = openblas_threads()
    if blas is None or blas.default < 2:
        pytest.skip("OpenBLAS runs one thread here")
    blas.use(0)  # whatever an earlier test left
    world = worlds("dense")
    engine = engines.start(world, decode_blas_threads=decode_threads)
    first, second = world.request(0, QUESTIONS[0]), world.request(1, QUESTIONS[1])
    seen: list[tuple[int, int]] = []  # (tokens A had, threads) at each of A's tokens
    joined: list = []

    def on_a(state, kind, payload):  # the engine thread, between steps
        if kind != "token":
            return
        seen.append((state.completion_tokens, blas.current()))
        if state.completion_tokens == 4:
            joined.append(submit(engine, second, 16))

    a = engine.submit(GenerationRequest(tokens=list(first), max_tokens=24), on_a)
    assert answer_of(finish(a)) == oracle(world, first, 24)
    assert answer_of(finish(joined[0])) == oracle(world, second, 16)
    decode = 1 if decode_threads == 1 else blas.default
    # before B arrives A only decodes; B's prompt steps run on every thread; then both decode
    assert [t for n, t in seen if 2 <= n <= 4] == [decode] * 3, seen
    assert blas.default in [t for n, t in seen if n > 4], seen
    assert seen[-1][1] == decode, seen


@pytest.mark.skipif(
    find_openblas() is None or not sys.platform.startswith("linux"),
    reason="Debian's libopenblas0-pthread is not installed",
)
def test_the_sequential_path_decodes_on_the_decode_threads_issue_41(worlds, engines, oracle):
    """Without --continuous-batching (or with a quantized KV) each token is one decode step too."""
    from kvsnap.blas import openblas_threads

    blas = openblas_threads()
    if blas is None or blas.default < 2:
        pytest.skip("OpenBLAS runs one thread here")
    blas.use(0)  # every thread before: only the sequential path's own setting makes it 1
    world = worlds("dense")
    engine = engines.start(world, continuous_batching=False, decode_blas_threads=1)
    tokens = world.request(0, QUESTIONS[1])
    seen: list[int] = []
    state = submit(engine, tokens, on_event=lambda s, k, p: seen.append(blas.current()))
    assert answer_of(finish(state)) == oracle(world, tokens)
    assert set(seen) == {1}, seen
    engine.shutdown()
    assert blas.current() == blas.default  # a stopped engine leaves OpenBLAS's own count
