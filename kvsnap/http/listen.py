"""The listening socket and the uvicorn server around the app: the port is taken before the
model loads (a busy port fails in a second, not after the load), and the server runs with
the connection guard (``connections``) and its rate-limited accept-error log."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

from kvsnap.errors import UsageError
from kvsnap.http.connections import ConnectionGuard, guarded_protocol


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening, so nothing connects before the
    server serves); a busy or unavailable address is a usage error naming it and the fix."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(
            f"--host {host}: cannot resolve it ({exc.strerror}); give an address "
            "such as 127.0.0.1 or 0.0.0.0"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does on POSIX
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(
                f"cannot listen on {where}: the address is already in use; stop the "
                f"process holding it (`lsof -i :{port}`) or pass another --port"
            ) from None
        raise UsageError(
            f"cannot listen on {where}: {exc.strerror}; pass another --host or --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def uvicorn_log_config() -> dict:
    """uvicorn's loggers without handlers of their own: their lines go through the root
    logger's handler, in kvsnap's format, at its level (uvicorn's ``log_level`` and
    ``access_log`` still apply)."""
    quiet = {"handlers": [], "propagate": True}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {name: quiet for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }


def make_server(app: Any, guard: ConnectionGuard, **uvicorn_options: Any):
    """A uvicorn server whose connections go through ``guard``; run it with
    ``server.run(sockets=[bind_socket(...)])``."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            asyncio.get_running_loop().set_exception_handler(guard.exception_handler)
            await super().startup(sockets)

    config = uvicorn.Config(app, http=guarded_protocol(H11Protocol, guard), **uvicorn_options)
    return GuardedServer(config)
