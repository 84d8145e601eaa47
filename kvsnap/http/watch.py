"""Process-level watch for `kvsnap serve`: a failed warm-up ends the server instead of a 503
forever."""

from __future__ import annotations

import ipaddress
import threading


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exit_when_warm_up_fails(engine, server) -> threading.Thread:
    """Ask uvicorn to stop once the engine reports a failed warm-up, or a failure between warm
    and its first request (the weights read after warm), the CLI then exiting 1."""

    def watch() -> None:
        engine.warm.wait()
        if engine.failed is None:
            engine.serving_started.wait()
        if engine.failed is not None:
            server.should_exit = True

    thread = threading.Thread(target=watch, name="kvsnap-warmup-watch", daemon=True)
    thread.start()
    return thread
