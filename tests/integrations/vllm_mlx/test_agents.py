"""Agents on `kvsnap vllm-mlx serve`: Claude Code's /v1/messages and Codex's /v1/responses,
warm from agent-body entries ({"anthropic": body}, {"responses": body}).

vllm-mlx 0.6 merged Claude Code's later system message (the environment block: folder, date)
into the first, ahead of the tools, so each new session prefilled the tools again; and it
dropped a hit covering the whole prompt (a second session asking the same) and prefilled it
all. The fast tests pin the adaptations (``vllm_mlx.agents``, ``vllm_mlx.exact``) on stand-ins;
the slow one runs vllm-mlx's real server on the real captured bodies (tests/fixtures/agents),
cut to a few tools.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.vllm_mlx_route import _launch, _venv_kvsnap

from kvsnap.integrations.vllm_mlx.agents import leading_merge, placing_render, probe_body
from kvsnap.integrations.vllm_mlx.exact import ExactHits
from kvsnap.prompts import parse_warm_prompts

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "agents"
SERVED = "kvsnap-model"  # the name both CLIs were run with
TODAY = "Today's date is 2026-12-04"


def claude_body() -> dict:
    """Claude Code's first request (`claude -p "Say hi"`), two of its twelve tools kept."""
    body = json.loads((FIXTURES / "claude_code_first.json").read_text())
    body["tools"] = [t for t in body["tools"] if t["name"] in ("Edit", "Write")]
    return body


def codex_body(name: str = "codex_first.json") -> dict:
    """Codex's first request, four of its tools kept (one namespace function, web_search)."""
    body = json.loads((FIXTURES / name).read_text())
    kept = []
    for tool in body["tools"]:
        if tool.get("name") in ("write_stdin", "view_image") or tool["type"] == "web_search":
            kept.append(tool)
        elif tool["type"] == "namespace":
            kept.append({**tool, "tools": tool["tools"][:1]})
    body["tools"] = kept
    return body


# --- the adaptations, on stand-ins ------------------------------------------------------


def _m(role, content):
    return {"role": role, "content": content}


def test_vllm_mlx_merge_keeps_to_the_leading_system_messages():
    def merge(messages):  # vllm-mlx's: every system text into one first message
        texts = [m["content"] for m in messages if m["role"] == "system"]
        rest = [m for m in messages if m["role"] != "system"]
        return ([_m("system", "\n\n".join(texts))] if texts else []) + rest

    merged = leading_merge(merge)
    env = _m("system", "# Environment\nfolder /a")
    assert merged([_m("system", "S"), _m("system", "T"), _m("user", "hi"), env]) == [
        _m("system", "S\n\nT"),
        _m("user", "hi"),
        env,
    ]
    assert merged([_m("user", "hi"), env]) == [_m("user", "hi"), env]
    # Without a later system message, vllm-mlx's own merge, untouched.
    assert merged([_m("system", "S"), _m("system", "T"), _m("user", "u")]) == [
        _m("system", "S\n\nT"),
        _m("user", "u"),
    ]


def test_a_template_refusing_a_later_system_message_gets_it_in_the_user_turn_before():
    calls = []

    def render(messages, tools=None, **kwargs):  # Qwen3.5-style: system only first
        calls.append(messages)
        if any(m["role"] == "system" for m in messages[1:]):
            raise ValueError("System message must be at the beginning.")
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    place = placing_render(render)
    messages = [_m("system", "S"), _m("user", "hi"), _m("system", "env"), _m("assistant", "ok")]
    assert (
        place(messages, ["tool"], enable_thinking=False) == "system:S|user:hi\n\nenv|assistant:ok"
    )
    assert len(calls) == 2 and calls[0] == messages  # as given first
    # Taken as given where the template accepts it, and nothing else is retried.
    calls.clear()
    assert placing_render(lambda m, *a, **k: str(len(m)))(messages) == "4"
    with pytest.raises(ValueError, match="System message"):
        placing_render(lambda m, *a, **k: (_ for _ in ()).throw(ValueError("System message")))(
            [_m("system", "S"), _m("user", "u"), _m("system", "x")]
        )


def test_agent_entries_keep_their_body_and_probe_bodies_swap_only_the_conversation():
    entries = parse_warm_prompts(
        [
            {"name": "claude-code", "anthropic": claude_body()},
            {"name": "codex", "responses": codex_body()},
        ]
    ).entries
    claude, codex = entries
    assert (claude.api, codex.api) == ("anthropic", "responses")
    turns = [_m("user", "Hello there")]
    body = probe_body(claude, turns)
    assert body["messages"] == turns and body["system"] == claude.body["system"]
    assert body["tools"] == claude.body["tools"] and body["stream"] is False
    assert claude.body["messages"] != turns  # the entry's own body is untouched
    body = probe_body(codex, turns)
    # Codex's two leading developer messages stay, its environment and prompt go.
    assert [i["role"] for i in body["input"]] == ["developer", "developer", "user"]
    assert body["input"][-1] == {"type": "message", "role": "user", "content": "Hello there"}


class Layer:
    """A KV layer as vllm-mlx's trim sees it."""

    def __init__(self, offset, trimmable=True):
        self.offset, self.trimmable = offset, trimmable


class FakeCache:
    """vllm-mlx's fetch, reduced: an exact match leaves nothing to prefill, else the longest
    stored prefix."""

    def __init__(self, entries):
        self.entries = entries
        self._stats = type("S", (), {"hits": 0, "misses": 0, "tokens_saved": 0})()
        self._last_match_type = None

    def fetch(self, tokens):
        key = tuple(tokens)
        if key in self.entries:
            self._stats.hits += 1
            self._stats.tokens_saved += len(key)
            self._last_match_type = "exact"
            return self.entries[key], []
        best = max((k for k in self.entries if key[: len(k)] == k), key=len, default=None)
        if best is None:
            self._stats.misses += 1
            self._last_match_type = "miss"
            return None, list(tokens)
        self._stats.hits += 1
        self._stats.tokens_saved += len(best)
        self._last_match_type = "prefix"
        return self.entries[best], list(tokens[len(best) :])


def _hits(entries):
    cache = FakeCache(entries)

    def trim(state, n):
        return [Layer(layer.offset - n) for layer in state]

    hits = ExactHits(cache, lambda layer: layer.trimmable, trim)
    return cache, hits


def test_a_hit_covering_the_whole_prompt_reuses_all_but_its_last_token():
    prompt = list(range(10))
    warm = (0, 1, 2, 3)
    stored = [Layer(10)]
    cache, hits = _hits({warm: [Layer(4)], tuple(prompt): stored})
    state, remaining = hits.fetch(prompt)
    assert remaining == [9] and [layer.offset for layer in state] == [9]
    assert stored[0].offset == 10  # the entry itself is not trimmed
    assert cache._last_match_type == "prefix" and cache._stats.tokens_saved == 9
    assert cache._stats.hits == 1
    # An entry that already stops one token short is used as it is.
    cache, hits = _hits({tuple(prompt): [Layer(9)]})
    state, remaining = hits.fetch(prompt)
    assert remaining == [9] and state[0].offset == 9
    # Anything else is left to vllm-mlx (which prefills it whole).
    cache, hits = _hits({tuple(prompt): [Layer(7)]})
    assert hits.fetch(prompt)[1] == []
    # A strict prefix hit passes through.
    cache, hits = _hits({warm: [Layer(4)]})
    assert hits.fetch(prompt)[1] == prompt[4:]


def test_untrimmable_state_covering_the_whole_prompt_falls_back_to_the_longest_strict_prefix():
    prompt = list(range(10))
    warm = (0, 1, 2, 3)
    ssm = [Layer(10, trimmable=False)]
    snapshot = [Layer(4, trimmable=False)]
    cache, hits = _hits({warm: snapshot, tuple(prompt): ssm})
    state, remaining = hits.fetch(prompt)
    assert state is snapshot and remaining == prompt[4:]
    assert (cache._stats.hits, cache._stats.tokens_saved) == (1, 4)  # counted as one lookup
    # With no strict prefix stored, a miss: the prompt is prefilled in full.
    cache, hits = _hits({tuple(prompt): ssm})
    assert hits.fetch(prompt) == (None, prompt)
    assert (cache._stats.hits, cache._stats.misses) == (0, 1)


# --- end to end, in vllm-mlx's own environment ------------------------------------------


def _post(url: str, path: str, body: dict) -> tuple[dict, dict]:
    """POST while polling /v1/status: the answer and the request's last status row (vllm-mlx
    0.6 reports cached tokens there)."""
    result: dict = {}

    def send():
        with httpx.Client(timeout=300) as c:
            result["r"] = c.post(url + path, json=body)

    thread = threading.Thread(target=send)
    seen: list = []
    with httpx.Client(timeout=10) as c:
        thread.start()
        while thread.is_alive():
            seen += c.get(url + "/v1/status").json()["requests"]
            time.sleep(0.01)
    thread.join()
    assert result["r"].status_code == 200, result["r"].text[:2000]
    assert seen, "the request never showed in /v1/status"
    return result["r"].json(), seen[-1]


def _answer(path: str, response: dict) -> str:
    if path == "/v1/messages":
        return json.dumps(response["content"])
    return json.dumps([item.get("content") for item in response["output"]])


def _requests() -> list[tuple[str, str, dict]]:
    """(label, path, body): each agent's first request, the next session asking the same (same
    folder, same day), and a session whose environment differs (another date; another folder)."""
    claude = claude_body()
    claude.update(stream=False, temperature=0, max_tokens=6, model=SERVED)
    later = copy.deepcopy(claude)
    env = later["messages"][1]["content"][0]
    assert TODAY in env["text"]
    env["text"] = env["text"].replace(TODAY, "Today's date is 2026-12-05")
    out = [
        ("claude first", "/v1/messages", claude),
        ("claude same again", "/v1/messages", claude),
        ("claude next day", "/v1/messages", later),
    ]
    for label, name in [
        ("codex first", "codex_first.json"),
        ("codex same again", "codex_first.json"),
        ("codex other folder", "codex_other_folder.json"),
    ]:
        body = codex_body(name)
        body.update(stream=False, temperature=0, max_output_tokens=6, model=SERVED)
        out.append((label, "/v1/responses", body))
    return out


def _serve(python, model, store, home, log, agents, *extra):
    cmd = [str(python), "-m", "kvsnap", "vllm-mlx", "serve", str(model), "--continuous-batching"]
    cmd += ["--served-model-name", SERVED, "--kv-snapshots", str(store)]
    cmd += ["--warm-prompts", str(agents), *extra]
    return _launch(cmd, home, log)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_agents_hit_on_their_first_request_and_on_the_next_session(vllm_mlx_python, arch, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    model = tmp_path / arch
    _venv_kvsnap(
        vllm_mlx_python, home, "demo-model", model, *(["--arch", "hybrid"] * (arch == "hybrid"))
    )
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps(
            [
                {"name": "claude-code", "anthropic": claude_body()},
                {"name": "codex", "responses": codex_body()},
            ]
        )
    )
    requests = _requests()

    # Cold: the same route, its one warm prompt too short to keep, its prefix cache too small to
    # keep any request (vllm-mlx 0.6's DELETE /v1/cache/prefix does not reach its batched
    # engine's cache).
    nothing = tmp_path / "nothing.json"
    nothing.write_text(json.dumps([{"name": "short", "messages": [_m("system", "Be brief.")]}]))
    cold_store = tmp_path / "cold-store"
    cold = _serve(
        vllm_mlx_python,
        model,
        cold_store,
        home,
        tmp_path / "cold.log",
        nothing,
        "--cache-memory-mb",
        "1",
    )
    expected = {}
    try:
        cold.wait_ready(180)
        for label, path, body in requests:
            if label.endswith("same again"):  # the same body: the same cold answer
                continue
            response, row = _post(cold.url, path, body)
            assert row["cached_tokens"] == 0, (label, row)
            expected[label] = (row["prompt_tokens"], _answer(path, response))
    finally:
        cold.stop()
    for agent in ("claude", "codex"):
        expected[f"{agent} same again"] = expected[f"{agent} first"]

    # The agents' entries: prefilled at the first start and written back; the second start
    # (dense) takes them from the store.
    store = tmp_path / "store"
    starts = ["prefilled", "snapshot"] if arch == "dense" else ["prefilled"]
    for n, source in enumerate(starts):
        server = _serve(vllm_mlx_python, model, store, home, tmp_path / f"warm{n}.log", agents)
        try:
            server.wait_ready(300)
            status = httpx.get(server.url + "/v1/kvsnap/status", timeout=10).json()["last"]
            warm = {a["name"]: a["tokens"] for a in status["agents"]}
            assert [a["source"] for a in status["agents"]] == [source, source], status
            seen = {}
            for label, path, body in requests:
                response, row = _post(server.url, path, body)
                seen[label] = (row["prompt_tokens"], row["cached_tokens"])
                assert (row["prompt_tokens"], _answer(path, response)) == expected[label], label
        finally:
            assert server.stop() == 0, server.log()[-3000:]
        print(f"\n{arch} start {n} ({source}): warm {warm}; prompt/cached {seen}")
        for agent, first, again, other in [
            ("claude-code", "claude first", "claude same again", "claude next day"),
            ("codex", "codex first", "codex same again", "codex other folder"),
        ]:
            prefix = warm[agent]
            assert prefix >= 1000, (agent, prefix)  # system + tools, not the system text alone
            assert seen[first][1] == prefix, (agent, seen)
            # The next session asking the same: all but the last token where the cache trims;
            # the warm prefix where it cannot (SSM state), never nothing.
            same = seen[again][0] - 1 if arch == "dense" else prefix
            # (vllm-mlx's own mid-prefill entries of the first session can reach further.)
            assert seen[again][1] == same if arch == "dense" else seen[again][1] >= same, seen
            assert seen[other][1] >= prefix, (agent, seen)
