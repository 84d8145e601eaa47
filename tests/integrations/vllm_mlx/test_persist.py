"""`kvsnap vllm-mlx serve --kv-snapshots DIR --persist-requests` (the vllm-mlx route):
the prefix entries vllm-mlx keeps are written behind into the kvsnap store and read back after
a restart or a crash.

The fast tests run here: the flags, and the hooks on a stand-in for vllm-mlx's prefix cache
holding mlx-lm caches. The end-to-end test runs vllm-mlx's real server in the cached vllm-mlx
environment of tests/integrations/vllm_mlx/test_route.py (its fixtures and helpers).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from types import SimpleNamespace

import httpx
import pytest
from helpers.cli import run_kvsnap
from helpers.persist_servers import server_pid
from helpers.vllm_mlx_route import AGENTS, _kvsnap_status, _launch, _polled, _venv_kvsnap

from kvsnap.errors import UsageError
from kvsnap.integrations.vllm_mlx.launcher import persist_options, split_persist_argv
from kvsnap.integrations.vllm_mlx.persist import PersistHooks

USERS = (
    "Please review the server code.",
    "Now the client code, please.",
    "And the tests?",
    "Summarize what to fix first.",
)
MAX_TOKENS = 40

# --- flags ------------------------------------------------------------------------------


def test_persist_flags_split_off_and_are_checked_like_kvsnap_serves():
    found, rest = split_persist_argv(
        ["M", "--persist-requests", "--port", "9", "--persist-max-gb=2.5", "--api-key", "k"]
    )
    assert rest == ["M", "--port", "9", "--api-key", "k"]
    assert found == {
        "persist_requests": True,
        "persist_max_gb": 2.5,
        "persist_flush_timeout": None,
    }
    opts = persist_options(SimpleNamespace(kv_snapshots="s", **found))
    assert (opts.max_bytes, opts.flush_timeout_s) == (int(2.5 * 2**30), 5.0)
    assert persist_options(SimpleNamespace(kv_snapshots="s", **split_persist_argv([])[0])) is None
    for argv, words in [
        (["--persist-max-gb", "0"], "not a positive number"),
        (["--persist-flush-timeout", "soon"], "not a positive number"),
        (["--persist-max-gb"], "--persist-max-gb needs a positive number"),
    ]:
        with pytest.raises(UsageError, match=words):
            split_persist_argv(argv)
    with pytest.raises(UsageError, match="--persist-max-gb 3 needs --persist-requests"):
        persist_options(
            SimpleNamespace(kv_snapshots="s", **split_persist_argv(["--persist-max-gb", "3"])[0])
        )
    with pytest.raises(UsageError, match="needs a store to write into; add --kv-snapshots DIR"):
        persist_options(
            SimpleNamespace(kv_snapshots=None, **split_persist_argv(["--persist-requests"])[0])
        )


@pytest.mark.parametrize(
    "flag, text, words",
    [
        ("--persist-max-gb", "inf", "--persist-max-gb inf must be a number of GB above 0"),
        ("--persist-max-gb", "1e300", "--persist-max-gb 1e[+]300 must be a number of GB above 0"),
        (
            "--persist-flush-timeout",
            "inf",
            "--persist-flush-timeout inf must be a number of second",
        ),
    ],
)
def test_persist_values_out_of_range_are_refused_in_one_line_not_a_traceback(flag, text, words):
    """The route's parser takes any positive number; the one persist_options bounds it (inf GB
    overflowed int() into a traceback, an inf flush timeout never ended a shutdown)."""
    found = split_persist_argv(["--persist-requests", flag, text])[0]
    with pytest.raises(UsageError, match=words):
        persist_options(SimpleNamespace(kv_snapshots="s", **found))


def test_kvsnap_serve_refuses_an_infinite_persist_budget_naming_its_unit(tmp_path):
    r = run_kvsnap("serve", tmp_path, "--persist-requests", "--persist-max-gb", "inf")
    assert r.returncode == 2, r.stderr
    assert "inf must be a positive number of GB" in r.stderr


def test_persist_requests_refuses_vllm_mlx_quantized_entries():
    found = split_persist_argv(["--persist-requests"])[0]
    with pytest.raises(UsageError, match="--kv-cache-quantization.*drop one of the two"):
        persist_options(SimpleNamespace(kv_snapshots="s", kv_cache_quantization=True, **found))


def test_persist_requests_without_kv_snapshots_is_a_usage_error(tmp_path):
    r = run_kvsnap("vllm-mlx", "serve", tmp_path, "--continuous-batching", "--persist-requests")
    assert r.returncode == 2, r.stderr
    assert "--persist-requests needs a store to write into; add --kv-snapshots DIR" in r.stderr


# --- the hooks, on a stand-in for vllm-mlx's MemoryAwarePrefixCache ------------------------


class FakeCache:
    """vllm-mlx 0.6's MemoryAwarePrefixCache, as far as the hooks use it: store publishes
    through the instance's commit_prepared; fetch is a longest-prefix match."""

    def __init__(self):
        self._entries: dict = {}
        self._stats = SimpleNamespace(hits=0, misses=0, tokens_saved=0)
        self._last_matched_key = None

    def store(self, tokens, cache, evict_prefixes=True):
        return self.commit_prepared(SimpleNamespace(tokens=tuple(tokens), cache=cache))

    def commit_prepared(self, entry, evict_prefixes=True):
        self._entries[entry.tokens] = entry
        return True

    def remove(self, tokens):
        return self._entries.pop(tuple(tokens), None) is not None

    def fetch(self, tokens):
        keys = [k for k in self._entries if tuple(tokens[: len(k)]) == k and len(k) < len(tokens)]
        if not keys:
            self._stats.misses += 1
            return None, tokens
        self._stats.hits += 1
        self._last_matched_key = key = max(keys, key=len)
        return self._entries[key].cache, tokens[len(key) :]


class FakePersister:
    def __init__(self):
        self.captured_calls: list = []
        self.pumps = 0

    def captured(self, entry, extends):
        self.captured_calls.append((len(entry.tokens), entry.state[0].offset, extends))

    def pump(self):
        self.pumps += 1

    def persisted_for(self, tokens, namespace, above):
        assert namespace == ""
        return None


def _kv(n: int) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    layer = KVCache()
    layer.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
    return [layer]


def test_hooks_persist_the_entry_and_its_prompt_only_cut_superseding_the_turn_they_continue():
    cache, persister = FakeCache(), FakePersister()
    hooks = PersistHooks(cache, persister, identity=None, shapes=None)
    hooks.install()
    p1 = tuple(range(100, 140))
    cache.fetch(list(p1))  # the request's lookup: its prompt
    t1 = p1 + (7, 8, 9)
    assert cache.store(list(t1), _kv(len(t1) - 1))  # vllm-mlx keys it one past its state
    # The prompt-only cut (prompt minus one token, state trimmed) and the entry as far as it
    # holds; nothing to supersede yet.
    assert persister.captured_calls == [(39, 39, ()), (42, 42, ())]
    persister.captured_calls.clear()
    p2 = t1 + (1, 2, 3, 4)
    cached, remaining = cache.fetch(list(p2))
    assert len(remaining) == 4 and cache._stats.hits == 1
    t2 = p2 + (5, 6)
    cache.store(list(t2), _kv(len(t2)))
    assert persister.captured_calls == [(46, 46, (p1[:39],)), (49, 49, (t1[:42],))]
    persister.captured_calls.clear()

    # vllm-mlx's chunked prefill: remove the previous intermediate entry, store the longer one.
    cache.store(list(range(500, 600)), _kv(100))
    assert cache.remove(list(range(500, 600)))
    cache.store(list(range(500, 700)), _kv(200))
    assert persister.captured_calls[-1] == (200, 200, (tuple(range(500, 600)),))
    persister.captured_calls.clear()

    # What kvsnap inserts itself (paused: snapshots, restored records) and pinned keys are not.
    hooks.paused += 1
    cache.store(list(range(900, 950)), _kv(50))
    hooks.paused -= 1
    from kvsnap.integrations.vllm_mlx.pin import MARK

    setattr(cache, MARK, SimpleNamespace(keys={tuple(range(800, 850))}))
    cache.store(list(range(800, 850)), _kv(50))
    cache.store(list(range(500, 700)), _kv(200))  # held already: not again
    assert persister.captured_calls == []
    hooks.uninstall()
    cache.store(list(range(300, 350)), _kv(50))
    assert persister.captured_calls == [] and persister.pumps == 4


# --- end to end, in vllm-mlx's environment --------------------------------------------------


def _turn(server, model: str, messages: list) -> dict:
    """One greedy chat turn; /v1/status is polled meanwhile for its cache figures (vllm-mlx 0.6
    reports cached tokens there, not in usage)."""
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    response, seen = _polled(server, body)
    return {
        "text": response["choices"][0]["message"]["content"],
        "prompt_tokens": seen[-1]["prompt_tokens"],
        "cached_tokens": max(int(s["cached_tokens"] or 0) for s in seen),
    }


def _converse(server, model: str, users, history: list) -> list[dict]:
    answers = []
    for user in users:
        history.append({"role": "user", "content": user})
        answers.append(_turn(server, model, history))
        history.append({"role": "assistant", "content": answers[-1]["text"]})
    return answers


def _records(store) -> list[str]:
    folder = store / "conversations"
    return sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []


def _serve_cmd(world, arch: str, store) -> list[str]:
    return [
        str(world.python),
        *("-m", "kvsnap", "vllm-mlx", "serve", str(world.models[arch]), "--continuous-batching"),
        *("--kv-snapshots", str(store)),
    ]


def _three_turns_then_kill_9(world, arch: str, tmp_path, home) -> tuple:
    """A store, three turns through a persisting server, its writes done, kill -9; the store,
    the answers, the history so far, the persist status and the records left."""
    store = tmp_path / "snaps"
    if arch == "dense":  # the agent's snapshot in the store: the conversation shares its blocks
        shutil.copytree(world.store, store)
    # A hybrid request that hit a snapshot is not stored again until it grows 4,096 tokens
    # past it (vllm-mlx's SNAPSHOT_REFRESH_TOKENS): its conversation starts from an empty store.
    history = [AGENTS[0]["messages"][0]]
    first = _launch(
        [*_serve_cmd(world, arch, store), "--persist-requests"], home, tmp_path / "1.log"
    )
    try:
        first.wait_ready(180)
        before = _converse(first, str(world.models[arch]), USERS[:3], history)
        want = 6 if arch == "dense" else 1  # dense: per turn the entry and its prompt-only cut
        deadline = time.monotonic() + 30
        while (p := _kvsnap_status(first)["persist"])["written"] < want or p["queued"]:
            assert time.monotonic() < deadline, p
            time.sleep(0.05)
        os.kill(server_pid(first), signal.SIGKILL)
        assert first.proc.wait(30) != 0
    finally:
        first.stop()
    assert p["enabled"] and (p["failed"], p["dropped"], p["capture_errors"]) == (0, 0, 0), p
    records = _records(store)
    assert records, first.log()[-3000:]
    _venv_kvsnap(world.python, home, "verify", store)  # sound after the kill
    return store, before, history, records


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_a_conversation_survives_kill_9_and_its_next_turn_answers_as_if_never_restarted(
    world, arch, tmp_path
):
    model = str(world.models[arch])
    home = tmp_path / "home"
    home.mkdir()
    store, before, history, records = _three_turns_then_kill_9(world, arch, tmp_path, home)
    serve = _serve_cmd(world, arch, store)

    # Restart: turn 4 reads the last turn's record from disk.
    second = _launch([*serve, "--persist-requests"], home, tmp_path / "second.log")
    try:
        second.wait_ready(180)
        after = _converse(second, model, USERS[3:], history)[0]
        status = _kvsnap_status(second)["persist"]
        cleared = httpx.delete(f"{second.url}/v1/cache/prefix", timeout=60).json()
        left = _records(store)
    finally:
        assert second.stop() == 0, second.log()[-3000:]
    assert (status["restored"], status["disk_hits"], status["load_errors"]) == (1, 1, 0), status
    if arch == "dense":  # the prompt-only cut of turn 3: all of its prompt but the last token
        assert after["cached_tokens"] == before[2]["prompt_tokens"] - 1, (before, after)
    assert cleared["status"] == "cleared" and cleared["persisted_removed"] >= len(records), cleared
    assert left == [], left
    assert "[kvsnap] persisted conversations:" in second.log()  # flushed at shutdown
    _venv_kvsnap(world.python, home, "verify", store)

    # A server that never restarted (and persists nothing): the same answers, no more cached.
    reference = _launch(serve, home, tmp_path / "reference.log")
    try:
        reference.wait_ready(180)
        never = _converse(reference, model, USERS, [AGENTS[0]["messages"][0]])
    finally:
        assert reference.stop() == 0, reference.log()[-3000:]
    assert [a["text"] for a in never] == [a["text"] for a in [*before, after]]
    assert [a["prompt_tokens"] for a in never] == [a["prompt_tokens"] for a in [*before, after]]
    assert after["cached_tokens"] >= never[3]["cached_tokens"], (after, never[3])
    print(
        f"\n{arch}: turn 4 after kill -9: {after['cached_tokens']} of {after['prompt_tokens']} "
        f"prompt tokens cached (turn 3's prompt: {before[2]['prompt_tokens']}); never "
        f"restarted: {never[3]['cached_tokens']}; records {len(records)}"
    )
    assert json.dumps(status)  # the status object is JSON as served


@pytest.mark.slow
@pytest.mark.parametrize("which", ["all", "own"])
def test_a_forged_persisted_block_is_refused_and_the_turn_is_served_cold(world, which, tmp_path):
    """Blocks a conversation record reaches rewritten with half their head dim (checksums
    recomputed, so the records still name them and verify without a model passes): all of them
    (the shape check refuses the record before vllm-mlx sees it), or only those no agent reaches
    (the chain no longer fits together; that used to fail the request inside vllm-mlx's
    add_request). Either way the turn is prefilled and the server serves on."""
    from helpers.forged import forge_head_dim

    from kvsnap.store.local import Store
    from kvsnap.store.paths import chain_relpaths

    home = tmp_path / "home"
    home.mkdir()
    store, before, history, _ = _three_turns_then_kill_9(world, "dense", tmp_path, home)
    opened = Store.open(store, readonly=True)
    forged = {
        rel
        for p in (store / "conversations").glob("*.safetensors")
        for rel in chain_relpaths(opened.inspect(p))
    }
    if which == "own":
        forged -= {
            rel for p in opened.snapshot_files() for rel in chain_relpaths(opened.inspect(p))
        }
    assert forged and all(rel.startswith("blocks/") for rel in forged)
    for rel in sorted(forged):
        forge_head_dim(store / rel)
    _venv_kvsnap(world.python, home, "verify", store)  # a store alone cannot tell
    model = str(world.models["dense"])
    second = _launch(
        [*_serve_cmd(world, "dense", store), "--persist-requests"], home, tmp_path / "2.log"
    )
    try:
        second.wait_ready(180)
        after = _converse(second, model, USERS[3:], history)[0]
        again = _turn(second, model, history[:-1])  # the same turn, the server still serving
        status = _kvsnap_status(second)["persist"]
    finally:
        assert second.stop() == 0, second.log()[-3000:]
    assert (status["restored"], status["load_errors"]) == (0, 1), status
    assert after["cached_tokens"] < before[2]["prompt_tokens"] - 1, after
    assert again["text"] == after["text"]
    refused = [line for line in second.log().splitlines() if "persisted conversation" in line]
    why = "this model's cache holds" if which == "all" else "concatenate"
    assert any("not used" in line and why in line for line in refused), refused
