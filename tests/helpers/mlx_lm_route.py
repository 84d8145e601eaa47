"""`kvsnap mlx-lm serve` and a plain mlx_lm.server, started, warmed and asked the same way."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helpers.models import LONG_SYSTEM

PLANNER = (
    "You plan the work of a small infrastructure team, step by step, with owners and risks. " * 12
)


AGENTS = [
    {"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]},
    {"name": "planner", "messages": [{"role": "system", "content": PLANNER}]},
]


SYSTEMS = {"reviewer": LONG_SYSTEM, "planner": PLANNER}


USERS = ["Please review the server code.", "Another question, about rust", "\n9 things 汉字"]


def _llama_demo(root: Path) -> Path:
    from kvsnap.tools.demo import DemoSpec, make_demo_model

    return make_demo_model(root, DemoSpec(arch="llama"))


def _launch(cmd: list[str], log: Path, env: dict | None = None):
    """``cmd`` as a server on a free 127.0.0.1 port, its output in ``log``; ``env``: the whole
    environment (default: this one, offline and unbuffered)."""
    import os
    import time

    from kvsnap.tools.serverproc import ServerProcess, free_port, under_hard_limit

    port = free_port()
    env = env or {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            under_hard_limit([*cmd, "--host", "127.0.0.1", "--port", str(port)], 300),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return ServerProcess(
        proc=proc, url=f"http://127.0.0.1:{port}", log_path=log, launched_at=time.perf_counter()
    )


def _ask(server, agent: str, user: str, max_tokens: int = 12) -> dict:
    body = {
        "messages": [
            {"role": "system", "content": SYSTEMS[agent]},
            {"role": "user", "content": user},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    choice = r["choices"][0]
    return {
        "text": choice["message"]["content"],
        "ids": [t["id"] for t in choice["logprobs"]["content"]],
        "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
        "prompt": r["usage"]["prompt_tokens"],
        "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def _same_answers(warm: list[dict], cold: list[dict]) -> None:
    assert [(a["text"], a["ids"], a["prompt"]) for a in warm] == [
        (a["text"], a["ids"], a["prompt"]) for a in cold
    ]
    for w, c in zip(warm, cold):
        assert w["logprobs"] == pytest.approx(c["logprobs"], abs=1e-3)


def _warmup(log: str) -> tuple[int, int]:
    """(from snapshots, prefilled) from the warm-up line kvsnap prints before the port opens."""
    (found,) = re.findall(r"Warm-up done .*\((\d+) from snapshots, (\d+) prefilled\)", log)
    return int(found[0]), int(found[1])


def _kvsnap_mlx_lm(model: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvsnap", "mlx-lm", "serve", "--model", model, *extra]
