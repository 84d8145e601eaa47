"""`kvsnap vllm-mlx serve`: vllm-mlx's own server, warm from a kvsnap store.

The fast tests run here, without vllm-mlx: argument handling and the insertion into a
stand-in for vllm-mlx's prefix cache. The end-to-end test installs vllm-mlx 0.6.0 (which
pins mlx-lm 0.31) into its own cached virtual environment (~/.cache/kvsnap-tests, or
$KVSNAP_TEST_CACHE), builds snapshots there, and runs vllm-mlx's real server twice: once
through kvsnap with the snapshots and once plain, cold. Skipped only when the package index
cannot be reached.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from helpers.cli import run_kvsnap
from helpers.models import LONG_SYSTEM
from helpers.vllm_mlx_route import (
    AGENTS,
    PLANNER,
    FakePrefixCache,
    _ask,
    _kvsnap_status,
    _launch,
    _plan,
    _venv_env,
    _venv_kvsnap,
    llama3_tokenizer_files,
)

from kvsnap.errors import UsageError
from kvsnap.integrations.vllm_mlx.insert import insert_snapshots, prepended_special_tokens
from kvsnap.integrations.vllm_mlx.launcher import (
    WARM_OPTION,
    check_serve_args,
    load_warm_prompt_file,
    split_argv,
)
from kvsnap.key import mlx_lm_minor

# --- arguments ------------------------------------------------------------------------


def test_split_argv_takes_only_kv_snapshots_and_keeps_the_rest_in_order():
    assert split_argv(["M", "--continuous-batching", "--kv-snapshots", "s", "--port", "9"]) == (
        "s",
        ["M", "--continuous-batching", "--port", "9"],
    )
    assert split_argv(["M", "--kv-snapshots=./a b"]) == ("./a b", ["M"])
    assert split_argv(["M", "--kv-cache-quantization"]) == (None, ["M", "--kv-cache-quantization"])
    for bad in (
        ["M", "--kv-snapshots"],
        ["M", "--kv-snapshots", "--port", "1"],
        ["M", "--kv-snapshots="],
        ["--kv-snapshots", "a", "--kv-snapshots", "b"],
    ):
        with pytest.raises(UsageError, match="--kv-snapshots"):
            split_argv(bad)


def test_warm_prompts_and_api_key_split_off_as_kvsnap_and_vllm_mlx_options():
    store, rest = split_argv(
        [
            "M",
            "--continuous-batching",
            "--api-key",
            "s3cret",
            "--kv-snapshots",
            "s",
            "--warm-prompts",
            "a.json",
            "--port",
            "9",
        ]
    )
    warm, rest = split_argv(rest, WARM_OPTION, "a file")
    # --api-key is vllm-mlx's own, passed through unchanged and in order.
    assert (store, warm, rest) == (
        "s",
        "a.json",
        ["M", "--continuous-batching", "--api-key", "s3cret", "--port", "9"],
    )
    for bad in (
        ["M", "--warm-prompts"],
        ["M", "--warm-prompts=", "x"],
        ["M", "--warm-prompts", "a", "--warm-prompts=b"],
    ):
        with pytest.raises(UsageError, match="--warm-prompts"):
            split_argv(bad, WARM_OPTION, "a file")


def test_vllm_mlx_warm_prompt_files_keep_their_shape_and_a_trailing_user_turn_is_the_probe_slot(
    tmp_path,
):
    from kvsnap.errors import WarmPromptError

    vllm_shape = tmp_path / "vllm.json"
    vllm_shape.write_text(
        json.dumps(
            [
                [{"role": "system", "content": "S"}],
                [{"role": "system", "content": "T"}, {"role": "user", "content": " "}],
            ]
        )
    )
    result = load_warm_prompt_file(str(vllm_shape))
    assert [e.messages for e in result.entries] == [
        ({"role": "system", "content": "S"},),
        ({"role": "system", "content": "T"},),
    ]
    assert [e.name for e in result.entries] == ["agent-0", "agent-1"]
    kvsnap_shape = tmp_path / "kvsnap.json"
    kvsnap_shape.write_text(json.dumps(AGENTS))
    assert [e.name for e in load_warm_prompt_file(str(kvsnap_shape)).entries] == ["reviewer"]
    (tmp_path / "none.json").write_text("[[]]")
    with pytest.raises(WarmPromptError, match="no valid warm-prompt entry"):
        load_warm_prompt_file(str(tmp_path / "none.json"))
    with pytest.raises(WarmPromptError, match="no such warm-prompt file"):
        load_warm_prompt_file(str(tmp_path / "missing.json"))


def test_serve_options_that_bypass_the_memory_aware_cache_are_refused():
    ok = dict(
        models_config=None,
        continuous_batching=True,
        disable_prefix_cache=False,
        no_memory_aware_cache=False,
        use_paged_cache=False,
        mllm=False,
        max_kv_size=None,
    )
    check_serve_args(SimpleNamespace(**ok))
    for change, words in [
        ({"continuous_batching": False}, "--continuous-batching"),
        ({"disable_prefix_cache": True}, "--disable-prefix-cache"),
        ({"no_memory_aware_cache": True}, "--no-memory-aware-cache"),
        ({"use_paged_cache": True}, "--use-paged-cache"),
        ({"max_kv_size": 512}, "--max-kv-size"),
        ({"models_config": "m.yaml"}, "--models-config"),
    ]:
        with pytest.raises(UsageError, match=re.escape(words)):
            check_serve_args(SimpleNamespace(**{**ok, **change}))


def test_without_vllm_mlx_installed_the_command_says_so_and_exits_2(tmp_path):
    try:
        import vllm_mlx  # noqa: F401

        pytest.skip("vllm-mlx is installed in this environment")
    except ImportError:
        pass
    r = run_kvsnap(
        "vllm-mlx", "serve", tmp_path, "--continuous-batching", "--kv-snapshots", tmp_path
    )
    assert r.returncode == 2, r.stderr
    assert "vllm-mlx is not installed" in r.stderr and "docs/vllm-mlx.md" in r.stderr


# --- insertion, against a stand-in for vllm-mlx's MemoryAwarePrefixCache ----------------


@pytest.fixture(scope="module")
def dense_store(tmp_path_factory, demo_models):
    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.key import DigestCache
    from kvsnap.prompts import parse_warm_prompts
    from kvsnap.store.local import Store

    root = tmp_path_factory.mktemp("vllm-mlx-store")
    agents = root / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    store = Store.open(root / "snaps", create=True)
    for name in ("dense", "sliding"):  # sliding: another model, so a foreign snapshot
        report = build_snapshots(
            demo_models.load(name),
            parse_warm_prompts(AGENTS, str(agents)),
            store,
            str(agents),
            digests=DigestCache(),
        )
        assert report.ok, report
    return store


def test_insert_puts_exactly_the_snapshot_state_into_the_cache_and_skips_foreign_ones(
    dense_store, demo_models
):
    import mlx.core as mx

    from kvsnap.runtime.prefill.chunked import prefill_in_blocks

    lm = demo_models.load("dense")
    cache = FakePrefixCache()
    report = insert_snapshots(cache, lm.model, lm.tokenizer, str(lm.path), dense_store)
    assert report.inserted == 1 and len(cache.entries) == 1
    assert len(report.skipped) == 1 and "built for another model" in report.skipped[0][1]
    ((tokens, state),) = cache.entries.items()
    assert report.tokens == len(tokens) > 128
    # The snapshot was prefilled block by block (kvsnap build): the same cuts give the same bytes.
    info = next(i for i in dense_store.scan()[0] if i.tokens == tuple(tokens))
    fresh = prefill_in_blocks(lm, tokens, [end for _, _, end in info.chain.blocks])
    for got, want in zip(state, fresh):
        assert got.offset == len(tokens)
        assert mx.array_equal(got.keys, want.keys[..., : len(tokens), :]) and mx.array_equal(
            got.values, want.values[..., : len(tokens), :]
        )


def test_insert_resolves_a_hub_id_to_the_files_vllm_mlx_loaded(
    dense_store, demo_models, tmp_path, monkeypatch
):
    """vllm-mlx is given `org/name`; kvsnap finds the same cached files and the same keys (issue
    18)."""
    from helpers.hub import add_snapshot

    lm = demo_models.load("dense")
    add_snapshot(tmp_path / "hf" / "hub", "kvsnap-test/dense", lm.path, "c" * 40)
    import huggingface_hub.constants

    # read at import, so set it here
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = insert_snapshots(
        FakePrefixCache(), lm.model, lm.tokenizer, "kvsnap-test/dense", dense_store
    )
    assert report.inserted == 1 and report.tokens > 128


def test_insert_respects_vllm_mlx_minimum_prefix_and_memory_budget(dense_store, demo_models):
    lm = demo_models.load("dense")
    short = insert_snapshots(
        FakePrefixCache(min_prefix_tokens=100_000),
        lm.model,
        lm.tokenizer,
        str(lm.path),
        dense_store,
    )
    assert short.inserted == 0 and any("minimum reusable prefix" in why for _, why in short.skipped)
    small = insert_snapshots(
        FakePrefixCache(limit_mb=0.01), lm.model, lm.tokenizer, str(lm.path), dense_store
    )
    assert small.inserted == 0 and any("--cache-memory-mb" in why for _, why in small.skipped)


class BosTokenizer:
    """A tokenizer whose default encode prepends a BOS, as Llama's does."""

    def __init__(self, inner):
        self.inner = inner

    def encode(self, text, add_special_tokens=True):
        plain = list(self.inner.encode(text, add_special_tokens=False))
        return [1, *plain] if add_special_tokens else plain

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_tokenizer_that_prepends_bos_on_encode_makes_every_snapshot_unmatchable(
    dense_store, demo_models
):
    lm = demo_models.load("dense")
    assert prepended_special_tokens(lm.tokenizer) == []
    assert prepended_special_tokens(BosTokenizer(lm.tokenizer)) == [1]
    report = insert_snapshots(
        FakePrefixCache(), lm.model, BosTokenizer(lm.tokenizer), str(lm.path), dense_store
    )
    assert report.inserted == 0 and any(
        "special tokens" in why and "--for vllm-mlx" in why for _, why in report.skipped
    )


def test_snapshots_built_for_vllm_mlx_go_in_with_their_bos(demo_models, tmp_path):
    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.key import DigestCache
    from kvsnap.profiles import vllm_mlx_tokenization
    from kvsnap.prompts import parse_warm_prompts, warm_prefix
    from kvsnap.store.local import Store

    lm = demo_models.load("dense")
    bos = BosTokenizer(lm.tokenizer)
    store = Store.open(tmp_path / "snaps", create=True)
    from kvsnap.runtime.model.loading import LoadedModel

    as_vllm = LoadedModel(
        path=lm.path, model=lm.model, tokenizer=bos, config=lm.config, settings=lm.settings
    )
    assert build_snapshots(
        as_vllm,
        parse_warm_prompts(AGENTS, "a.json"),
        store,
        "a.json",
        digests=DigestCache(),
        tokenization=vllm_mlx_tokenization("demo"),
    ).ok
    cache = FakePrefixCache()
    report = insert_snapshots(cache, lm.model, bos, str(lm.path), store)
    assert report.inserted == 1 and report.skipped == []
    (tokens,) = cache.entries
    # encode's BOS, then the template's tokens
    assert tokens == (1, *warm_prefix(lm.tokenizer, parse_warm_prompts(AGENTS).entries[0]).tokens)


# --- tokenization profiles ----------------------------------------------------------------


def _vllm_mlx_request_tokens(tokenizer, messages, model_name="demo"):
    """vllm-mlx 0.6's request path, written out: render with its kwargs, then encode with the
    tokenizer's defaults."""
    text = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking="coder" not in model_name.lower(),
    )
    return list(tokenizer.encode(text))


def test_kvsnap_profile_keeps_todays_prompt_digest_and_vllm_mlx_profile_changes_it():
    from kvsnap.chat import KVSNAP_TOKENIZATION
    from kvsnap.key import prompt_identity
    from kvsnap.profiles import vllm_mlx_tokenization

    assert KVSNAP_TOKENIZATION.descriptor() is None
    assert prompt_identity(
        "T", {"a": 1}, None, KVSNAP_TOKENIZATION.descriptor()
    ) == prompt_identity("T", {"a": 1}, None)
    qwen, coder = (
        vllm_mlx_tokenization("mlx-community/Qwen3-4B-4bit"),
        vllm_mlx_tokenization("mlx-community/Qwen3-Coder-30B"),
    )
    assert dict(qwen.template_defaults) == {"enable_thinking": True} and dict(
        coder.template_defaults
    ) == {"enable_thinking": False}
    assert (
        len(
            {
                prompt_identity("T", None, None),
                prompt_identity("T", None, None, qwen.descriptor()),
                prompt_identity("T", None, None, coder.descriptor()),
            }
        )
        == 3
    )
    served = vllm_mlx_tokenization("m", {"enable_thinking": False, "reasoning_effort": "low"})
    assert dict(served.template_defaults) == {"enable_thinking": False, "reasoning_effort": "low"}


def test_vllm_mlx_profile_warm_prefix_is_a_prefix_of_its_requests_with_the_bos_encode_adds(
    demo_models,
):
    from kvsnap.profiles import vllm_mlx_tokenization
    from kvsnap.prompts import parse_warm_prompts, warm_prefix

    tok = BosTokenizer(demo_models.load("dense").tokenizer)
    entry = parse_warm_prompts(AGENTS).entries[0]
    own = warm_prefix(tok, entry).tokens
    for_vllm = warm_prefix(tok, entry, vllm_mlx_tokenization("demo")).tokens
    assert for_vllm == (1, *own)
    request = _vllm_mlx_request_tokens(
        tok, [*entry.messages, {"role": "user", "content": "Please review"}]
    )
    assert tuple(request[: len(for_vllm)]) == for_vllm and tuple(request[: len(own)]) != own


def test_a_llama3_tokenizer_hits_in_both_servers_with_their_own_profile(tmp_path):
    """Real Llama-3 files: kvsnap serve's requests start with one BOS, vllm-mlx's with two; each
    profile's prefix matches its server."""
    from transformers import AutoTokenizer

    from kvsnap.chat import request_tokens
    from kvsnap.profiles import vllm_mlx_tokenization
    from kvsnap.prompts import parse_warm_prompts, warm_prefix

    tok = AutoTokenizer.from_pretrained(llama3_tokenizer_files(tmp_path / "llama3"))
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert prepended_special_tokens(tok) == [bos]
    entry = parse_warm_prompts([*AGENTS, PLANNER]).entries
    for e in entry:
        user = [*e.messages, {"role": "user", "content": "Another question, about rust"}]
        own = warm_prefix(tok, e).tokens
        kvsnap_request = request_tokens(tok, user)
        assert own[:2] != (bos, bos) and tuple(kvsnap_request[: len(own)]) == own
        for_vllm = warm_prefix(tok, e, vllm_mlx_tokenization("Llama-3.2-3B-Instruct")).tokens
        vllm_request = _vllm_mlx_request_tokens(tok, user, "Llama-3.2-3B-Instruct")
        assert for_vllm[:2] == (bos, bos) and tuple(vllm_request[: len(for_vllm)]) == for_vllm
        assert len(for_vllm) == len(own) + 1


def test_build_for_vllm_mlx_refuses_settings_vllm_mlx_cannot_use(tmp_path, capsys):
    from kvsnap.commands.cli import main as kvsnap_main

    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    for extra, words in [
        (["--served-model-name", "Qwen3-Coder"], "only applies with --for vllm-mlx"),
        (["--for", "vllm-mlx", "--kv-bits", "8"], "drop --kv-bits"),
        (["--for", "vllm-mlx", "--max-kv-size", "512"], "drop --max-kv-size"),
    ]:
        assert (
            kvsnap_main(
                [
                    "build",
                    str(agents),
                    "--model",
                    str(tmp_path / "no-model"),
                    "--out",
                    str(tmp_path / "snaps"),
                    *extra,
                ]
            )
            == 2
        )
        assert words in capsys.readouterr().err
    assert not (tmp_path / "snaps").exists()


# --- warm prompts from the store, against the stand-in cache ---------------------------


def _vllm_mlx_lm(demo_models, name="dense"):
    """The demo model as vllm-mlx sees it: a tokenizer whose encode adds a BOS."""
    from kvsnap.runtime.model.loading import LoadedModel

    lm = demo_models.load(name)
    return LoadedModel(
        path=lm.path,
        model=lm.model,
        tokenizer=BosTokenizer(lm.tokenizer),
        config=lm.config,
        settings=lm.settings,
    )


def test_warm_plan_takes_what_the_store_has_prefills_the_rest_once_and_writes_it_back(
    demo_models, tmp_path
):
    import mlx.core as mx

    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.key import DigestCache
    from kvsnap.profiles import vllm_mlx_tokenization
    from kvsnap.prompts import parse_warm_prompts
    from kvsnap.runtime.prefill.chunked import prefill_in_blocks
    from kvsnap.store.local import Store

    lm = _vllm_mlx_lm(demo_models)
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps([*AGENTS, PLANNER]))
    prompts = parse_warm_prompts([*AGENTS, PLANNER], str(agents))
    store = Store.open(tmp_path / "snaps", create=True)
    one = parse_warm_prompts(AGENTS, str(agents))
    built = build_snapshots(
        lm,
        one,
        store,
        str(agents),
        digests=DigestCache(),
        tokenization=vllm_mlx_tokenization("demo"),
    )
    assert built.ok and built.count("built") == 1

    first_cache = FakePrefixCache()
    first = _plan(lm, store, True, first_cache, prompts, str(agents)).run()
    assert (
        first.completed,
        first.from_snapshots,
        first.prefilled,
        first.written,
        first.skipped,
    ) == (2, 1, 1, 1, 0), first
    assert [(a.name, a.source, a.written) for a in first.agents] == [
        ("reviewer", "snapshot", False),
        ("planner", "prefilled", True),
    ]
    assert len(store.snapshot_files()) == 2
    # Every entry starts with the BOS vllm-mlx's encode adds, and holds exactly a fresh prefill's
    # state.
    # (A snapshot's state was prefilled block by block, at its chain's ends; the plan's own prefill
    # in one run.)
    chains = {i.tokens: [end for _, _, end in i.chain.blocks] for i in store.scan()[0]}
    for (tokens, state), agent in zip(first_cache.entries.items(), first.agents):
        assert tokens[0] == 1 and sum(len(t) for t in first_cache.entries) == first.prompt_tokens
        ends = chains[tuple(tokens)] if agent.source == "snapshot" else [len(tokens)]
        for got, want in zip(state, prefill_in_blocks(lm, tokens, ends)):
            assert got.offset == len(tokens)
            assert mx.array_equal(got.keys[..., : len(tokens), :], want.keys[..., : len(tokens), :])

    second_cache = FakePrefixCache()
    second = _plan(lm, store, True, second_cache, prompts, str(agents)).run()
    assert (second.completed, second.from_snapshots, second.prefilled, second.written) == (
        2,
        2,
        0,
        0,
    ), second
    assert set(second_cache.entries) == set(first_cache.entries)


def test_warm_plan_on_a_read_only_store_prefills_without_writing_and_names_foreign_renderings(
    demo_models, tmp_path
):
    from kvsnap.build.pipeline import build_snapshots
    from kvsnap.key import DigestCache
    from kvsnap.prompts import parse_warm_prompts
    from kvsnap.store.local import Store

    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps(AGENTS))
    prompts = parse_warm_prompts(AGENTS, str(agents))
    writable = Store.open(tmp_path / "snaps", create=True)
    # Built for kvsnap serve's rendering: the same agent, but no BOS from encode.
    assert build_snapshots(
        demo_models.load("dense"), prompts, writable, str(agents), digests=DigestCache()
    ).ok
    before = sorted(p.name for p in writable.snapshot_files())
    store = Store.open(tmp_path / "snaps", readonly=True)
    report = _plan(
        _vllm_mlx_lm(demo_models), store, False, FakePrefixCache(), prompts, str(agents)
    ).run()
    assert (report.completed, report.from_snapshots, report.prefilled, report.written) == (
        1,
        0,
        1,
        0,
    ), report
    assert any(
        "built for a rendering vllm-mlx will not use" in w
        and "kvsnap serve's" in w
        and "--for vllm-mlx" in w
        for w in report.warnings
    ), report.warnings
    assert sorted(p.name for p in store.snapshot_files()) == before
    # Without a BOS from encode the same snapshot holds exactly vllm-mlx's tokens: it is used as is.
    same = _plan(
        demo_models.load("dense"), store, False, FakePrefixCache(), prompts, str(agents)
    ).run()
    assert (same.completed, same.from_snapshots, same.prefilled, same.warnings) == (1, 1, 0, []), (
        same
    )


def test_warm_plan_skips_prefixes_vllm_mlx_would_never_reuse(demo_models, tmp_path):
    from kvsnap.prompts import parse_warm_prompts
    from kvsnap.store.local import Store

    prompts = parse_warm_prompts([*AGENTS, ["not a message"]], "inline")
    store = Store.open(tmp_path / "snaps", create=True)
    report = _plan(
        _vllm_mlx_lm(demo_models),
        store,
        True,
        FakePrefixCache(min_prefix_tokens=100_000),
        prompts,
        "inline",
    ).run()
    assert (report.completed, report.skipped, report.prefilled) == (0, 2, 0)
    assert any("minimum reusable prefix" in a.reason for a in report.agents) and any(
        "entry 1" in a.name for a in report.agents
    )
    assert store.snapshot_files() == []


def test_deletes_during_a_running_rewarm_coalesce_into_one_more_pass(tmp_path):
    import asyncio

    from kvsnap.integrations.common.warm_plan import WarmReport
    from kvsnap.integrations.vllm_mlx.session import Session

    running, most, passes = [0], [0], []
    release = threading.Event()

    def work():
        running[0] += 1
        most[0] = max(most[0], running[0])
        release.wait(10)
        passes.append(len(passes))
        running[0] -= 1
        return WarmReport(completed=1, from_snapshots=1)

    async def scenario():
        session = Session(server=None, store=SimpleNamespace(root=tmp_path), writable=False)
        assert session.schedule_rewarm() is False  # nothing warmed yet: nothing to re-warm
        session._work, session._run = work, asyncio.to_thread
        assert session.schedule_rewarm() is True
        await asyncio.sleep(0.05)
        # three DELETEs while it runs
        assert [session.schedule_rewarm() for _ in range(3)] == [True, True, True]
        assert session.status()["rewarm_running"] is True
        release.set()
        while session.status()["rewarm_running"]:
            await asyncio.sleep(0.01)
        return session.status()

    status = asyncio.run(scenario())
    assert passes == [0, 1] and most[0] == 1  # one more pass for all three, never two at once
    assert status["rewarms"] == 2 and status["last"]["from_snapshots"] == 1


# --- end to end, in vllm-mlx's own environment ------------------------------------------


def _scheduled(log: str) -> list[tuple[int, int, int]]:
    """(prompt_tokens, tokens_to_prefill, cached) from vllm-mlx's own [schedule] log lines."""
    return [
        (int(a), int(b), int(c or 0))
        for a, b, c in re.findall(
            r"\[schedule\] request=\S+ uid=\d+ prompt_tokens=(\d+) tokens_to_prefill=(\d+)(?:, "
            r"(\d+) cached)?",
            log,
        )
    ]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_vllm_mlx_starts_warm_from_snapshots_and_answers_like_a_cold_vllm_mlx(
    world, arch, tmp_path
):
    from kvsnap.blas import find_openblas

    model = str(world.models[arch])
    users = ["Please review the server code.", "Another question, about rust"]
    n = world.n_tokens[arch]
    assert n > 128  # vllm-mlx ignores shorter prefixes

    # kvsnap vllm-mlx serve ... --kv-snapshots: the snapshot is in the cache before the port opens.
    home = tmp_path / "home-kvsnap"
    home.mkdir()
    warm = _launch(
        [
            str(world.python),
            "-m",
            "kvsnap",
            "vllm-mlx",
            "serve",
            model,
            "--continuous-batching",
            "--kv-snapshots",
            str(world.store),
        ],
        home,
        tmp_path / "kvsnap.log",
    )
    try:
        ready_s = warm.wait_ready(180)
        status = httpx.get(f"{warm.url}/v1/status", timeout=10).json()
        warm_answers = [_ask(warm, model, u) for u in users]
    finally:
        assert warm.stop() == 0, warm.log()[-3000:]
    log = warm.log()
    # No warm-up prefill at start: no step ran, no prompt token was computed, one entry is cached
    # (the "[kvsnap] Warm start ..." log line says the same to people).
    assert (
        status["steps_executed"],
        status["total_prompt_tokens"],
        status["total_requests_processed"],
    ) == (0, 0, 0), status
    assert status["cache"]["entry_count"] == 1 and status["cache"]["hits"] == 0, status["cache"]
    assert "Warming prefix cache" not in log
    # The other snapshots in the store are skipped, with the reason.
    assert log.count("skipped snapshot") >= 2 and "built for another model" in log
    if world.venv_minor != mlx_lm_minor():
        assert "mlx_lm_minor" in log  # the one built under this suite's mlx-lm
    # The requests' own figures: the snapshot's tokens were not computed.
    for answer in warm_answers:
        assert answer["cached_tokens"] == n and answer["hit"] == "prefix", answer
    assert [(p, p - n, n) for p in (a["prompt_tokens"] for a in warm_answers)] == _scheduled(log)
    # vllm-mlx's disk cache was neither read nor written.
    assert "not saved to ~/.cache/vllm-mlx/prefix_cache" in log
    assert not (home / ".cache" / "vllm-mlx").exists()

    # Plain vllm-mlx, cold, same BLAS: the same greedy answers from a full prefill.
    cold_home = tmp_path / "home-cold"
    cold_home.mkdir()
    blas = find_openblas()
    cold = _launch(
        [str(world.python), "-m", "vllm_mlx.cli", "serve", model, "--continuous-batching"],
        cold_home,
        tmp_path / "cold.log",
        {"LD_PRELOAD": blas} if blas else None,
    )
    try:
        cold_ready_s = cold.wait_ready(180)
        cold_answers = [_ask(cold, model, u) for u in users]
    finally:
        cold.stop()
    assert cold_answers[0]["cached_tokens"] == 0
    assert _scheduled(cold.log())[0] == (
        cold_answers[0]["prompt_tokens"],
        cold_answers[0]["prompt_tokens"],
        0,
    )
    assert [a["text"] for a in warm_answers] == [a["text"] for a in cold_answers]
    assert [a["prompt_tokens"] for a in warm_answers] == [a["prompt_tokens"] for a in cold_answers]
    # What the launcher keeps out of the user's home: plain vllm-mlx saves its cache there on
    # shutdown.
    assert (cold_home / ".cache" / "vllm-mlx" / "prefix_cache").is_dir()
    print(
        f"\n{arch}: ready {ready_s:.1f}s warm vs {cold_ready_s:.1f}s cold; warm "
        f"{[(a['prompt_tokens'], a['cached_tokens']) for a in warm_answers]}, cold "
        f"{[(a['prompt_tokens'], a['cached_tokens']) for a in cold_answers]}"
    )


@pytest.mark.slow
def test_kv_snapshots_without_continuous_batching_is_a_usage_error(world, tmp_path):
    r = subprocess.run(
        [
            str(world.python),
            "-m",
            "kvsnap",
            "vllm-mlx",
            "serve",
            str(world.models["dense"]),
            "--kv-snapshots",
            str(world.store),
        ],
        capture_output=True,
        text=True,
        env=_venv_env(tmp_path),
        timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "add --continuous-batching" in r.stderr


PIN_CHECK = """
import json
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from vllm_mlx.memory_cache import MemoryAwarePrefixCache, MemoryCacheConfig
from kvsnap.integrations.vllm_mlx.pin import pin


def layers(n):  # one KV layer of n tokens: 1 KiB per token
    c = KVCache()
    k = mx.ones((1, 2, n, 64))
    c.update_and_fetch(k, k)
    return [c]


def run(pinned):
    config = MemoryCacheConfig(max_memory_mb=1, min_prefix_tokens=1)
    cache = MemoryAwarePrefixCache(model=None, config=config)
    pins = pin(cache) if pinned else None
    snap = list(range(300))
    assert cache.store(snap, layers(300), evict_prefixes=False)
    if pins:
        pins.add(snap)
    out = {}
    for i in range(5):  # LRU pressure: five 300-token entries through a 1,024-token budget
        cache.store([1000 + i] * 300, layers(300))
    out["lru"] = tuple(snap) in cache._entries
    cache.store([2000] * 10, layers(10))  # an unpinned prefix of the next entry
    # a prompt entry past the snapshot
    cache.store(snap + [7] * 100, layers(400), evict_prefixes=True)
    cache.store([2000] * 10 + [3] * 5, layers(15), evict_prefixes=True)
    out["prefix_evict"] = tuple(snap) in cache._entries
    out["unpinned_prefix_evicted"] = (2000,) * 10 not in cache._entries
    cache.remove(snap)  # a chunked prefill dropping its previous intermediate entry
    out["remove"] = tuple(snap) in cache._entries
    out["big_stored"] = cache.store([5] * 1000, layers(1000))  # fits only if the snapshot goes
    out["big"] = tuple(snap) in cache._entries
    held = sum(e.memory_bytes for e in cache._entries.values())
    out["accounting"] = cache._current_memory == held <= cache._max_memory
    cache.clear()
    out["cleared"] = len(cache._entries) == 0 and (pins is None or not pins.keys)
    return out


print(json.dumps({"pinned": run(True), "plain": run(False)}))
"""


@pytest.mark.slow
def test_pinned_snapshots_survive_vllm_mlx_lru_prefix_eviction_and_remove(
    vllm_mlx_python, tmp_path
):
    """On vllm-mlx's own MemoryAwarePrefixCache; the same sequence without the pin loses the
    snapshot."""
    r = subprocess.run(
        [str(vllm_mlx_python), "-c", PIN_CHECK],
        capture_output=True,
        text=True,
        env=_venv_env(tmp_path),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["pinned"] == {
        "lru": True,
        "prefix_evict": True,
        "unpinned_prefix_evicted": True,
        "remove": True,
        "big_stored": False,
        "big": True,
        "accounting": True,
        "cleared": True,
    }
    assert result["plain"] == {
        "lru": False,
        "prefix_evict": False,
        "unpinned_prefix_evicted": True,
        "remove": False,
        "big_stored": True,
        "big": False,
        "accounting": True,
        "cleared": True,
    }
    assert "PinnedCacheFull" in r.stderr  # vllm-mlx's own log line for the refused entry


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dense", "hybrid", "llama3"])
def test_warm_prompts_come_from_the_store_and_survive_restart_eviction_and_delete(
    world, arch, tmp_path
):
    from kvsnap.blas import find_openblas

    model = str(world.models[arch])
    home = tmp_path / "home"
    home.mkdir()
    agents = tmp_path / "agents.json"
    # vllm-mlx's own file shape
    agents.write_text(json.dumps([[*AGENTS[0]["messages"]], [*PLANNER["messages"]]]))
    only_first = tmp_path / "first.json"
    only_first.write_text(json.dumps([[*AGENTS[0]["messages"]]]))
    store = tmp_path / "snaps"
    _venv_kvsnap(
        world.python,
        home,
        "build",
        only_first,
        "--model",
        model,
        "--out",
        store,
        "--for",
        "vllm-mlx",
    )
    reviewer, planner = AGENTS[0]["messages"][0], PLANNER["messages"][0]
    questions = [
        (reviewer, "Please review the server code."),
        (planner, "Plan the database migration."),
    ]
    serve = [
        str(world.python),
        "-m",
        "kvsnap",
        "vllm-mlx",
        "serve",
        model,
        "--continuous-batching",
        "--kv-snapshots",
        str(store),
        "--warm-prompts",
        str(agents),
    ]

    # First start: the reviewer from its snapshot, the planner prefilled once and written back.
    first = _launch(serve, home, tmp_path / "first.log")
    try:
        first.wait_ready(180)
        report, status = (
            _kvsnap_status(first),
            httpx.get(f"{first.url}/v1/status", timeout=10).json(),
        )
        answers = [_ask(first, model, user, 24, system) for system, user in questions]
        if arch == "hybrid":
            # More than 4,096 tokens past the snapshot: vllm-mlx stores this prompt with
            # evict_prefixes=True.
            long_run = _ask(first, model, LONG_SYSTEM * 18, 2, reviewer)
            after_long = _ask(first, model, "And the tests?", 8, reviewer)
    finally:
        assert first.stop() == 0, first.log()[-3000:]
    log = first.log()
    last = report["last"]
    assert (
        last["completed"],
        last["from_snapshots"],
        last["prefilled"],
        last["written"],
        last["skipped"],
    ) == (2, 1, 1, 1, 0), report
    assert [(a["name"], a["source"], a["written"]) for a in last["agents"]] == [
        ("agent-0", "snapshot", False),
        ("agent-1", "prefilled", True),
    ]
    assert "Warming prefix cache" not in log  # vllm-mlx's own warm-up never ran
    assert (
        status["steps_executed"],
        status["total_prompt_tokens"],
        status["cache"]["entry_count"],
    ) == (0, 0, 2), status
    warm_tokens = {a["name"]: a["tokens"] for a in last["agents"]}
    assert [a["cached_tokens"] for a in answers] == [
        warm_tokens["agent-0"],
        warm_tokens["agent-1"],
    ], answers
    if arch == "hybrid":
        assert (
            long_run["prompt_tokens"] - warm_tokens["agent-0"] > 4096
            and long_run["cached_tokens"] == warm_tokens["agent-0"]
        ), long_run
        # vllm-mlx kept the long prompt's own entry (stored with evict_prefixes=True), and the
        # snapshot stayed.
        assert re.search(
            rf"\[cache_store_prompt\] request=\S+ key_tokens=\d+ "
            rf"prompt_tokens={long_run['prompt_tokens']} stored=True",
            log,
        ), log[-3000:]
        assert after_long["cached_tokens"] == warm_tokens["agent-0"], after_long
    assert len(list((store / "snapshots").iterdir())) == 2
    if arch == "llama3":  # vllm-mlx's requests start with two BOS, and so do the snapshots now
        from kvsnap.store.local import Store

        assert all(
            Store.open(store, readonly=True).read_tokens(i)[:2] == [128000, 128000]
            for i in Store.open(store, readonly=True).scan()[0]
        )

    # Second start, behind vllm-mlx's own --api-key and with a small cache: nothing prefilled.
    key = {"Authorization": "Bearer kvsnap-test-key"}
    # Room for the snapshots and one other entry the size of the reviewer's, not two.
    per_token_mib = report["pinned_mib"] / sum(warm_tokens.values())
    budget = math.ceil(report["pinned_mib"] + per_token_mib * (warm_tokens["agent-0"] + 24))
    second = _launch(
        [*serve, "--api-key", "kvsnap-test-key", "--cache-memory-mb", str(budget)],
        home,
        tmp_path / "second.log",
    )
    try:
        second.wait_ready(180)
        assert httpx.get(f"{second.url}/v1/kvsnap/status", timeout=10).status_code == 401
        assert httpx.delete(f"{second.url}/v1/cache/prefix", timeout=10).status_code == 401
        again = _kvsnap_status(second, key)["last"]
        # Eviction pressure: other agents' requests fill the cache past --cache-memory-mb.
        for i in range(5):
            _ask(
                second,
                model,
                f"Question {i}",
                4,
                {"role": "system", "content": f"Agent {i}. " + LONG_SYSTEM},
                key,
            )
        pressure = httpx.get(f"{second.url}/v1/status", headers=key, timeout=10).json()["cache"]
        after_pressure = _ask(second, model, "Please review the client code.", 8, reviewer, key)
        cleared = httpx.delete(f"{second.url}/v1/cache/prefix", headers=key, timeout=10).json()
        deadline = time.monotonic() + 60
        while (s := _kvsnap_status(second, key))["rewarms"] < 1 or s["rewarm_running"]:
            assert time.monotonic() < deadline, s
            time.sleep(0.05)
        after_delete = _ask(second, model, "Plan the next release.", 8, planner, key)
    finally:
        assert second.stop() == 0, second.log()[-3000:]
    assert (again["from_snapshots"], again["prefilled"]) == (2, 0), again
    assert pressure["evictions"] > 0, pressure
    assert after_pressure["cached_tokens"] == warm_tokens["agent-0"], after_pressure
    assert cleared == {"status": "cleared", "rewarm_scheduled": True}
    assert (s["last"]["from_snapshots"], s["last"]["prefilled"], s["pinned"]) == (2, 0, 2), s
    assert after_delete["cached_tokens"] == warm_tokens["agent-1"], after_delete

    # Plain vllm-mlx, cold: the same answers.
    blas = find_openblas()
    cold_home = tmp_path / "home-cold"
    cold_home.mkdir()
    cold = _launch(
        [str(world.python), "-m", "vllm_mlx.cli", "serve", model, "--continuous-batching"],
        cold_home,
        tmp_path / "cold.log",
        {"LD_PRELOAD": blas} if blas else None,
    )
    try:
        cold.wait_ready(180)
        cold_answers = [_ask(cold, model, user, 24, system) for system, user in questions]
    finally:
        cold.stop()
    assert [a["cached_tokens"] for a in cold_answers] == [0, 0]
    assert [(a["text"], a["prompt_tokens"]) for a in answers] == [
        (a["text"], a["prompt_tokens"]) for a in cold_answers
    ]
