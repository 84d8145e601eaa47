"""`kvsnap bench-serve`: load an OpenAI-compatible server and report TTFT, TPOT, latency,
throughput.

Nothing is sent before the measured requests unless ``--warmup N`` asks for it (no
preflight token count), so a cold server stays cold for its first measured request.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvsnap.errors import UsageError
from kvsnap.tools.client import chat_body

_TOPICS = [
    "the server's request handler",
    "a rust parser",
    "the cache eviction policy",
    "a flaky test",
    "the build pipeline",
    "an HTTP client retry loop",
    "a database migration",
    "the logging setup",
]


def builtin_prompts(kind: str) -> list[str]:
    """Deterministic user prompts: short (~15 words), medium (~150), long (~1,200)."""
    if kind == "short":
        return [f"In one sentence, what could go wrong in {t}?" for t in _TOPICS]
    body = (
        "Here is the context. The function reads a request, checks the headers, parses the body, "
        "calls the "
        "store, retries on a timeout and writes a response. Tests cover the happy path only. "
    )
    reps = {"medium": 4, "long": 32}.get(kind)
    if reps is None:
        raise UsageError(
            f"--prompts {kind!r} is not a built-in set; use short, medium, long or a file path"
        )
    return [f"Review {t}. " + body * reps + "List the three most important fixes." for t in _TOPICS]


def load_prompt_set(spec: str) -> dict[str, list[str]]:
    sets: dict[str, list[str]] = {}
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item in ("short", "medium", "long"):
            sets[item] = builtin_prompts(item)
            continue
        path = Path(item)
        if not path.exists():
            raise UsageError(f"--prompts {item!r} is neither short/medium/long nor a readable file")
        text = read_text_file(path, "--prompts")
        try:
            data = json.loads(text)
            prompts = [p if isinstance(p, str) else json.dumps(p) for p in data]
        except json.JSONDecodeError:
            prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise UsageError(f"--prompts file {item!r} holds no prompt")
        sets[path.stem] = prompts
    return sets


def read_text_file(path: Path, flag: str) -> str:
    """The text of any readable path: a file, a FIFO, or a shell's process substitution
    (`<(...)`, a /dev/fd/N pipe that is neither a regular file nor readable twice)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file; check the path") from None
    except IsADirectoryError:
        raise UsageError(f"{flag} {path}: is a folder; give a text file") from None
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{flag} {path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from None
    except OSError as exc:
        raise UsageError(
            f"{flag} {path}: cannot be read ({exc.strerror or exc}); check its permissions"
        ) from None


def read_system_prompt(path: Path) -> str:
    """The system prompt in ``path`` less one trailing newline: editors end a file with one,
    and sent as-is it would change the prompt's last tokens, so a warm prefix built from the
    same text without it would miss by a partial block."""
    text = read_text_file(path, "--system-prompt-file")
    if not text.strip():
        # Sent as nothing, it would measure requests without a system prompt, unannounced.
        raise UsageError(
            f"--system-prompt-file {path}: holds no text; give the system prompt, or drop "
            "the flag to send none"
        )
    return text[:-1] if text.endswith("\n") else text


@dataclass
class RequestSample:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(1, self.completion_tokens - 1)


@dataclass
class ConfigResult:
    tag: str
    prompts: str
    concurrency: int
    requests: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    tpot_ms: float
    e2e_p50_ms: float
    prompt_tps: float
    generation_tps: float
    cached_tokens_mean: float
    prompt_tokens_mean: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    vals = sorted(values)
    k = (len(vals) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


async def _one(client, url: str, model: str, messages: list, max_tokens: int) -> RequestSample:
    body = chat_body(model, messages, max_tokens)
    t0 = time.perf_counter()
    ttft = None
    usage: dict = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                if ttft is None and (ch.get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    return RequestSample(
        ttft_s=ttft if ttft is not None else e2e,
        e2e_s=e2e,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
    )


async def _model_id(client, url: str) -> str:
    r = await client.get(f"{url}/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _messages(system: str | None, user: str) -> list:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user}]


async def run_bench(
    url: str,
    sets: dict[str, list[str]],
    concurrencies: list[int],
    max_tokens: int,
    repetitions: int,
    warmup: int,
    system: str | None,
    tag: str,
    on_done=None,
) -> list[ConfigResult]:
    import httpx

    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=10)) as client:
        model = await _model_id(client, url)
        for _ in range(warmup):
            await _one(client, url, model, _messages(system, "warm up"), 4)
        for name, prompts in sets.items():
            for conc in concurrencies:
                samples: list[RequestSample] = []
                t0 = time.perf_counter()
                for rep in range(repetitions):
                    batch = [prompts[(rep * conc + i) % len(prompts)] for i in range(conc)]
                    samples += await asyncio.gather(
                        *(_one(client, url, model, _messages(system, p), max_tokens) for p in batch)
                    )
                    if on_done:
                        on_done(conc)
                wall = time.perf_counter() - t0
                results.append(
                    ConfigResult(
                        tag=tag,
                        prompts=name,
                        concurrency=conc,
                        requests=len(samples),
                        ttft_p50_ms=percentile([s.ttft_s for s in samples], 0.5) * 1000,
                        ttft_p95_ms=percentile([s.ttft_s for s in samples], 0.95) * 1000,
                        tpot_ms=statistics.mean(s.tpot_s for s in samples) * 1000,
                        e2e_p50_ms=percentile([s.e2e_s for s in samples], 0.5) * 1000,
                        prompt_tps=sum(s.prompt_tokens - s.cached_tokens for s in samples) / wall,
                        generation_tps=sum(s.completion_tokens for s in samples) / wall,
                        cached_tokens_mean=statistics.mean(s.cached_tokens for s in samples),
                        prompt_tokens_mean=statistics.mean(s.prompt_tokens for s in samples),
                    )
                )
    return results


def render(results: list[ConfigResult], fmt: str, width: int = 200) -> str:
    rows = [asdict(r) for r in results]
    if fmt == "json":
        return json.dumps(rows, indent=1)
    if fmt == "csv":
        buf = io.StringIO()
        if rows:
            w = csv.DictWriter(buf, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        return buf.getvalue()
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvsnap bench-serve")
    cols = [
        "tag",
        "prompts",
        "concurrency",
        "requests",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "tpot_ms",
        "e2e_p50_ms",
        "prompt_tps",
        "generation_tps",
        "cached_tokens_mean",
        "prompt_tokens_mean",
    ]
    for c in cols:
        table.add_column(c.replace("_", " "), justify="right")
    for r in rows:
        table.add_row(*[f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols])
    buf = io.StringIO()
    Console(file=buf, width=width).print(table)
    return buf.getvalue()
