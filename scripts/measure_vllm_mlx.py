#!/usr/bin/env python
"""Side by side for docs/vllm-mlx.md: plain vllm-mlx, its --warm-prompts, and kvsnap's route.

    python scripts/measure_vllm_mlx.py --python VENV/bin/python --model M --system system.txt
    --store SNAPS

VENV is an environment with vllm-mlx 0.6.0 (tests/integrations/vllm_mlx/test_route.py makes one
under ~/.cache/kvsnap-tests/vllm-mlx-venv); SNAPS was built there with `kvsnap build --for
vllm-mlx` from an agents file whose one entry is this system prompt. Modes:

  cold                  vllm-mlx serve
  warm-prompts          vllm-mlx serve --warm-prompts FILE
  kvsnap                kvsnap vllm-mlx serve --kv-snapshots SNAPS
  kvsnap-warm-first     kvsnap vllm-mlx serve --kv-snapshots NEW --warm-prompts FILE (NEW empty:
  prefilled, written back)
  kvsnap-warm-second    the same again, on the store the first one wrote

Each server runs alone, with HOME in a temporary folder; plain vllm-mlx gets the same
OpenBLAS through LD_PRELOAD. Prints one JSON line per mode: time to ready, prompt tokens
prefilled at start (vllm-mlx's own count, or kvsnap's report), the first request's prompt
/ cached / prefilled tokens (from /v1/status and vllm-mlx's log), its TTFT and its answer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvsnap.blas import find_openblas  # noqa: E402
from kvsnap.tools.serverproc import free_port  # noqa: E402

MODES = ("cold", "warm-prompts", "kvsnap", "kvsnap-warm-first", "kvsnap-warm-second")


def measure(python: str, model: str, mode: str, system: str, store: str, workdir: Path) -> dict:
    home = workdir / f"home-{mode}"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        HOME=str(home),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT),
        KVSNAP_CACHE_DIR=os.environ.get("KVSNAP_CACHE_DIR", str(workdir / "kvsnap-cache")),
    )
    warm = workdir / "vllm-warm-prompts.json"  # vllm-mlx's own file shape
    warm.write_text(json.dumps([[{"role": "system", "content": system}]]))
    if mode == "kvsnap":
        cmd = [
            python,
            "-m",
            "kvsnap",
            "vllm-mlx",
            "serve",
            model,
            "--continuous-batching",
            "--kv-snapshots",
            store,
        ]
    elif mode.startswith("kvsnap-warm"):
        cmd = [
            python,
            "-m",
            "kvsnap",
            "vllm-mlx",
            "serve",
            model,
            "--continuous-batching",
            "--kv-snapshots",
            str(workdir / "written-back"),
            "--warm-prompts",
            str(warm),
        ]
    else:
        if find_openblas():
            env["LD_PRELOAD"] = find_openblas()
        cmd = [python, "-m", "vllm_mlx.cli", "serve", model, "--continuous-batching"]
        if mode == "warm-prompts":
            cmd += ["--warm-prompts", str(warm)]
    port = free_port()
    log_path = workdir / f"{mode}.log"
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["timeout", "-k", "5", "1800", *cmd, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text()[-3000:])
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        status = httpx.get(f"{url}/v1/status", timeout=30).json()
        kvsnap = (
            httpx.get(f"{url}/v1/kvsnap/status", timeout=30).json()
            if mode.startswith("kvsnap")
            else None
        )
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "Please review the server code."},
            ],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        }
        result: dict = {}

        def send():
            t = time.perf_counter()
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=1800) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and '"content"' in line and "ttft" not in result:
                        result["ttft"] = time.perf_counter() - t
                    if line.startswith("data:") and line.strip() != "data: [DONE]":
                        choice = json.loads(line[5:])["choices"][0]
                        delta = choice.get("delta") or {}
                        result["text"] = (
                            result.get("text", "")
                            + (delta.get("content") or "")
                            + (delta.get("reasoning") or delta.get("reasoning_content") or "")
                        )
                        result["finish_reason"] = choice.get("finish_reason") or result.get(
                            "finish_reason"
                        )

        thread = threading.Thread(target=send)
        seen: list = []
        thread.start()
        with httpx.Client(timeout=60) as c:
            while thread.is_alive():
                seen += c.get(f"{url}/v1/status").json()["requests"]
                time.sleep(0.02)
        thread.join()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    text = log_path.read_text(errors="replace")
    scheduled = re.findall(
        r"\[schedule\] request=\S+ uid=\d+ prompt_tokens=(\d+) tokens_to_prefill=(\d+)", text
    )
    if kvsnap is not None and kvsnap.get("last") and "agents" in kvsnap["last"]:
        at_start = sum(a["tokens"] for a in kvsnap["last"]["agents"] if a["source"] == "prefilled")
    else:  # vllm-mlx's own warm-up counts in its status; --kv-snapshots alone prefills nothing
        at_start = status["total_prompt_tokens"]
    return {
        "mode": mode,
        "model": Path(model).name,
        "ready_s": round(ready, 2),
        "prompt_tokens_at_start": at_start,
        "cache_entries_at_start": status["cache"]["entry_count"],
        "first_prompt_tokens": seen[-1]["prompt_tokens"] if seen else None,
        "first_cached_tokens": seen[-1]["cached_tokens"] if seen else None,
        "first_prefilled": int(scheduled[-1][1]) if scheduled else None,
        "first_ttft_s": round(result.get("ttft", float("nan")), 3),
        "answer": result.get("text", ""),
        "finish_reason": result.get("finish_reason"),
        "start_log": re.findall(r"Warm-up done.*|\[kvsnap\] Warm start.*", text)[:1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--python", required=True, help="python of the environment holding vllm-mlx")
    ap.add_argument("--model", required=True)
    ap.add_argument(
        "--system", required=True, help="file with the system prompt the store was built for"
    )
    ap.add_argument("--store", required=True)
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}"
    )
    args = ap.parse_args()
    system = Path(args.system).read_text()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    # one folder: kvsnap-warm-second reuses what -first wrote
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            print(
                json.dumps(
                    measure(
                        args.python,
                        str(Path(args.model).resolve()),
                        mode,
                        system,
                        args.store,
                        Path(tmp),
                    )
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
