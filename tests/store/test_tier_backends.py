"""Where a fleet's shared tier lives (kvsnap/store/tier_backends.py): a shared folder and a
real redis-server on 127.0.0.1 answer the same calls; a closed port, a paused server and a
wrong password are a TierUnavailable within the timeout, never a hang or another error; no
URL printed holds its password; and `kvsnap serve` refuses a --shared-tier it cannot use
before the model loads, naming the flag and the fix."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers.cli import no_traceback, run_kvsnap
from helpers.fleet import RedisServer

from kvsnap.errors import UsageError
from kvsnap.store import tier_backends
from kvsnap.store.fileio import TMP_PREFIX
from kvsnap.store.tier_backends import (
    PASSWORD_ENV,
    SECRET_BYTES,
    SECRET_ENV,
    SECRET_NAME,
    FolderTier,
    RedisTier,
    TierUnavailable,
    ValueGone,
    fleet_secret_from_env,
    open_backend,
    read_get_reply,
    redacted,
)
from kvsnap.store.tier_values import BLOCK, RECORD, TierNames
from kvsnap.tools.serverproc import free_port

NAMES = TierNames("a" * 32, "b" * 8, "c" * 32)
OTHER_NS = TierNames("a" * 32, "b" * 8, "d" * 32)
KEYS = [f"{i:032x}" for i in range(1, 6)]
TIMEOUT_S = 0.5
SLACK_S = 2.0  # a loaded machine's scheduling, never a second timeout


def record(key: str, names: TierNames = NAMES) -> str:
    return names.value(RECORD, key)


# --- a shared folder --------------------------------------------------------------------------


@pytest.fixture()
def folder(tmp_path) -> FolderTier:
    (tmp_path / "shared").mkdir()
    return FolderTier.open(tmp_path / "shared")


def test_a_folder_tier_puts_gets_and_lists_what_is_missing(folder, tmp_path):
    block = NAMES.value(BLOCK, KEYS[0])
    assert folder.get(block) is None
    assert folder.missing([block, record(KEYS[1])]) == [block, record(KEYS[1])]
    folder.put(block, b"value one")
    folder.put(record(KEYS[1]), b"")
    assert folder.get(block) == b"value one" and folder.get(record(KEYS[1])) == b""
    assert folder.missing([block, record(KEYS[1]), record(KEYS[2])]) == [record(KEYS[2])]
    assert folder.missing([]) == []
    folder.put(block, b"value two")  # replaced whole
    assert folder.get(block) == b"value two"
    # one file per value, under kvsnap-t2/<model>/<kv>/<namespace>/<kind>/<key>
    path = tmp_path / "shared" / "kvsnap-t2" / ("a" * 32) / ("b" * 8) / ("c" * 32)
    assert (path / "block" / KEYS[0]).read_bytes() == b"value two"
    left = [p for p in (tmp_path / "shared").rglob("*") if p.name.startswith(TMP_PREFIX)]
    assert left == []
    assert folder.where == str(tmp_path / "shared")


def test_a_folder_tiers_index_is_its_record_files(folder):
    assert folder.index_members(NAMES.index) == set()
    for key in KEYS[:3]:
        folder.put(record(key), b"r")
        folder.index_add(NAMES.index, key, limit=10)
    folder.put(record(KEYS[3], OTHER_NS), b"r")
    assert folder.index_members(NAMES.index) == set(KEYS[:3])
    assert folder.index_members(OTHER_NS.index) == {KEYS[3]}
    folder.index_remove(NAMES.index, [KEYS[0], KEYS[4]])  # one not there: nothing to do
    assert folder.index_members(NAMES.index) == set(KEYS[1:3])
    assert folder.get(record(KEYS[0])) is None


def test_a_folder_tiers_index_keeps_the_most_recently_written_past_its_limit(folder):
    keys = [f"{i:032x}" for i in range(64)]
    for i, key in enumerate(keys):
        folder.put(record(key), b"r")
        path = folder._path(record(key))
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    for key in keys:
        folder.index_add(NAMES.index, key, limit=5)
    assert folder.index_members(NAMES.index) == set(keys[-5:])


def test_a_torn_temp_file_in_a_folder_tier_is_not_a_value(folder):
    """What a replica killed mid-put leaves: its temp file, never the value's name."""
    name = record(KEYS[0])
    path = folder._path(name)
    path.parent.mkdir(parents=True)
    (path.parent / f"{TMP_PREFIX}{KEYS[0]}.x1y2").write_bytes(b"KVSNAPT2\x00\x00")
    assert folder.get(name) is None
    assert folder.missing([name]) == [name]
    assert folder.index_members(NAMES.index) == set()


def test_a_folder_tier_that_cannot_write_is_unavailable_not_an_error(folder):
    name = NAMES.value(BLOCK, KEYS[0])
    kinds = folder._path(name).parent
    kinds.parent.mkdir(parents=True)
    kinds.write_bytes(b"a file where the block folder goes")
    with pytest.raises(TierUnavailable, match=str(folder.where)):
        folder.put(name, b"v")
    with pytest.raises(TierUnavailable):
        folder.get(name)


@pytest.mark.parametrize(
    "name",
    [
        "kvsnap:t2:..:..:..:record:k",
        "kvsnap:t2:a:b:c:record:../../x",
        "kvsnap:t2:a:b:c/d:record:k",
        "kvsnap:t2:a:b:c:record:",
        "other:t1:a:b:c:record:k",
        "kvsnap:t2:a:b",
    ],
)
def test_a_folder_tier_refuses_a_name_that_is_not_a_tier_name(folder, name):
    with pytest.raises(ValueError, match="not a kvsnap tier name"):
        folder.get(name)


def test_a_folder_tiers_secret_is_one_for_every_replica(folder, tmp_path):
    secret = folder.shared_secret()
    assert len(secret) == SECRET_BYTES
    assert FolderTier.open(tmp_path / "shared").shared_secret() == secret


def test_a_missing_folder_or_a_file_is_a_usage_error_naming_the_fix(tmp_path):
    with pytest.raises(UsageError, match="does not exist; mount the shared folder"):
        open_backend(str(tmp_path / "nowhere"), 1.0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file; give a folder"):
        open_backend(str(tmp_path / "file"), 1.0)
    (tmp_path / "there").mkdir()
    assert isinstance(open_backend(str(tmp_path / "there"), 1.0), FolderTier)


# --- Redis ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture()
def tier(redis_server):
    redis_server.client().flushall()
    backend = open_backend(redis_server.url, TIMEOUT_S)
    assert isinstance(backend, RedisTier)
    yield backend
    backend.close()


def test_a_redis_tier_puts_gets_and_lists_what_is_missing(tier, redis_server):
    block = NAMES.value(BLOCK, KEYS[0])
    assert tier.get(block) is None
    assert tier.missing([block, record(KEYS[1])]) == [block, record(KEYS[1])]
    tier.put(block, b"\x00value\xff")
    tier.put(record(KEYS[1]), b"")
    assert tier.get(block) == b"\x00value\xff" and tier.get(record(KEYS[1])) == b""
    assert tier.missing([block, record(KEYS[1]), record(KEYS[2])]) == [record(KEYS[2])]
    assert tier.missing([]) == []
    assert redis_server.keys() == sorted([block, record(KEYS[1])])
    assert tier.where == redis_server.url


def test_a_redis_tiers_index_keeps_the_newest_past_its_limit(tier, redis_server):
    assert tier.index_members(NAMES.index) == set()
    for key in KEYS:
        tier.index_add(NAMES.index, key, limit=3)
        time.sleep(0.002)  # scores are write times: apart
    assert tier.index_members(NAMES.index) == set(KEYS[-3:])
    tier.index_add(OTHER_NS.index, KEYS[0], limit=3)
    tier.index_remove(NAMES.index, [KEYS[3], KEYS[0]])
    tier.index_remove(NAMES.index, [])
    assert tier.index_members(NAMES.index) == {KEYS[2], KEYS[4]}
    assert tier.index_members(OTHER_NS.index) == {KEYS[0]}
    assert redis_server.client().zcard(NAMES.index) == 2


def test_a_redis_tiers_secret_is_set_once_and_shared(tier, redis_server):
    secret = tier.shared_secret()
    assert len(secret) == SECRET_BYTES
    other = open_backend(redis_server.url, TIMEOUT_S)
    try:
        assert other.shared_secret() == secret == tier.shared_secret()
    finally:
        other.close()
    assert redis_server.client().get(SECRET_NAME) == secret


def test_a_redis_tiers_secret_of_the_wrong_size_is_unavailable(tier, redis_server):
    redis_server.client().set(SECRET_NAME, b"short")
    with pytest.raises(TierUnavailable, match="32-byte"):
        tier.shared_secret()


def test_a_redis_get_receives_a_large_value_into_one_buffer_of_its_size(tier, redis_server):
    """A value of tens of MB arrives in many receives straight into its own buffer (no
    hiredis copy into a bytes): equal byte for byte, and the connection serves the next."""
    value = os.urandom(9 << 20) + b"\r\n$-1\r\n"  # RESP-like bytes inside the value too
    redis_server.client().set(record(KEYS[0]), value)
    got = tier.get(record(KEYS[0]))
    assert isinstance(got, bytearray) and got == value
    assert tier.get(record(KEYS[1])) is None
    assert tier.get(record(KEYS[0])) == value


@pytest.mark.parametrize("size", [0, 1, 6, 7, 8, 13, 14, 15, 7 * 5 + 3])
def test_a_redis_value_read_in_ranges_arrives_whole_in_pieces_of_any_size(
    tier, redis_server, monkeypatch, size
):
    """Ranges of 7 bytes, 2 in flight (1 MiB and 4 in the product): a value of any length
    around their edges arrives byte for byte, read in pieces of any size, and the connection
    serves the next value, also when a reader stopped early (its ranges drained)."""
    monkeypatch.setattr(tier_backends, "RANGE_BYTES", 7)
    monkeypatch.setattr(tier_backends, "RANGES_AHEAD", 2)
    value = bytes((i * 37 + 11) % 256 for i in range(size))
    redis_server.client().set(record(KEYS[0]), value)
    for piece in (1, 3, 7, 10, max(1, size)):
        with tier.open_value(record(KEYS[0])) as reader:
            assert reader is not None and reader.size == size
            out = bytearray(size)
            for at in range(0, size, piece):
                reader.read_into(memoryview(out)[at : at + piece])
        assert bytes(out) == value, piece
    with tier.open_value(record(KEYS[0])) as reader:  # stops after 2 bytes
        reader.read_into(memoryview(bytearray(min(2, size))))
    assert tier.get(record(KEYS[0])) == value and tier.get(record(KEYS[1])) is None
    assert len(tier.client.connection_pool._available_connections) == 1  # the same one


def test_a_redis_value_evicted_while_read_in_ranges_is_a_miss(tier, redis_server, monkeypatch):
    """A value removed between two of its ranges (an LRU eviction, a FLUSHALL) is ValueGone
    mid-read (a miss for the fetch, never a short value or a failure of the tier): ``get``
    answers None; its connection is closed, not reused mid-reply, and the next get works."""
    monkeypatch.setattr(tier_backends, "RANGE_BYTES", 1 << 10)
    monkeypatch.setattr(tier_backends, "RANGES_AHEAD", 1)
    value = os.urandom(64 << 10)
    redis_server.client().set(record(KEYS[0]), value)
    with pytest.raises(ValueGone, match="evicted or replaced"):
        with tier.open_value(record(KEYS[0])) as reader:
            out = memoryview(bytearray(len(value)))
            reader.read_into(out[: 4 << 10])
            redis_server.client().delete(record(KEYS[0]))
            reader.read_into(out[4 << 10 :])
    redis_server.client().set(record(KEYS[0]), value)
    real_next = tier_backends._RangedValue._next_range
    ranges: list = []

    def next_range_then_delete(self) -> None:  # the key goes after the value's third range
        ranges.append(self.done)
        if len(ranges) == 2:
            redis_server.client().delete(record(KEYS[0]))
        real_next(self)

    monkeypatch.setattr(tier_backends._RangedValue, "_next_range", next_range_then_delete)
    assert tier.get(record(KEYS[0])) is None and len(ranges) >= 3
    assert tier.get(record(KEYS[1])) is None
    redis_server.client().set(record(KEYS[0]), value)
    assert tier.get(record(KEYS[0])) == value


def test_a_redis_user_with_only_the_commands_fleet_md_lists_runs_every_call(redis_server):
    """docs/fleet.md's ACL (these commands on kvsnap:t2:* keys, nothing else) is enough for
    every call a replica makes, a value read in ranges included; a key outside the prefix is
    refused (the user can touch nothing else)."""
    admin = redis_server.client()
    admin.flushall()
    admin.execute_command(
        "ACL SETUSER kvsnapuser on >pw-0123456789 ~kvsnap:t2:* resetchannels -@all +get +set "
        "+exists +strlen +getrange +zadd +zremrangebyrank +zrem +zrange +multi +exec"
    )
    try:
        url = redis_server.url.replace("redis://", "redis://kvsnapuser:pw-0123456789@")
        backend = open_backend(url, TIMEOUT_S)
        try:
            value = os.urandom(3 << 20)  # three ranges
            backend.put(record(KEYS[0]), value)
            assert backend.get(record(KEYS[0])) == value
            assert backend.get(record(KEYS[1])) is None
            assert backend.missing([record(KEYS[0]), record(KEYS[1])]) == [record(KEYS[1])]
            backend.index_add(NAMES.index, KEYS[0], limit=3)
            assert backend.index_members(NAMES.index) == {KEYS[0]}
            backend.index_remove(NAMES.index, [KEYS[0]])
            assert len(backend.shared_secret()) == SECRET_BYTES
            with pytest.raises(TierUnavailable, match="NOPERM"):
                backend.get("elsewhere")
        finally:
            backend.close()
    finally:
        admin.execute_command("ACL DELUSER kvsnapuser")


def test_a_redis_error_reply_to_a_get_is_unavailable_and_the_next_get_works(tier, redis_server):
    redis_server.client().zadd(record(KEYS[0]), {"member": 1.0})  # GET of a sorted set: an error
    with pytest.raises(TierUnavailable, match="WRONGTYPE"):
        tier.get(record(KEYS[0]))
    redis_server.client().set(record(KEYS[1]), b"after")
    assert tier.get(record(KEYS[1])) == b"after"


class Replies:
    """A socket that hands out ``data`` (then nothing: the peer closed) in ``step``-byte
    receives, as a slow or cut connection would."""

    def __init__(self, data: bytes, step: int = 7):
        self.data, self.step, self.at = data, step, 0

    def recv(self, n: int) -> bytes:
        out = self.data[self.at : self.at + min(n, self.step)]
        self.at += len(out)
        return out

    def recv_into(self, view, n: int) -> int:
        out = self.recv(n)
        view[: len(out)] = out
        return len(out)


@pytest.mark.parametrize("step", [1, 5, 1 << 20])
def test_a_get_reply_is_read_whatever_the_receives_it_arrives_in(step):
    assert read_get_reply(Replies(b"$5\r\nab\r\nc\r\n", step), "w") == b"ab\r\nc"
    assert read_get_reply(Replies(b"$0\r\n\r\n", step), "w") == b""
    assert read_get_reply(Replies(b"$-1\r\n", step), "w") is None
    assert read_get_reply(Replies(b"_\r\n", step), "w") is None  # RESP3's null


@pytest.mark.parametrize(
    "reply, why",
    [
        (b"$10\r\nabc", "mid-value"),  # the peer went away mid-value: never a short value
        (b"", "before a reply"),
        (b"$3\r\nabcde\r\n", "not followed by CRLF"),  # longer than it said
        (b"*1\r\n$1\r\na\r\n", "not a bulk string"),
        (b"$x\r\n", "not a bulk string"),
        (b"-ERR no\r\n", "ERR no"),
    ],
)
def test_a_torn_or_foreign_get_reply_raises_never_returns_a_value(reply, why):
    import redis

    with pytest.raises((redis.RedisError, TierUnavailable), match=why):
        read_get_reply(Replies(reply), "w")


def assert_every_call_unavailable(backend, within: float) -> None:
    calls = [
        lambda: backend.get(record(KEYS[0])),
        lambda: backend.put(record(KEYS[0]), b"v"),
        lambda: backend.missing([record(KEYS[0])]),
        lambda: backend.index_add(NAMES.index, KEYS[0], 3),
        lambda: backend.index_remove(NAMES.index, [KEYS[0]]),
        lambda: backend.index_members(NAMES.index),
        backend.shared_secret,
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match=backend.where):
            call()
        assert time.monotonic() - started < within


def test_a_closed_port_is_unavailable_at_once_and_opening_contacts_nothing():
    backend = open_backend(f"redis://127.0.0.1:{free_port()}/0", TIMEOUT_S)  # no error here
    try:
        assert_every_call_unavailable(backend, TIMEOUT_S + SLACK_S)
    finally:
        backend.close()
    backend.close()  # closing twice, or a dead connection, has nothing to report


def test_a_paused_redis_is_unavailable_within_the_timeout(tmp_path):
    with RedisServer(tmp_path / "paused") as server:
        backend = open_backend(server.url, TIMEOUT_S)
        backend.put(record(KEYS[0]), b"v")  # connected: the pause hits a live connection
        server.pause()
        try:
            assert_every_call_unavailable(backend, TIMEOUT_S + SLACK_S)
        finally:
            server.resume()
        assert backend.get(record(KEYS[0])) == b"v"  # back once it answers again
        backend.close()


def test_a_redis_password_from_the_url_or_the_environment_is_never_shown(tmp_path, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    password = "s3cret-Pass-word"
    with RedisServer(tmp_path / "auth") as server:
        # set once it answers: RedisServer.start pings without a password
        server.client().config_set("requirepass", password)
        url = f"redis://:{password}@127.0.0.1:{server.port}/0"
        with_url = open_backend(url, TIMEOUT_S)
        with_url.put(record(KEYS[0]), b"v")
        assert password not in with_url.where and "***" in with_url.where
        without = open_backend(server.url, TIMEOUT_S)
        with pytest.raises(TierUnavailable) as refused:
            without.get(record(KEYS[0]))
        assert password not in str(refused.value)
        monkeypatch.setenv(PASSWORD_ENV, password)
        from_env = open_backend(server.url, TIMEOUT_S)
        assert from_env.get(record(KEYS[0])) == b"v"
        assert password not in from_env.where
        for backend in (with_url, without, from_env):
            backend.close()


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw-1@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("redis://alice:pw-1@tier.internal:6380/2", "redis://alice:***@tier.internal:6380/2"),
        ("rediss://alice:pw-1@tier.internal/0", "rediss://alice:***@tier.internal/0"),
        ("redis://alice:p%40ss-1@tier.internal:1/0", "redis://alice:***@tier.internal:1/0"),
        # redis-py takes a password from the query too (parse_url passes it to the client)
        ("redis://tier.internal:6379/0?password=pw-1", None),
        ("redis://alice@tier.internal:6379/0?db=1&password=pw-1", None),
    ],
)
def test_redacted_hides_the_password_wherever_the_url_gives_it(url, shown):
    out = redacted(url)
    assert "pw-1" not in out and "p%40ss" not in out, out
    if shown is not None:
        assert out == shown


def test_an_unsupported_or_malformed_url_is_a_usage_error_without_the_password():
    with pytest.raises(UsageError) as ftp:
        open_backend("ftp://bob:pw-1@files.internal/kv", 1.0)
    assert "--shared-tier" in str(ftp.value) and "redis://127.0.0.1:6379/0" in str(ftp.value)
    assert "pw-1" not in str(ftp.value)
    with pytest.raises(UsageError) as port:
        open_backend("redis://:pw-1@127.0.0.1:notaport/0", 1.0)
    assert "--shared-tier" in str(port.value) and "pw-1" not in str(port.value)


# --- the fleet's secret -----------------------------------------------------------------------


def test_the_fleet_secret_comes_from_the_environment_when_given(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert fleet_secret_from_env() is None
    monkeypatch.setenv(SECRET_ENV, "x" * 15)
    with pytest.raises(UsageError, match=f"{SECRET_ENV} is 15 characters; give at least 16"):
        fleet_secret_from_env()
    monkeypatch.setenv(SECRET_ENV, "0123456789abcdef")
    one = fleet_secret_from_env()
    assert one is not None and len(one) == SECRET_BYTES
    assert fleet_secret_from_env() == one  # every replica given it derives the same
    monkeypatch.setenv(SECRET_ENV, "0123456789abcdeg")
    assert fleet_secret_from_env() != one
    assert b"0123456789abcdef" not in one


# --- the command line -------------------------------------------------------------------------


def serve_usage_error(model: Path, *args, env=None) -> str:
    """`kvsnap serve` with ``args``: exit status 2 and one line that is its error."""
    r = run_kvsnap("serve", model, "--port", "0", *args, env=env, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-3000:])
    no_traceback(r)
    return r.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def model(demo_models) -> Path:
    return demo_models.path("dense")


@pytest.mark.parametrize(
    "args, needles",
    [
        (
            ["--shared-tier", "redis://127.0.0.1:6379/0"],
            ["--shared-tier", "add --persist-requests", "--kv-snapshots DIR"],
        ),
        (
            ["--persist-requests", "--shared-tier", "ftp://bob:pw-1@files/kv"],
            ["--shared-tier", "only redis://", "e.g. --shared-tier redis://127.0.0.1:6379/0"],
        ),
        (["--shared-tier-budget", "2"], ["--shared-tier-budget needs --shared-tier", "add it"]),
        (["--shared-tier-queue-mb", "8"], ["--shared-tier-queue-mb needs --shared-tier"]),
        (
            ["--persist-requests", "--shared-tier", "redis://h:1/0", "--shared-tier-budget", "601"],
            ["--shared-tier-budget 601", "at most 600"],
        ),
        (
            ["--persist-requests", "--shared-tier", "{tmp}/not-mounted"],
            ["--shared-tier", "not-mounted", "does not exist", "mount the shared folder"],
        ),
        (
            ["--persist-requests", "--shared-tier", "redis://:pw-1@127.0.0.1:notaport/0"],
            ["--shared-tier", "notaport", "e.g. redis://127.0.0.1:6379/0"],
        ),
    ],
    ids=[
        "no-persist",
        "ftp-url",
        "budget-alone",
        "queue-alone",
        "budget-601",
        "no-folder",
        "bad-port",
    ],
)
def test_serve_refuses_a_shared_tier_it_cannot_use_naming_the_flag(model, tmp_path, args, needles):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--persist-requests" in args:
        args = ["--kv-snapshots", str(tmp_path / "store"), *args]
    last = serve_usage_error(model, *args)
    for needle in needles:
        assert needle in last, last
    assert "pw-1" not in last


def test_serve_refuses_a_too_short_fleet_secret_before_the_model_loads(model, tmp_path):
    args = ["--kv-snapshots", tmp_path / "store", "--persist-requests"]
    args += ["--shared-tier", f"redis://127.0.0.1:{free_port()}/0"]  # never contacted
    last = serve_usage_error(model, *args, env={SECRET_ENV: "too-short"})
    assert f"{SECRET_ENV} is 9 characters" in last and "openssl rand -hex 32" in last
    assert "too-short" not in last
