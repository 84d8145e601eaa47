"""A real HAProxy on a free 127.0.0.1 port, running docs/fleet.md's configuration as written:
only the frontend's bind address and the two replicas' addresses are substituted, so the
fleet tests check the configuration operators copy. Always killed at the end."""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import time
from pathlib import Path

from helpers.fleet import need
from kvsnap.tools.serverproc import free_port

# HAProxy wants 2 descriptors per connection of the configuration's `maxconn 4096`, and by
# default (strict-limits) does not start without them. Importing mlx_lm.utils (the demo
# models do) sets this process's RLIMIT_NOFILE to (2048, 4096), which HAProxy inherits and,
# without CAP_SYS_RESOURCE, cannot raise: there it runs with `-n N` (HAProxy's management
# guide: a lower maxconn "on systems where resource limits are too low"), the configuration
# file as written.
WANTED_FILES = 2 * 4096 + 256
FLEET_DOC = Path(__file__).resolve().parents[2] / "docs" / "fleet.md"
BIND = re.compile(r"^(?P<lead>\s*bind\s+)127\.0\.0\.1:\d+(?P<rest>\s*)$", re.M)
SERVER = re.compile(r"^(?P<lead>\s*server\s+(?P<name>r[12])\s+)127\.0\.0\.1:\d+(?=\s)", re.M)


def documented_config(doc: Path = FLEET_DOC) -> str:
    """The ```haproxy block of docs/fleet.md (exactly one)."""
    blocks = re.findall(r"^```haproxy\n(.*?)^```", doc.read_text(), re.M | re.S)
    assert len(blocks) == 1, f"{doc} has {len(blocks)} ```haproxy blocks, not one"
    return blocks[0]


def substituted(config: str, bind_port: int, servers: dict[str, str]) -> str:
    """``config`` listening on 127.0.0.1:``bind_port``, its servers r1 and r2 at
    ``servers["r1"]``/``servers["r2"]`` ("127.0.0.1:PORT"); nothing else changes."""
    config, binds = BIND.subn(rf"\g<lead>127.0.0.1:{bind_port}\g<rest>", config)
    assert binds == 1, f"{binds} 'bind 127.0.0.1:PORT' lines, not one:\n{config}"
    seen: dict[str, int] = {}

    def address(m: re.Match) -> str:
        seen[m["name"]] = seen.get(m["name"], 0) + 1
        return m["lead"] + servers[m["name"]]

    config = SERVER.sub(address, config)
    assert set(seen) == set(servers) == {"r1", "r2"}, (seen, servers)
    return config


def connection_limit() -> list[str]:
    """``-n N`` when this process's open-files hard limit is too low for the documented
    maxconn (a raised soft limit is inherited; HAProxy raises it itself up to the hard one)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard >= WANTED_FILES:
        return []
    return ["-n", str((hard - 256) // 2)]


class HAProxy:
    """``haproxy -f CONFIG -db`` with docs/fleet.md's configuration, the replicas at
    ``servers`` ({"r1": "127.0.0.1:PORT", "r2": ...})."""

    def __init__(self, folder: Path, servers: dict[str, str]):
        self.folder = folder
        self.servers = servers
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.config = folder / f"haproxy-{self.port}.cfg"
        self.log_path = folder / f"haproxy-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> HAProxy:
        haproxy = need("haproxy")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.config.write_text(substituted(documented_config(), self.port, self.servers))
        check = subprocess.run(
            [haproxy, "-c", "-f", str(self.config)], capture_output=True, text=True, timeout=30
        )
        assert check.returncode == 0, check.stdout + check.stderr
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [haproxy, "-f", str(self.config), "-db", *connection_limit()],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(
                    f"haproxy did not start (exit {self.proc.poll()}):\n{self.log()}"
                )
            time.sleep(0.05)
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> HAProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
