"""The first requests after a start, all at once: each is prepared in its own worker thread,
and the model's limits they all read are computed by the first. A burst right after a
restart (what every live conversation sends: scripts/bench_restart.py) once saw them half
built: KeyError, 500."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from kvsnap.http import context as context_module
from kvsnap.http.context import ServerConfig, ServerContext


def test_threads_reading_the_model_limits_at_once_never_see_them_half_built(
    demo_models, monkeypatch
):
    lm = demo_models.load("dense")
    real = context_module.allowed_template_kwargs
    started = threading.Barrier(2, timeout=10)

    def slow_template_kwargs(template):
        time.sleep(0.3)  # a large template takes a while to scan: the window the race needs
        return real(template)

    monkeypatch.setattr(context_module, "allowed_template_kwargs", slow_template_kwargs)
    ctx = ServerContext(engine=SimpleNamespace(lm=lm), config=ServerConfig("m"))

    def read(i: int) -> dict:
        started.wait()
        time.sleep(0.1 * i)  # the second reads while the first is still building
        return dict(ctx.model_limits())

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(read, range(2))
    keys = {"vocab", "template_kwargs", "context", "token_bytes", "answer_rules"}
    assert set(first) == set(second) == keys
