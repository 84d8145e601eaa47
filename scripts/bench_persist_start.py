#!/usr/bin/env python
"""Start-up with 10,000 persisted conversations vs none (docs/benchmarks.md
"Start-up with persisted conversations"): launch -> ready of `kvsnap serve --persist-requests`
on the same store with and without N conversation records, launches interleaved, medians.

    python scripts/bench_persist_start.py --conversations 10000 --reps 9

The records are real: one conversation is persisted by a server, then its record is written
again under N other namespaces (same tokens and blocks, each its own key), so `kvsnap verify`
passes on the store. Also timed in process: the one start step persistence adds
(``Persister.open``), on each store.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvsnap.blas import preload_openblas  # noqa: E402

preload_openblas()

import httpx  # noqa: E402

from kvsnap.key import tokens_digest_of_bytes  # noqa: E402
from kvsnap.snapshot.file import OutTensor, read_header, tensor_bytes, write_snapshot  # noqa: E402
from kvsnap.snapshot.format import CHECKSUM_KEY, TOKENS  # noqa: E402
from kvsnap.store.conversations import (  # noqa: E402
    conversation_digest,
    conversation_files,
    namespace_tag,
    record_key,
    record_path,
    store_secret,
)
from kvsnap.tools.bench_startup import build_store, system_prompt_of  # noqa: E402
from kvsnap.tools.demo import DemoSpec, make_demo_model  # noqa: E402
from kvsnap.tools.serverproc import start_server  # noqa: E402


def persist_one(model: Path, store: Path, agents: Path, system: str, work: Path, env: dict) -> None:
    server = start_server(
        model,
        ["--continuous-batching", "--kv-snapshots", str(store), "--warm-prompts", str(agents)]
        + ["--persist-requests"],
        work / "persist-one.log",
        env=env,
    )
    try:
        server.wait_ready(600)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
        body = {"model": "m", "messages": msgs, "max_tokens": 4}
        model_id = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        body["model"] = model_id
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600).raise_for_status()
        time.sleep(2)  # the writer thread
    finally:
        server.stop(60)


def clone_records(store: Path, n: int) -> None:
    """The one record, written again under ``n`` other namespaces."""
    [original] = conversation_files(store)
    header = read_header(original)
    raw = tensor_bytes(original, header, TOKENS)
    entry = header.tensors[TOKENS]
    meta = {k: v for k, v in header.metadata.items() if k != CHECKSUM_KEY}
    secret = store_secret(store)
    digest, n_tokens = meta["kvsnap.model_digest"], int(meta["kvsnap.n_tokens"])
    tdigest = tokens_digest_of_bytes(raw)
    tokens = OutTensor(TOKENS, entry.dtype, tuple(entry.shape), memoryview(raw))
    for i in range(n):
        conv = conversation_digest(namespace_tag(secret, f"tenant-{i:05d}/"))
        key = record_key(digest, conv, tdigest, n_tokens)
        meta.update({"kvsnap.key": key, "kvsnap.prompt_digest": conv})
        with open(record_path(store, key), "wb") as f:
            write_snapshot(f, [tokens], meta)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="tiny", choices=("tiny", "small", "qwen3-0.6b"))
    ap.add_argument("--conversations", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--workdir", default=".kvsnap-bench")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    work = Path(args.workdir).resolve() / "persist-start"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = make_demo_model(
        Path(args.workdir).resolve() / f"demo-{args.size}", DemoSpec(size=args.size)
    )
    env = {"KVSNAP_CACHE_DIR": str(work / "cache")}
    system = system_prompt_of(
        AutoTokenizer.from_pretrained(str(model)), args.system_tokens, salt="Start."
    )
    agents = work / "agents.json"
    agents.write_text(
        json.dumps([{"name": "agent", "messages": [{"role": "system", "content": system}]}])
    )
    with_conv, without = work / "with", work / "without"
    build_store(model, agents, with_conv, env)
    persist_one(model, with_conv, agents, system, work, env)
    clone_records(with_conv, args.conversations - 1)
    shutil.copytree(with_conv, without)
    for p in conversation_files(without):
        p.unlink()
    stores = {"with": with_conv, "without": without}
    print(f"{len(conversation_files(with_conv))} conversation records in {with_conv}", flush=True)
    ready: dict[str, list[float]] = {k: [] for k in stores}
    for rep in range(args.reps):
        for name, store in stores.items():  # interleaved
            flags = ["--continuous-batching", "--kv-snapshots", str(store), "--persist-requests"]
            flags += ["--warm-prompts", str(agents)]
            server = start_server(model, flags, work / f"{name}-{rep}.log", env=env)
            try:
                ready[name].append(server.wait_ready(600))
            finally:
                server.stop(60)
            print(f"rep {rep} {name}: ready in {ready[name][-1]:.3f}s", flush=True)
    result = {
        "conversations": len(conversation_files(with_conv)),
        "reps": args.reps,
        "ready_s": ready,
        "median_s": {k: statistics.median(v) for k, v in ready.items()},
        "open_s": open_times(stores),
    }
    result["delta_s"] = result["median_s"]["with"] - result["median_s"]["without"]
    (work / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "ready_s"}, indent=1))
    return 0


def open_times(stores: dict) -> dict:
    """The start step persistence adds, in process (median of 5): the secret and the writer."""
    from kvsnap.key import KVSettings
    from kvsnap.runtime.persist.options import PersistOptions
    from kvsnap.runtime.persist.persister import Persister
    from kvsnap.store.local import Store

    out = {}
    lm = type("LM", (), {"settings": KVSettings()})()
    for name, root in stores.items():
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            p = Persister.open(Store.open(root), lm, None, PersistOptions())
            times.append(time.perf_counter() - t0)
            p.writer.close(5)
        out[name] = statistics.median(times)
    return out


if __name__ == "__main__":
    sys.exit(main())
