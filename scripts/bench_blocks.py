#!/usr/bin/env python
"""The block store's goals, measured: store and pinned bytes of agents sharing a
preamble against the KV of their distinct tokens and what editing one of them re-prefills
(dense and hybrid), what an edit of a long prompt re-prefills, composed vs single-file restore,
a new agent's first hit, and the registry manifest for 1,000 agents.

    python scripts/bench_blocks.py --out /tmp/kvsnap-bench-blocks          # everything (~10 min on
    2 cores)
    python scripts/bench_blocks.py --only sharing,edit,new-agent,registry  # the fast parts (tiny
    models)

Writes OUT/results.json and prints a markdown table (docs/benchmarks.md, "Block store").
Everything runs on loopback with models made locally (kvsnap demo-model); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsnap.blas import preload_openblas  # noqa: E402

preload_openblas()

import httpx  # noqa: E402

from kvsnap.tools.demo import DemoSpec, make_demo_model  # noqa: E402
from kvsnap.tools.serverproc import start_server  # noqa: E402

WORDS = (
    "alpha beta gamma delta house rules tools call search answer review code check the tests "
    "first then every function python rust server"
).split()
PARTS = ("sharing", "edit", "restore", "new-agent", "registry")


def words_for(count_tokens, seed: int, target: int) -> str:
    """Seeded words until the text is ``target`` tokens (within a word)."""
    rng = random.Random(seed)
    words: list[str] = []
    while count_tokens(" ".join(words)) < target:
        words += [
            rng.choice(WORDS) for _ in range(max(1, (target - count_tokens(" ".join(words))) // 3))
        ]
    return " ".join(words)


def token_counter(model: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def kvsnap(*args, env=None) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "kvsnap", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if r.returncode != 0:
        raise SystemExit(f"kvsnap {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}")
    return r


def build_json(agents: Path, model: Path, out: Path, *flags) -> dict:
    return json.loads(
        kvsnap("build", agents, "--model", model, "--out", out, "--json", *flags).stdout
    )


def write_agents(path: Path, preamble: str, tails: list[str]) -> Path:
    path.write_text(
        json.dumps(
            [
                {
                    "name": f"agent{i}",
                    "messages": [{"role": "system", "content": f"{preamble} {tail}"}],
                }
                for i, tail in enumerate(tails)
            ]
        )
    )
    return path


def folder_bytes(root: Path, *folders: str) -> int:
    return sum(p.stat().st_size for f in folders for p in (root / f).glob("*.safetensors"))


def kv_bytes_per_token(store: Path) -> float:
    """From a store's own blocks: their tensor bytes (safetensors headers left out) over the
    tokens they hold."""
    from kvsnap.snapshot.file import read_header

    total = tokens = 0
    for p in (store / "blocks").glob("*.safetensors"):
        header = read_header(p)
        tokens += int(header.metadata["kvsnap.end"]) - int(header.metadata["kvsnap.start"])
        total += header.file_size - header.data_start
    return total / tokens


def record_tokens(store: Path, reports: list[dict]) -> list[list[int]]:
    """Each built entry's prefix, read back from its record."""
    from kvsnap.store.local import Store

    opened = Store.open(store, readonly=True)
    return [list(opened.inspect(opened.path_for(e["key"])).tokens) for e in reports]


def distinct_tokens(prefixes: list[list[int]]) -> int:
    """The tokens of the prefixes' trie: each prefix's tokens past what an earlier one shares."""
    from kvsnap.prompts import common_prefix_length

    return sum(
        len(t) - max((common_prefix_length((t, e)) for e in prefixes[:i]), default=0)
        for i, t in enumerate(prefixes)
    )


def pinned_bytes(model: Path, store: Path, agents: Path, log: Path) -> dict:
    server = start_server(
        model,
        ["--continuous-batching", "--warm-prompts", agents, "--kv-snapshots", store],
        log,
        limit_s=600,
    )
    try:
        server.wait_ready(300)
        return server.status()["cache"]
    finally:
        server.stop()


# --- the parts ---------------------------------------------------------------------------


def part_sharing(work: Path, n_agents: int, preamble_tokens: int, tail_tokens: int) -> dict:
    """Per model (dense, hybrid): the store's bytes against the KV of the agents' distinct
    tokens, the server's pinned bytes, and what editing one agent's last sentence re-prefills."""
    from kvsnap.prompts import common_prefix_length

    out = {}
    for arch in ("dense", "hybrid"):
        model = make_demo_model(work / f"{arch}-tiny", DemoSpec(arch=arch))
        count = token_counter(model)
        preamble = words_for(count, 1, preamble_tokens)
        tails = [
            f"You are agent {i}. {words_for(count, 100 + i, tail_tokens)}. Answer in one sentence."
            for i in range(n_agents)
        ]
        root = work / f"sharing-{arch}"
        shutil.rmtree(root, ignore_errors=True)  # a rerun into the same --out starts empty
        agents = write_agents(work / f"sharing-{arch}.json", preamble, tails)
        report = build_json(agents, model, root)
        per_token = kv_bytes_per_token(root)
        prefixes = record_tokens(root, report["entries"])
        unique_kv = distinct_tokens(prefixes) * per_token
        n = [len(t) for t in prefixes]
        by_folder = {f: folder_bytes(root, f) for f in ("blocks", "checkpoints", "snapshots")}
        stored = sum(by_folder.values())
        cache = pinned_bytes(model, root, agents, work / f"sharing-{arch}-serve.log")
        tails[3] = tails[3].replace(
            "Answer in one sentence.", "Answer in two short sentences, then stop."
        )
        edited = build_json(write_agents(agents, preamble, tails), model, root)
        entry = edited["entries"][3]
        (new,) = record_tokens(root, [entry])
        changed = len(new) - common_prefix_length((prefixes[3], new))
        out[arch] = {
            "agents": n_agents,
            "tokens_per_agent": n,
            "preamble_tokens": min(common_prefix_length((prefixes[0], t)) for t in prefixes[1:]),
            "distinct_tokens": distinct_tokens(prefixes),
            "kv_bytes_per_token": per_token,
            "unique_kv_bytes": unique_kv,
            "whole_file_bytes": sum(n) * per_token,
            "store_bytes": stored,
            "store_by_folder": by_folder,
            "store_vs_unique": stored / unique_kv,
            "pinned_bytes": cache["current_memory_mb"] * 2**20,
            "pinned_vs_unique": cache["current_memory_mb"] * 2**20 / unique_kv,
            "edit": {
                "changed_tokens": changed,
                "tokens_prefilled": entry["tokens_prefilled"],
                "goal": report["block_tokens"] + changed,
                "others_prefilled": sum(
                    e["tokens_prefilled"] for i, e in enumerate(edited["entries"]) if i != 3
                ),
            },
            "block_tokens": report["block_tokens"],
            "checkpoint_every": report["checkpoint_every"],
            "cache_status": cache,
        }
    return out


def part_edit(work: Path, prompt_tokens: int) -> dict:
    out = {}
    for arch in ("dense", "hybrid"):
        model = make_demo_model(work / f"{arch}-tiny", DemoSpec(arch=arch))
        count = token_counter(model)
        body = words_for(count, 2, prompt_tokens)
        others = [words_for(count, 300 + i, prompt_tokens // 4) for i in range(2)]
        agents = work / f"edit-{arch}.json"
        agents.write_text(
            json.dumps(
                [
                    {
                        "name": "long",
                        "messages": [
                            {"role": "system", "content": body + " Answer in one sentence."}
                        ],
                    },
                    *(
                        {"name": f"other{i}", "messages": [{"role": "system", "content": o}]}
                        for i, o in enumerate(others)
                    ),
                ]
            )
        )
        shutil.rmtree(work / f"edit-{arch}", ignore_errors=True)  # a rerun starts empty too
        build_json(agents, model, work / f"edit-{arch}")
        agents.write_text(
            agents.read_text().replace(
                "Answer in one sentence.", "Answer in two short sentences, then stop."
            )
        )
        report = build_json(agents, model, work / f"edit-{arch}")
        out[arch] = {
            e["name"]: {
                k: e[k]
                for k in (
                    "status",
                    "n_tokens",
                    "tokens_reused",
                    "tokens_prefilled",
                    "blocks_written",
                    "bytes_written",
                )
            }
            for e in report["entries"]
        }
        out[arch]["block_tokens"], out[arch]["checkpoint_every"] = (
            report["block_tokens"],
            report["checkpoint_every"],
        )
    return out


def _restore_once(store_root: Path, how: str) -> float:
    """One restore: ``server`` reads a record's blocks into a pool as the server does (a v2 file:
    its arrays); ``assembled`` builds the whole cache (what build and the vllm-mlx route do)."""
    import mlx.core as mx

    from kvsnap.runtime.cache.composed import BlockPool, load_composed
    from kvsnap.snapshot.codec import decode_cache
    from kvsnap.store.local import Store

    store = Store.open(store_root, readonly=True)
    info = store.scan()[0][0]
    t0 = time.perf_counter()
    if how == "server" and info.chain is not None:
        state, _ = load_composed(store, info, BlockPool())
        mx.eval([a for _, _, b in state.blocks for a in b.arrays.values()])
    else:
        cache = decode_cache(store.load_arrays(info), info.layers)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t0


def whole_file_copy(src: Path, dest: Path) -> None:
    """The same prompt as one v2 file (what kvsnap wrote before blocks): for the A/B."""
    from kvsnap.snapshot.codec import to_out_tensors
    from kvsnap.snapshot.file import read_header
    from kvsnap.snapshot.format import CHAIN, CHECKSUM_KEY, WHOLE_FILE_FORMAT
    from kvsnap.store.local import Store

    store = Store.open(src, readonly=True)
    out = Store.open(dest, create=True)
    for info in store.scan()[0]:
        arrays = store.load_arrays(info)
        meta = {
            k: v
            for k, v in read_header(info.path).metadata.items()
            if k not in (CHECKSUM_KEY, CHAIN)
        }
        meta["kvsnap.format"] = str(WHOLE_FILE_FORMAT)
        with out.lock():
            out.put(info.key, to_out_tensors(arrays), meta)
    (dest / "manifest.json").write_bytes((src / "manifest.json").read_bytes())


def first_ttft(model: Path, store: Path, agents: Path, system: str, log: Path) -> dict:
    server = start_server(
        model,
        ["--continuous-batching", "--warm-prompts", agents, "--kv-snapshots", store],
        log,
        limit_s=900,
    )
    try:
        ready = server.wait_ready(600)
        body = {
            "model": model.name,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "Please review the server's request handler."},
            ],
            "max_tokens": 1,
            "temperature": 0,
        }
        t0 = time.perf_counter()
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600).json()
        return {
            "ready_s": ready,
            "ttft_s": time.perf_counter() - t0,
            "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"],
        }
    finally:
        server.stop()


def part_restore(work: Path, tokens: int, reps: int, size: str) -> dict:
    model = make_demo_model(
        work / f"restore-{size}", DemoSpec(arch="dense", size=size, text_outputs=True)
    )
    count = token_counter(model)
    system = words_for(count, 5, tokens)
    agents = work / "restore.json"
    agents.write_text(
        json.dumps([{"name": "agent", "messages": [{"role": "system", "content": system}]}])
    )
    build_json(agents, model, work / "restore-blocks")
    whole_file_copy(work / "restore-blocks", work / "restore-whole")
    restore: dict[str, list[float]] = {"blocks-server": [], "blocks-assembled": [], "whole": []}
    for _ in range(reps):  # interleaved
        for name in restore:
            restore[name].append(
                _restore_once(
                    work / f"restore-{name.split('-')[0]}",
                    name.split("-")[-1] if "-" in name else "server",
                )
            )
    ttft: dict[str, list[dict]] = {"blocks": [], "whole": []}
    for rep in range(reps):
        for name in ("blocks", "whole") if rep % 2 == 0 else ("whole", "blocks"):
            ttft[name].append(
                first_ttft(
                    model, work / f"restore-{name}", agents, system, work / f"ttft-{name}-{rep}.log"
                )
            )
    state = folder_bytes(work / "restore-whole", "snapshots")
    med = {k: statistics.median(v) for k, v in restore.items()}
    ttft_med = {k: statistics.median(x["ttft_s"] for x in v) for k, v in ttft.items()}
    return {
        "tokens": tokens,
        "state_bytes": state,
        "restore_s": med,
        "restore_runs": restore,
        "read_speed_ratio": {k: med["whole"] / v for k, v in med.items() if k != "whole"},
        "GB_per_s": {k: state / v / 1e9 for k, v in med.items()},
        "first_ttft_s": ttft_med,
        "ttft_ratio": ttft_med["blocks"] / ttft_med["whole"],
        "ttft_runs": ttft,
    }


def part_new_agent(work: Path, preamble_tokens: int) -> dict:
    out = {}
    for arch in ("dense", "hybrid"):
        model = make_demo_model(work / f"{arch}-tiny", DemoSpec(arch=arch))
        count = token_counter(model)
        preamble = words_for(count, 7, preamble_tokens)
        agents = write_agents(
            work / f"new-{arch}.json",
            preamble,
            [f"You are agent {i}. " + words_for(count, 700 + i, 100) for i in range(3)],
        )
        report = build_json(agents, model, work / f"new-{arch}")
        shared = min(e["tokens_reused"] for e in report["entries"][1:])
        server = start_server(
            model,
            [
                "--continuous-batching",
                "--warm-prompts",
                agents,
                "--kv-snapshots",
                work / f"new-{arch}",
            ],
            work / f"new-{arch}.log",
            limit_s=600,
        )
        try:
            server.wait_ready(300)
            body = {
                "model": model.name,
                "messages": [
                    {
                        "role": "system",
                        "content": preamble + " You are a brand new agent nobody built.",
                    },
                    {"role": "user", "content": "Hello."},
                ],
                "max_tokens": 1,
                "temperature": 0,
            }
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300).json()
        finally:
            server.stop()
        b, c = report["block_tokens"], report["checkpoint_every"]
        out[arch] = {
            "preamble_tokens": shared,
            "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"],
            "goal": shared // b * b if arch == "dense" else shared // c * c,
        }
    return out


def part_registry(n_agents: int, preamble_blocks: int, tail_blocks: int) -> dict:
    """The manifest `kvsnap push` would tag for 1,000 agents sharing a preamble (no registry
    needed)."""
    import hashlib

    from kvsnap.store.oci.artifact import Layer, artifact_manifest

    def layer(rel: str) -> Layer:
        return Layer(rel, "sha256:" + hashlib.sha256(rel.encode()).hexdigest(), 1 << 20)

    def key(i: int) -> str:
        return hashlib.md5(str(i).encode()).hexdigest()

    rels = ["manifest.json"] + [f"snapshots/{key(i)}.safetensors" for i in range(n_agents)]
    rels += [
        f"blocks/{key(10**6 + i)}.safetensors"
        for i in range(preamble_blocks + n_agents * tail_blocks)
    ]
    body = artifact_manifest([layer(r) for r in rels])
    return {
        "agents": n_agents,
        "files": len(rels),
        "manifest_bytes": len(body),
        "limit_bytes": 4 << 20,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvsnap-bench-blocks"))
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument(
        "--reps", type=int, default=3, help="restore / TTFT repetitions, interleaved (default 3)"
    )
    ap.add_argument(
        "--restore-size",
        default="qwen3-0.6b",
        choices=("tiny", "qwen3-0.6b"),
        help="the restore part's model: Qwen3-0.6B-shaped fp32 (the goal's), or tiny for a smoke "
        "run",
    )
    ap.add_argument(
        "--sharing-tokens",
        default="2000,200",
        help="the sharing part's preamble and tail lengths in tokens (default 2000,200)",
    )
    args = ap.parse_args(argv)
    try:
        preamble_tokens, tail_tokens = (int(x) for x in args.sharing_tokens.split(","))
    except ValueError:
        raise SystemExit(
            f"--sharing-tokens is {args.sharing_tokens!r}; give two token counts, e.g. 2000,200"
        ) from None
    only = [p for p in args.only.split(",") if p]
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    runs = {
        "sharing": lambda: part_sharing(args.out, 10, preamble_tokens, tail_tokens),
        "edit": lambda: part_edit(args.out, 4000),
        "restore": lambda: part_restore(args.out, 2048, args.reps, args.restore_size),
        "new-agent": lambda: part_new_agent(args.out, 1500),
        "registry": lambda: part_registry(1000, 8, 1),
    }
    for name in only:
        t0 = time.perf_counter()
        results[name] = runs[name]()
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[{name}] {json.dumps(results[name], default=str)[:600]}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"results in {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
