"""Where a fleet's shared tier lives: Redis/Valkey (``redis://``, ``rediss://``) or a folder
every replica mounts. One small interface (``TierBackend``): an S3-compatible backend
implements the same six calls. Every failure of the backend is a ``TierUnavailable``; what
a value holds is checked above this layer (``tier_values``). No mlx.
"""

from __future__ import annotations

import contextlib
import os
import secrets as secrets_module
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

from kvsnap.errors import StoreError, UsageError
from kvsnap.store.fileio import TMP_PREFIX, atomic_write
from kvsnap.store.tier_values import PREFIX

SECRET_ENV = "KVSNAP_SHARED_TIER_SECRET"  # the fleet's secret, never stored in the tier
PASSWORD_ENV = "KVSNAP_SHARED_TIER_PASSWORD"  # Redis AUTH when the URL has no password
SECRET_NAME = f"{PREFIX}:secret"
SECRET_BYTES = 32
INDEX_READ_LIMIT = 4096  # records one lookup reads from an index, at most
READ_CHUNK = 4 << 20  # a value's bytes are received this many at a time, into place
MAX_REPLY_LINE = 64 << 10  # a reply's first line ("$<length>"), far shorter
LINE_READ = 16 << 10  # a reply line is looked for in receives of this many bytes
RANGE_BYTES = 1 << 20  # one GETRANGE of a value (1 MB sent with 0.94 CPU s per 1.88 GB, 4 MB 1.1)
RANGES_AHEAD = 4  # GETRANGEs in flight: Redis never waits on a round trip, nor holds more


class TierUnavailable(Exception):
    """The tier did not answer, refused, or failed: a miss for the caller, never an error."""


class ValueGone(Exception):
    """A value evicted (or replaced) while it was read in ranges: a miss, like one never
    found, not a failure of the tier."""


class TierBackend(Protocol):
    where: str  # for logs and /v1/status: never the password

    def get(self, name: str) -> bytes | bytearray | None: ...
    def open_value(self, name: str) -> contextlib.AbstractContextManager: ...
    def put(self, name: str, value: bytes) -> None: ...
    def missing(self, names: list[str]) -> list[str]: ...
    def index_add(self, index: str, member: str, limit: int) -> None: ...
    def index_remove(self, index: str, members: list[str]) -> None: ...
    def index_members(self, index: str) -> set[str]: ...
    def shared_secret(self, keep: bytes | None = None) -> bytes: ...
    def close(self) -> None: ...


def fleet_secret_from_env() -> bytes | None:
    raw = os.environ.get(SECRET_ENV, "")
    if not raw:
        return None
    if len(raw) < 16:
        raise UsageError(
            f"{SECRET_ENV} is {len(raw)} characters; give at least 16 random ones "
            f"(e.g. `openssl rand -hex 32`)"
        )
    import hashlib

    return hashlib.sha256(b"kvsnap-tier-secret|" + raw.encode()).digest()


def redacted(url: str) -> str:
    """``url`` without its password (logs, status, errors): the user part's and a
    ``password=`` query argument's (redis-py takes both). Never raises."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(k == "password" for k, _ in query):
        shown = [(k, "***" if k == "password" else v) for k, v in query]
        parts = parts._replace(query=urllib.parse.urlencode(shown, safe="*"))
    userinfo, at, host = parts.netloc.rpartition("@")
    if at and ":" in userinfo:  # not parts.port: a malformed port must not raise here
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}")
    return urllib.parse.urlunsplit(parts)


def open_backend(spec: str, timeout_s: float) -> TierBackend:
    """The backend ``spec`` names (``redis://``/``rediss://`` URL, or a folder); UsageError
    naming the value and the fix when it names none. Nothing is contacted here: a tier down
    at start costs nothing, it is asked at the first request."""
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisTier.from_url(spec, timeout_s)
    if "://" in spec:
        raise UsageError(
            f"--shared-tier {redacted(spec)!r}: only redis://, rediss:// (TLS) and unix:// URLs "
            f"or a folder are supported; e.g. --shared-tier redis://127.0.0.1:6379/0"
        )
    return FolderTier.open(Path(spec))


# --- Redis / Valkey ---------------------------------------------------------------------------


@dataclass
class RedisTier:
    client: Any  # redis.Redis (imported on first use: a folder tier needs no redis)
    where: str

    @classmethod
    def from_url(cls, url: str, timeout_s: float) -> RedisTier:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise UsageError(
                "--shared-tier redis://… needs the redis package; pip install redis"
            ) from None
        kwargs: dict = {}
        if urllib.parse.urlsplit(url).password is None and os.environ.get(PASSWORD_ENV):
            kwargs["password"] = os.environ[PASSWORD_ENV]
        try:
            client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),  # one try: the caller's breaker decides on more
                socket_read_size=1 << 20,  # large values: ~15% faster than 64 KiB reads
                **kwargs,
            )
        except ValueError as exc:
            raise UsageError(
                f"--shared-tier {redacted(url)!r}: {exc}; e.g. redis://127.0.0.1:6379/0"
            ) from None
        return cls(client, redacted(url))

    def _call(self, fn, *args):
        import redis

        try:
            return fn(*args)
        except (redis.RedisError, OSError) as exc:
            raise TierUnavailable(f"{self.where}: {type(exc).__name__}: {exc}") from None

    def get(self, name: str) -> bytes | bytearray | None:
        try:
            with self.open_value(name) as value:
                return None if value is None else value.read_all()
        except ValueGone:  # evicted while read: as if never found
            return None

    @contextlib.contextmanager
    def open_value(self, name: str) -> Iterator[ValueReader | None]:
        """The value read on one of the client's connections (its AUTH, SELECT and TLS done
        by redis-py) in ranges (``_RangedValue``), received by the caller straight into its
        own buffers (``ValueReader``): hiredis would receive it into its buffer and copy it
        into a bytes, two more passes over a value of tens of MB. None when there is no such
        value; ``ValueGone`` when it is evicted while the caller reads it. A connection left
        mid-reply (a failure, or a caller that stopped reading) is closed, never reused."""
        pool = self.client.connection_pool
        conn = self._call(_pool_connection, pool)
        done = False
        try:
            sock = getattr(conn, "_sock", None)
            if sock is None:  # a connection without a socket of its own: its parser reads it
                self._call(conn.send_command, "GET", name)
                got = self._call(conn.read_response)
                yield None if got is None else BytesValue(memoryview(got), self.where)
            else:
                self._call(conn.check_health)  # what send_command did before a command
                value = self._call(_RangedValue.start, sock, self.where, name)
                yield value
                if value is not None:
                    value.finish()
            done = True
        finally:
            if not done:
                conn.disconnect()
            pool.release(conn)

    def put(self, name: str, value: bytes) -> None:
        self._call(self.client.set, name, value)

    def missing(self, names: list[str]) -> list[str]:
        if not names:
            return []

        def ask():
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        return [name for name, there in zip(names, self._call(ask)) if not there]

    def index_add(self, index: str, member: str, limit: int) -> None:
        def add():
            pipe = self.client.pipeline(transaction=False)
            pipe.zadd(index, {member: time.time()})
            pipe.zremrangebyrank(index, 0, -(limit + 1))  # the oldest go past the bound
            pipe.execute()

        self._call(add)

    def index_remove(self, index: str, members: list[str]) -> None:
        if members:
            self._call(self.client.zrem, index, *members)

    def index_members(self, index: str) -> set[str]:
        # the newest INDEX_READ_LIMIT only: an index someone bloated costs one bounded read
        got = self._call(self.client.zrange, index, -INDEX_READ_LIMIT, -1)
        return {m.decode() if isinstance(m, bytes) else str(m) for m in got or ()}

    def shared_secret(self, keep: bytes | None = None) -> bytes:
        """The fleet's secret kept in the tier (set once, by whoever comes first); ``keep``,
        the one this replica uses, is put back if the tier lost it (a flush, an eviction, a
        restart without persistence), so replicas started later agree with it."""
        fresh = keep or secrets_module.token_bytes(SECRET_BYTES)
        self._call(lambda: self.client.set(SECRET_NAME, fresh, nx=True))
        value = self._call(self.client.get, SECRET_NAME)
        if not isinstance(value, bytes) or len(value) != SECRET_BYTES:
            raise TierUnavailable(f"{self.where}: {SECRET_NAME} is not a {SECRET_BYTES}-byte value")
        return value

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a dead connection has nothing to report
            self.client.close()


def _pool_connection(pool: Any) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py before 5.3 names the command
        return pool.get_connection("GET")


class ValueReader(Protocol):
    """One value as it arrives: its size, then its bytes into the caller's buffers, in order;
    TierUnavailable if the tier stops short (never a short value)."""

    @property
    def size(self) -> int: ...

    def read_into(self, view: memoryview) -> None: ...

    def read_all(self) -> bytearray: ...


@dataclass
class BytesValue:
    """A ValueReader over bytes already received (a backend that only has ``get``)."""

    data: memoryview
    where: str
    at: int = 0

    @property
    def size(self) -> int:
        return len(self.data)

    def read_into(self, view: memoryview) -> None:
        n = len(view)
        if self.at + n > len(self.data):
            raise TierUnavailable(f"{self.where}: the value ended before {n} more bytes")
        view[:] = self.data[self.at : self.at + n]
        self.at += n

    def read_all(self) -> bytearray:
        out = bytearray(self.size - self.at)
        self.read_into(memoryview(out))
        return out


def open_value(backend: TierBackend, name: str) -> contextlib.AbstractContextManager:
    """``backend.open_value(name)``, or its ``get`` as a ValueReader for a backend without."""
    opener = getattr(backend, "open_value", None)
    if opener is not None:
        return opener(name)
    got = backend.get(name)
    return contextlib.nullcontext(None if got is None else BytesValue(memoryview(got), "tier"))


def read_get_reply(sock: Any, where: str) -> bytearray | None:
    """One whole bulk reply off ``sock`` (a GET's or a GETRANGE's): the value (None for nil);
    TierUnavailable or redis' error for a reply that is torn, foreign or an error."""
    stream = _ReplyStream(sock, where)
    size = stream.bulk_length()
    if size is None:
        return None
    out = bytearray(size)
    stream.read_into(memoryview(out))
    stream.end_of_bulk(size)
    return out


class _ReplyStream:
    """Replies read off a redis-py connection's socket (RESP2 or RESP3), several in flight:
    what a receive brought past the line asked for is kept (``carry``) for the next read."""

    def __init__(self, sock: Any, where: str):
        self.sock, self.where = sock, where
        self.carry = bytearray()

    def send(self, *commands: tuple[str, ...]) -> None:
        out = []
        for args in commands:
            out.append(f"*{len(args)}\r\n".encode())
            for arg in args:
                raw = arg.encode()
                out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
        self._guard(self.sock.sendall, b"".join(out))

    def line(self) -> bytes:
        """The next reply line; a Redis error reply raises it (as every failure here, a
        TierUnavailable naming the tier)."""
        while (end := self.carry.find(b"\r\n")) < 0:
            if len(self.carry) > MAX_REPLY_LINE:
                raise TierUnavailable(f"{self.where} sent a reply line of over 64 KiB")
            chunk = self._guard(self.sock.recv, LINE_READ)
            if not chunk:
                raise TierUnavailable(f"{self.where} closed the connection before a reply")
            self.carry += chunk
        line = bytes(self.carry[:end])
        del self.carry[: end + 2]
        if line[:1] == b"-":
            raise TierUnavailable(f"{self.where}: {line[1:].decode('utf-8', 'replace')}")
        return line

    def integer(self) -> int:
        line = self.line()
        if line[:1] != b":" or not line[1:].isdigit():
            raise TierUnavailable(f"{self.where} sent {line[:40]!r}, not an integer")
        return int(line[1:])

    def bulk_length(self) -> int | None:
        """A bulk reply's length (None for nil), its bytes next."""
        line = self.line()
        if line in (b"$-1", b"_"):
            return None
        if line[:1] != b"$" or not line[1:].isdigit():
            raise TierUnavailable(f"{self.where} sent {line[:40]!r}, not a bulk string")
        return int(line[1:])

    def end_of_bulk(self, size: int) -> None:
        tail = bytearray(2)
        self.read_into(memoryview(tail))
        if tail != b"\r\n":
            raise TierUnavailable(f"{self.where}: a {size}-byte value not followed by CRLF")

    def read_into(self, view: memoryview) -> None:
        """Exactly ``len(view)`` bytes, the carried ones first, the rest received in place."""
        got = min(len(self.carry), len(view))
        view[:got] = self.carry[:got]
        del self.carry[:got]
        while got < len(view):
            k = self._guard(self.sock.recv_into, view[got:], min(len(view) - got, READ_CHUNK))
            if not k:
                raise TierUnavailable(f"{self.where}: the connection closed mid-value")
            got += k

    def _guard(self, fn, *args):
        import redis

        try:
            return fn(*args)
        except (redis.RedisError, OSError) as exc:
            raise TierUnavailable(f"{self.where}: {type(exc).__name__}: {exc}") from None


class _RangedValue:
    """A string value read as GETRANGEs of RANGE_BYTES, RANGES_AHEAD in flight, each received
    straight into the caller's buffers. A GET has Redis copy the whole value into one fresh
    reply buffer (58 MB per 8k-token fp32 block, its pages faulted anew every time): ranged,
    Redis spent 0.94 instead of 1.44 CPU s sending 1.88 GB here, and nothing is asked past
    what the caller reads (a planted length costs nothing). Its existence, length and first
    range come in one MULTI/EXEC (one round trip); a later range shorter than asked means it
    was evicted or replaced while read (``ValueGone``). Reads nothing past its replies."""

    def __init__(self, stream: _ReplyStream, name: str, size: int):
        self.stream, self.name, self.size = stream, name, size
        self.where = stream.where
        self.asked = 0  # bytes of the value asked for
        self.flight: list[int] = []  # the lengths of the ranges asked for, not yet read
        self.left = 0  # bytes of the range being read
        self.done = 0  # bytes handed to the caller

    @classmethod
    def start(cls, sock: Any, where: str, name: str) -> _RangedValue | None:
        """None when there is no such value. Its existence, length and first range are asked
        in one transaction (one round trip, seen at one instant)."""
        stream = _ReplyStream(sock, where)
        first_range = ("GETRANGE", name, "0", str(RANGE_BYTES - 1))
        stream.send(("MULTI",), ("EXISTS", name), ("STRLEN", name), first_range, ("EXEC",))
        for _ in range(4):  # +OK, then +QUEUED per command
            if stream.line()[:1] != b"+":
                raise TierUnavailable(f"{where} did not queue a transaction")
        if stream.line() != b"*3":
            raise TierUnavailable(f"{where} did not run a transaction of three commands")
        exists, size, first = stream.integer(), stream.integer(), stream.bulk_length()
        if first != min(size, RANGE_BYTES):
            raise TierUnavailable(
                f"{where} sent {first} bytes of a {size}-byte value's first range"
            )
        if first == 0:  # no such value, or an empty one: the reply's CRLF is all there is
            stream.end_of_bulk(0)
        if not exists:
            return None
        value = cls(stream, name, size)
        value.asked = value.left = first
        value._ask()
        return value

    def _ask(self) -> None:
        wanted = []
        while len(self.flight) < RANGES_AHEAD and self.asked < self.size:
            n = min(RANGE_BYTES, self.size - self.asked)
            wanted.append(("GETRANGE", self.name, str(self.asked), str(self.asked + n - 1)))
            self.flight.append(n)
            self.asked += n
        if wanted:
            self.stream.send(*wanted)

    def read_into(self, view: memoryview) -> None:
        if len(view) > self.size - self.done:
            raise TierUnavailable(f"{self.where}: the value ended before {len(view)} more bytes")
        at = 0
        while at < len(view):
            if self.left == 0:
                self._next_range()
            k = min(self.left, len(view) - at)
            self.stream.read_into(view[at : at + k])
            at += k
            self.left -= k
            self.done += k
            if self.left == 0:
                self.stream.end_of_bulk(k)

    def _next_range(self) -> None:
        wanted = self.flight.pop(0)
        got = self.stream.bulk_length()
        if got != wanted:
            raise ValueGone(
                f"{self.name} was evicted or replaced while it was read (a range of {wanted} "
                f"bytes at byte {self.done} gave {got})"
            )
        self.left = got
        self._ask()

    def read_all(self) -> bytearray:
        out = bytearray(self.size - self.done)
        self.read_into(memoryview(out))
        return out

    def finish(self) -> None:
        """The ranges asked for and not read (a caller that stopped early), read and dropped:
        the connection is then clean for its next command."""
        if self.left:
            self.stream.read_into(memoryview(bytearray(self.left)))
            self.stream.end_of_bulk(self.left)
            self.done += self.left
            self.left = 0
        while self.flight:
            n = self.flight.pop(0)
            got = self.stream.bulk_length()
            if got is not None:
                self.stream.read_into(memoryview(bytearray(got)))
                self.stream.end_of_bulk(got)
            if got != n:
                raise ValueGone(f"{self.name} was evicted or replaced while it was read")


# --- a shared folder --------------------------------------------------------------------------


@dataclass
class FolderTier:
    """A folder every replica mounts: one file per value under
    ``kvsnap-t2/<model>/<kv>/<namespace>/<kind>/<key>`` (the names' prefix), written like the
    local store's files (temp file, fsync, rename), so a kill mid-write leaves the old value or
    none."""

    root: Path
    where: str
    sizes: dict = field(default_factory=dict)

    @classmethod
    def open(cls, root: Path) -> FolderTier:
        root = root.expanduser()
        if root.exists() and not root.is_dir():
            raise UsageError(f"--shared-tier {str(root)!r} is a file; give a folder (or a URL)")
        if not root.exists():
            raise UsageError(
                f"--shared-tier {str(root)!r} does not exist; mount the shared folder there "
                f"(or create it) first"
            )
        return cls(root.resolve() / PREFIX.replace(":", "-"), str(root))

    def _path(self, name: str) -> Path:
        fields = name.split(":")
        if name.startswith(PREFIX + ":") and len(fields) in (6, 7):
            rest = fields[2:]
            if all(f and f not in (".", "..") and "/" not in f for f in rest):
                return self.root.joinpath(*rest)
        raise ValueError(f"{name!r} is not a kvsnap tier name")

    def _io(self, fn, *args):
        try:
            return fn(*args)
        except (OSError, StoreError) as exc:
            raise TierUnavailable(f"{self.where}: {exc}") from None

    def get(self, name: str) -> bytes | None:
        def read():
            try:
                return self._path(name).read_bytes()
            except FileNotFoundError:
                return None

        return self._io(read)

    @contextlib.contextmanager
    def open_value(self, name: str) -> Iterator[ValueReader | None]:
        """The value's file, read by the caller into its own buffers."""
        try:
            f = self._io(open, self._path(name), "rb")
        except TierUnavailable:
            if not self._io(self._path(name).exists):
                yield None
                return
            raise
        with f:
            yield _FileValue(f, self._io(os.fstat, f.fileno()).st_size, self.where)

    def put(self, name: str, value: bytes) -> None:
        self._io(atomic_write, self._path(name), lambda f: f.write(value), _no_fault)

    def missing(self, names: list[str]) -> list[str]:
        return self._io(lambda: [n for n in names if not self._path(n).is_file()])

    def _records(self, index: str) -> Path:
        return self._path(index).parent / "record"

    def index_add(self, index: str, member: str, limit: int) -> None:
        """A folder's index is its record files; past ``limit`` the least recently written
        go (at most every 64th write looks)."""
        folder = self._records(index)
        count = self.sizes.get(index, 0) + 1
        self.sizes[index] = count
        if count % 64:
            return

        def prune():
            files = [p for p in folder.iterdir() if not p.name.startswith(TMP_PREFIX)]
            if len(files) > limit:
                files.sort(key=lambda p: p.stat().st_mtime_ns)
                for p in files[: len(files) - limit]:
                    p.unlink(missing_ok=True)

        self._io(prune)

    def index_remove(self, index: str, members: list[str]) -> None:
        folder = self._records(index)

        def remove():
            for member in members:
                (folder / member).unlink(missing_ok=True)

        self._io(remove)

    def index_members(self, index: str) -> set[str]:
        folder = self._records(index)

        def names():
            try:
                return {n for n in os.listdir(folder) if not n.startswith(TMP_PREFIX)}
            except FileNotFoundError:
                return set()

        return self._io(names)

    def shared_secret(self, keep: bytes | None = None) -> bytes:
        from kvsnap.store.conversations import store_secret

        return self._io(store_secret, self.root)

    def close(self) -> None:
        return None


@dataclass
class _FileValue:
    f: Any
    size: int
    where: str

    def read_into(self, view: memoryview) -> None:
        got = 0
        try:
            while got < len(view):
                k = self.f.readinto(view[got:])
                if not k:
                    raise TierUnavailable(f"{self.where}: a value's file ended early (rewritten?)")
                got += k
        except OSError as exc:
            raise TierUnavailable(f"{self.where}: {exc}") from None

    def read_all(self) -> bytearray:
        out = bytearray(self.size - self.f.tell())
        self.read_into(memoryview(out))
        return out


def _no_fault(_: str) -> None:
    return None
