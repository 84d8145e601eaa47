"""Real `kvsnap serve --persist-requests` processes for the issue-23 crash tests: the
conversations they replay, a never-restarted reference server, SIGTERM and kill -9 of the
server process itself, and the store checks after each."""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from helpers.cli import run_kvsnap
from helpers.models import LONG_SYSTEM
from kvsnap.store.conversation_space import read_reach
from kvsnap.store.conversations import conversation_files
from kvsnap.store.local import Store
from kvsnap.store.paths import part_files
from kvsnap.tools.serverproc import ServerProcess, start_server

TURNS = (
    "Question one: which tests should I read first?",
    "Question two: and the error handling of the parser?",
    # long: turn 3's record crosses a block edge, so it brings two new blocks (a dense
    # record's write is killed between them at conversation-mid-parts)
    "Question three: what about the file paths? "
    + "Check every path, folder and file name the server reads or writes. " * 8,
    "Question four: which fix comes first?",
)
# Conversations apart from their first token on: none is a prefix of another.
SYSTEMS = (
    LONG_SYSTEM,
    "Planner agent here. Plan each task step by step, list the tools and check the data. " * 4,
    "Rust expert here. Review the parser, the error handling and every data path twice. " * 4,
)
MAX_TOKENS = 8


@dataclass(frozen=True)
class Conversation:
    system: str
    users: tuple[str, ...] = TURNS
    salt: str = ""  # its own namespace: no partial hit on another conversation's prefix

    def body(self, model: Path, turn: int, answers: list[str]) -> dict:
        """The request of turn ``turn`` (1-based), the earlier turns answered by ``answers``."""
        msgs = [{"role": "system", "content": self.system}]
        for i in range(turn - 1):
            msgs += [
                {"role": "user", "content": self.users[i]},
                {"role": "assistant", "content": answers[i]},
            ]
        msgs.append({"role": "user", "content": self.users[turn - 1]})
        body = {"model": model.name, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0}
        return {**body, "cache_salt": self.salt} if self.salt else body


CONVERSATION = Conversation(SYSTEMS[0])


def ask(client: httpx.Client, server: ServerProcess, body: dict) -> dict:
    r = client.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def content(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


class Reference:
    """What a server that never restarted answers: one persisting nothing per model, started
    on first use; each conversation's turns go to it in order, so its later turns hit its
    own in-memory prefixes, as a long-running server's would."""

    def __init__(self, demo_models, tmp: Path):
        self.demo_models, self.tmp = demo_models, tmp
        self.servers: dict[str, ServerProcess] = {}
        self.replies: dict[tuple, list[dict]] = {}

    def model(self, name: str) -> Path:
        return self.demo_models.path(name)

    def transcript(self, name: str, conv: Conversation = CONVERSATION) -> list[dict]:
        """The replies of every turn of ``conv``."""
        if (name, conv) not in self.replies:
            server = self.servers.get(name)
            if server is None:
                server = start(self.model(name), None, self.tmp / f"reference-{name}.log")
                self.servers[name] = server
            replies: list[dict] = []
            with httpx.Client(timeout=60) as client:
                for turn in range(1, len(conv.users) + 1):
                    body = conv.body(self.model(name), turn, [content(r) for r in replies])
                    replies.append(ask(client, server, body))
            self.replies[(name, conv)] = replies
        return self.replies[(name, conv)]

    def answers(self, name: str, conv: Conversation = CONVERSATION) -> list[str]:
        return [content(r) for r in self.transcript(name, conv)]

    def prefix_lengths(self, name: str, conv: Conversation = CONVERSATION) -> list[int]:
        """The tokens each turn's persisted record holds: its prompt minus the last token."""
        return [r["usage"]["prompt_tokens"] - 1 for r in self.transcript(name, conv)]

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()


def start(
    model: Path, store: Path | None, log: Path, env: dict | None = None, extra=()
) -> ServerProcess:
    args = ["--continuous-batching"]
    if store is not None:
        args += ["--kv-snapshots", str(store), "--persist-requests"]
    args += list(extra)
    cache = {"KVSNAP_CACHE_DIR": str(log.parent / "kvsnap-cache")}
    server = start_server(model, args, log, env={**cache, **(env or {})}, limit_s=300)
    try:
        server.wait_ready(120)
    except BaseException:
        server.stop()
        raise
    return server


def server_pid(server: ServerProcess) -> int:
    """The kvsnap process itself: start_server runs it under `timeout`, and a kill -9 of
    `timeout` would leave the server running."""
    if Path(str(server.proc.args[0])).name != "timeout":
        return server.proc.pid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[1]) == server.proc.pid:
                return int(stat.parent.name)
        time.sleep(0.01)
    raise AssertionError(f"no child process under `timeout` (pid {server.proc.pid})")


def persist_status(server: ServerProcess) -> dict:
    return server.status()["persist"]


def wait_written(server: ServerProcess, written: int, timeout: float = 30.0) -> dict:
    """Wait until the writer has written ``written`` records and nothing is queued."""
    deadline = time.monotonic() + timeout
    while True:
        persist = persist_status(server)
        if persist["written"] >= written and persist["queued"] == 0:
            return persist
        assert time.monotonic() < deadline, f"not {written} records written: {persist}"
        time.sleep(0.02)


def sigterm(server: ServerProcess, timeout: float = 30.0) -> float:
    """SIGTERM the server; returns the seconds it took to exit (by itself, re-raising it)."""
    started = time.monotonic()
    os.kill(server_pid(server), signal.SIGTERM)
    rc = server.proc.wait(timeout)
    elapsed = time.monotonic() - started
    assert rc in (0, -signal.SIGTERM), f"exit status {rc}:\n{server.log()[-3000:]}"
    assert "Application shutdown complete" in server.log(), server.log()[-3000:]
    return elapsed


def assert_sound(store: Path) -> None:
    """`kvsnap verify` passes, every record reaches only parts that are there, and no part,
    named or not, is torn."""
    from kvsnap.store.checking import check_part
    from kvsnap.store.conversations import conversation_files
    from kvsnap.store.local import Store
    from kvsnap.store.paths import chain_relpaths, part_files

    v = run_kvsnap("verify", store, env={"KVSNAP_CACHE_DIR": str(store.parent)})
    assert v.returncode == 0, v.stdout + v.stderr
    opened = Store.open(store, readonly=True)
    for record in conversation_files(store):
        missing = [
            rel for rel in chain_relpaths(opened.inspect(record)) if not (store / rel).is_file()
        ]
        assert not missing, f"{record.name} names missing parts {missing}"
    for path in part_files(opened):
        kind = "block" if path.parent.name == "blocks" else "checkpoint"
        check_part(opened, kind, path.stem, path=path)


def record_lengths(store: Path) -> set[int]:
    """How many tokens each conversation record in ``store`` holds."""
    from kvsnap.store.conversations import conversation_files
    from kvsnap.store.local import Store

    opened = Store.open(store, readonly=True)
    return {opened.inspect(path).n_tokens for path in conversation_files(store)}


def wait_for_point(log: Path, point: str, count: int, proc, deadline: float) -> bool:
    """Poll the fault log until ``point`` was logged ``count`` times; False if the server
    ended or the deadline passed first."""
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and log.read_text().split().count(point) >= count:
            return True
        time.sleep(0.001)
    return False


PLANNER = (
    "You are a planner agent for a busy team. Plan each task step by step, list the tools you "
    "need, estimate the time every step takes, name the risks and who owns each of them. "
) * 5


AGENTS = [
    {"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]},
    {"name": "planner", "messages": [{"role": "system", "content": PLANNER}]},
]


# Not an agent's: conversations on it share a first block only conversations reach.
SHARED_SYSTEM = (
    "You are the support desk of a bicycle shop. Answer questions about repairs, spare parts, "
    "opening hours and prices politely, and ask for the frame size when it matters. "
) * 5


def user_turn(conv: str, n: int) -> dict:
    text = f"Conversation {conv}, turn {n}: please look at file {conv}-{n}.py and its tests."
    return {"role": "user", "content": text}


class Chat:
    """One conversation: its messages grow by each reply, as a client's would."""

    def __init__(self, name: str, system: str, key: str | None = None, salt: str | None = None):
        self.name, self.key, self.salt = name, key, salt
        self.messages = [{"role": "system", "content": system}]
        self.turns = 0
        self.last_prompt = 0  # the prompt tokens of the last turn sent

    def body(self) -> dict:
        body = {"model": "m", "messages": self.messages, "max_tokens": 3, "temperature": 0}
        return {**body, "cache_salt": self.salt} if self.salt else body

    def send(self, url: str, key: str | None = None, salt: str | None = None) -> int:
        """The next turn; returns its cached_tokens. ``key``/``salt`` send it as someone else
        (a probe: the conversation does not go on)."""
        probe = key is not None or salt is not None
        msgs = self.messages + [user_turn(self.name, self.turns + 1)]
        body = {**self.body(), "messages": msgs}
        if probe:
            body.pop("cache_salt", None)
            body.update({"cache_salt": salt} if salt else {})
        who = key if probe else self.key
        headers = {"Authorization": f"Bearer {who}"} if who else {}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        if not probe:
            self.messages = msgs + [
                {"role": "assistant", "content": out["choices"][0]["message"]["content"]}
            ]
            self.turns += 1
            self.last_prompt = out["usage"]["prompt_tokens"]
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def persist_status(server, key: str | None = None) -> dict:
    return server.status(key)["persist"]


def settle(server, root: Path, written: int, key: str | None = None, timeout=60.0) -> dict:
    """Wait until the server's writer has written ``written`` records (since its start) and
    finished with them (the store lock is free), with nothing failed or skipped."""
    deadline = time.monotonic() + timeout
    while True:
        st = persist_status(server, key)
        if st["written"] >= written and st["queued"] == 0:
            break
        assert time.monotonic() < deadline, (written, st, server.log()[-2000:])
        time.sleep(0.05)
    with Store.open(root).lock():  # the writer's last write (and supersede) is done
        pass
    # read again: "written" counts a record before its supersede, under the same lock
    st = persist_status(server, key)
    assert st["failed"] == st["skipped"] == st["dropped"] == 0, st
    return st


def serve(model: Path, root: Path, tmp: Path, name: str, *extra, env=None, agents=True):
    args = ["--continuous-batching", "--kv-snapshots", str(root), *map(str, extra)]
    if agents:
        args += ["--warm-prompts", str(tmp / "agents.json")]
    env = {"KVSNAP_CACHE_DIR": str(tmp / "cache"), **(env or {})}
    server = start_server(model, args, tmp / f"{name}.log", env=env, limit_s=600)
    try:
        server.wait_ready(120)
    except BaseException:
        server.stop()
        raise
    return server


KEY_A, KEY_B, ADMIN = "tenant-key-alpha-1111", "tenant-key-bravo-2222", "admin-key-charlie-3333"


KEYS_ENV = {"KVSNAP_API_KEY": f"{KEY_A},{KEY_B}", "KVSNAP_ADMIN_API_KEY": ADMIN}


def record_keys(root: Path) -> set[str]:
    return {p.name.split(".")[0] for p in conversation_files(root)}


def assert_sound(root: Path) -> None:
    """`kvsnap verify` passes and every part a record reaches (agent's or conversation's) is
    there."""
    r = run_kvsnap("verify", root)
    assert r.returncode == 0, r.stdout + r.stderr
    reach = read_reach(Store.open(root))
    assert reach.complete
    missing = [rel for rel in set(reach.counts) | reach.agent_parts if not (root / rel).is_file()]
    assert missing == []


def part_set(root: Path) -> set[str]:
    return {f"{p.parent.name}/{p.name}" for p in part_files(Store.open(root, readonly=True))}


def copy_store(base, tmp_path: Path) -> Path:
    dest = tmp_path / "store"
    shutil.copytree(base[2], dest)
    return dest


BAD_HEADER = b"\x08" + b"\x00" * 7 + b"not a header"
