"""`--kv-bits` with `--quantized-kv-start S > 0`: a prefix below S is unquantized, one past it
quantized (mlx-lm converts the cache once its offset reaches S), so the same tokens have two
forms. A conversation crossing S is persisted and restored whole, a build whose agents sit on
both sides of S verifies, and an in-memory prefix captured below S serves a longer turn.

Real `kvsnap serve` processes on loopback, a real store, the tiny dense demo model."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers.cli import run_kvsnap
from helpers.models import LONG_SYSTEM
from helpers.persist_servers import (
    CONVERSATION,
    Conversation,
    ask,
    assert_sound,
    cached,
    content,
    record_lengths,
    sigterm,
    start,
    wait_written,
)

from kvsnap.tools.serverproc import ServerProcess, free_port, start_server

# The conversation's prompts are 293, 334, 553 and 590 tokens: turns 1 and 2 are captured
# below the start, turns 3 and 4 past it, and turn 3's first block is turn 1's tokens.
START = 512
KV_FLAGS = ("--kv-bits", "8", "--quantized-kv-start", str(START))
TURNS = len(CONVERSATION.users)


def _conversation(client: httpx.Client, server: ServerProcess, model: Path, turns, replies):
    for turn in turns:
        body = CONVERSATION.body(model, turn, [content(r) for r in replies])
        replies.append(ask(client, server, body))
    return replies


@pytest.fixture(scope="module")
def model(demo_models) -> Path:
    return demo_models.path("dense")


@pytest.fixture(scope="module")
def never_restarted(model, tmp_path_factory):
    """Every turn on a server that keeps its in-memory prefixes, and each turn's answer after a
    fresh prefill (its own namespace: nothing cached), on the same server."""
    tmp = tmp_path_factory.mktemp("quantized-start-reference")
    server = start(model, None, tmp / "reference.log", extra=KV_FLAGS)  # persisting nothing
    try:
        with httpx.Client(timeout=120) as client:
            replies = _conversation(client, server, model, range(1, TURNS + 1), [])
            fresh = []
            for turn in range(1, TURNS + 1):
                salted = Conversation(CONVERSATION.system, salt=f"fresh-{turn}")
                reply = ask(client, server, salted.body(model, turn, [content(r) for r in replies]))
                assert cached(reply) == 0
                fresh.append(content(reply))
        yield replies, fresh, server.status(), server.log()
    finally:
        server.stop()


def test_a_prefix_captured_below_the_start_serves_the_turns_that_reach_past_it(never_restarted):
    replies, fresh, status, log = never_restarted
    prompts = [r["usage"]["prompt_tokens"] for r in replies]
    assert prompts[1] < START < prompts[2], prompts  # the conversation crosses the start
    # each turn hits at least the whole prompt of the one before (minus its last token), and
    # past it the reply's tokens as far as the next prompt re-renders them (issue 41 item 3)
    hits = [cached(r) for r in replies]
    assert hits[0] == 0 and all(
        p - 1 <= hit < nxt for p, hit, nxt in zip(prompts, hits[1:], prompts[1:])
    ), (hits, prompts, log[-3000:])
    assert any(hit > p - 1 for p, hit in zip(prompts, hits[1:])), (hits, prompts)
    assert "rejected" not in log, log[-3000:]
    assert status["cache"]["load_errors"] == 0, status["cache"]
    assert [content(r) for r in replies] == fresh


def test_a_conversation_crossing_the_start_verifies_after_sigterm_and_resumes_whole(
    model, never_restarted, tmp_path
):
    replies_ref, fresh, _, _ = never_restarted
    store = tmp_path / "store"
    server = start(model, store, tmp_path / "server.log", extra=KV_FLAGS)
    replies: list[dict] = []
    try:
        with httpx.Client(timeout=120) as client:
            _conversation(client, server, model, range(1, TURNS), replies)
            wait_written(server, TURNS - 1)
        sigterm(server)
    finally:
        server.stop()
    lengths = record_lengths(store)
    assert max(lengths) >= START, lengths  # the latest record is quantized
    assert_sound(store)  # verify OK: no record names a block of the other form
    server = start(model, store, tmp_path / "restarted.log", extra=KV_FLAGS)
    try:
        with httpx.Client(timeout=120) as client:
            _conversation(client, server, model, [TURNS], replies)
        persist = server.status()["persist"]
    finally:
        server.stop()
    # the previous turn's records: its prompt's, and its reply's where that reply was long
    # enough to persist (MIN_PERSISTED_REPLY); memory alone may hold a short reply too
    prompts = [r["usage"]["prompt_tokens"] for r in replies]
    assert prompts[-2] - 1 <= cached(replies[-1]) <= cached(replies_ref[-1]), server.log()[-3000:]
    assert persist["disk_hits"] == 1 and persist["load_errors"] == 0, persist
    assert [content(r) for r in replies] == [content(r) for r in replies_ref] == fresh


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_a_build_whose_agents_sit_on_both_sides_of_the_start_verifies(
    family, demo_models, tmp_path
):
    """Two agents sharing their first blocks: one ends below the start (unquantized), the other
    past it (quantized); each record names only blocks of its own form. On the hybrid the long
    agent's chain has checkpoints below the start (the branch point): unquantized states there."""
    model = demo_models.path(family)
    agents = tmp_path / "agents.json"
    short = LONG_SYSTEM
    agents.write_text(
        json.dumps(
            [
                {"name": "short", "messages": [{"role": "system", "content": short}]},
                {"name": "long", "messages": [{"role": "system", "content": short * 3}]},
            ]
        )
    )
    store = tmp_path / "store"
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    built = run_kvsnap(
        "build", agents, "--model", model, "--out", store, *KV_FLAGS, "--json", env=env
    )
    assert built.returncode == 0, built.stdout + built.stderr
    report = json.loads(built.stdout)
    sizes = sorted(e["n_tokens"] for e in report["entries"])
    assert sizes[0] < START <= sizes[1], sizes
    verified = run_kvsnap("verify", store, env=env)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def _rewrite_file(path: Path, target: Path, change) -> None:
    """Write ``path``'s tensors to ``target`` with ``change(meta)`` applied to its header (a fresh
    checksum); ``path`` is removed when it is not ``target``."""
    from kvsnap.snapshot.file import OutTensor, read_header, tensor_bytes, write_snapshot
    from kvsnap.snapshot.format import CHECKSUM_KEY

    header = read_header(path)
    meta = {k: v for k, v in header.metadata.items() if k != CHECKSUM_KEY}
    change(meta)
    tensors = [
        OutTensor(name, e.dtype, e.shape, memoryview(tensor_bytes(path, header, name)))
        for name, e in header.tensors.items()
    ]
    with open(target.with_name(target.name + ".new"), "wb") as f:
        write_snapshot(f, tensors, meta)
    target.with_name(target.name + ".new").replace(target)
    if path != target:
        path.unlink()


def _as_written_before_the_form_was_keyed(store: Path) -> int:
    """Rename every block to the key it had before keys named the KV form (no form in the key
    or the header) and point the records at them; returns how many blocks were renamed."""
    from kvsnap.snapshot.blocks import block_key
    from kvsnap.snapshot.file import read_header
    from kvsnap.snapshot.format import CHAIN, KV_FORM

    renamed = {}
    for path in sorted((store / "blocks").glob("*.safetensors")):
        fields = read_header(path).metadata
        start, digest = int(fields["kvsnap.start"]), fields["kvsnap.prefix_digest"]
        old = block_key(fields["kvsnap.model_digest"], start, digest)
        renamed[path.stem] = old

        def legacy(m, old=old):
            m.pop(KV_FORM)
            m["kvsnap.key"] = old

        _rewrite_file(path, path.with_name(f"{old}.safetensors"), legacy)
    for path in (store / "snapshots").glob("*.safetensors"):

        def relink(m):
            chain = json.loads(m[CHAIN])
            chain["blocks"] = [[renamed[k], s, e] for k, s, e in chain["blocks"]]
            m[CHAIN] = json.dumps(chain)

        _rewrite_file(path, path, relink)
    return len(renamed)


def test_a_store_written_before_keys_named_the_form_still_verifies_and_serves(model, tmp_path):
    """Old records name blocks by the formula without a form: they still verify, load and
    serve (their blocks are checked against the record's layer list when read)."""
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps([{"name": "long", "messages": [{"role": "system", "content": LONG_SYSTEM * 3}]}])
    )
    store = tmp_path / "store"
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    built = run_kvsnap("build", agents, "--model", model, "--out", store, *KV_FLAGS, env=env)
    assert built.returncode == 0, built.stdout + built.stderr
    assert _as_written_before_the_form_was_keyed(store) >= 2
    verified = run_kvsnap("verify", store, env=env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    server = start_server(
        model,
        ["--continuous-batching", "--kv-snapshots", str(store), *KV_FLAGS],
        tmp_path / "server.log",
        env=env,
        limit_s=300,
    )
    try:
        server.wait_ready(120)
        warm = server.status()["snapshots"]
        body = {
            "model": model.name,
            "messages": [
                {"role": "system", "content": LONG_SYSTEM * 3},
                {"role": "user", "content": "Which test first?"},
            ],
            "max_tokens": 4,
            "temperature": 0,
        }
        with httpx.Client(timeout=120) as client:
            reply = ask(client, server, body)
    finally:
        server.stop()
    assert warm["rejected"] == 0 and warm["indexed"] == 1, warm
    assert cached(reply) > START, server.log()[-3000:]


@pytest.mark.parametrize("command", ["build", "serve"])
def test_kv_bits_on_a_sliding_window_model_is_refused_at_load_naming_the_layer(
    command, demo_models, tmp_path
):
    """mlx-lm cannot quantize a RotatingKVCache: the server used to start, say ready, then fail
    every request reaching the start with a 500 (NotImplementedError), and build ended in a
    traceback. Both refuse at load, naming the layer, the setting and the fix."""
    model = demo_models.path("sliding")
    flags = ("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "100")
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    if command == "build":
        agents = tmp_path / "agents.json"
        agents.write_text(
            json.dumps([{"name": "a", "messages": [{"role": "system", "content": LONG_SYSTEM}]}])
        )
        args = ("build", agents, "--model", model, "--out", tmp_path / "store")
    else:
        args = ("serve", model, "--port", str(free_port()))  # it must get as far as the load
    done = run_kvsnap(*args, *flags, env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for said in ("--kv-bits 4", "cache layer 0 is a RotatingKVCache", "drop --kv-bits"):
        assert said in done.stderr, done.stderr


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_a_start_exactly_at_a_warm_prompts_end_restores_there(family, demo_models, tmp_path):
    """--quantized-kv-start S exactly at a warm prompt's length, which is also its last block's
    end: mlx-lm quantizes once the offset reaches S, so the state at S is quantized, and a
    longer agent built later restores the stored blocks (and, on the hybrid, the checkpoint)
    up to S and prefills only the rest. Taken as unquantized at S (`>` for `>=`), the point
    was refused and the whole agent prefilled; the hybrid's checkpoint at S left out of the
    chain (`<=` for `<`), likewise."""
    from kvsnap.prompts import parse_warm_prompts, warm_prefix

    model = demo_models.path(family)
    short = {"name": "short", "messages": [{"role": "system", "content": LONG_SYSTEM}]}
    longer = {
        "name": "longer",
        "messages": short["messages"]
        + [
            {"role": "user", "content": "Review the parser module and list every bug you find."},
            {"role": "assistant", "content": "I will start with the tests."},
        ],
    }
    tokenizer = demo_models.load(family).tokenizer
    start = len(warm_prefix(tokenizer, parse_warm_prompts([short]).entries[0]).tokens)
    assert start > 256 and start % 256 != 0, start  # past the first block, not on the grid
    flags = ("--kv-bits", "8", "--quantized-kv-start", str(start))
    store = tmp_path / "store"
    env = {"KVSNAP_CACHE_DIR": str(tmp_path / "cache")}
    reports = []
    for agents in ([short], [short, longer]):
        path = tmp_path / f"agents-{len(agents)}.json"
        path.write_text(json.dumps(agents))
        built = run_kvsnap(
            "build", path, "--model", model, "--out", store, *flags, "--json", env=env
        )
        assert built.returncode == 0, built.stdout + built.stderr
        reports.append({e["name"]: e for e in json.loads(built.stdout)["entries"]})
    assert reports[0]["short"]["n_tokens"] == start
    second = reports[1]["longer"]
    assert second["n_tokens"] > start
    assert second["tokens_reused"] == start, second
    assert second["tokens_prefilled"] == second["n_tokens"] - start, second
    verified = run_kvsnap("verify", store, env=env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
