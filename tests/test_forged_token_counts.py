"""Issue 24 item 9a: a valid record claiming 25M tokens made `kvsnap ls` peak at 1.3 GB and the
server's start scan read all of it. Token counts are bounded before any token is read: by
kvsnap's MAX_TOKENS everywhere, and by the model's context where the model is known.

Real files written the way an attacker would (key, digests and checksum recomputed).
"""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest
from test_archive import build_store
from test_store_safety import no_traceback, run_kvsnap_in_1gib

from kvsnap.key import KVSettings, ModelIdentity
from kvsnap.runtime.warmup.prefetch import context_tokens, prefetch
from kvsnap.snapshot.file import CHECKSUM_KEY, OutTensor, read_header, write_snapshot
from kvsnap.snapshot.format import snapshot_filename
from kvsnap.snapshot.header import MAX_TOKENS, key_of, tokens_digest_of_bytes
from kvsnap.store.local import Store

AGENTS = [
    {
        "name": "alpha",
        "messages": [
            {"role": "system", "content": "You are the alpha agent. Review the code briefly."}
        ],
    }
]


@pytest.fixture(scope="module")
def built(demo_models, tmp_path_factory) -> Path:
    return build_store(demo_models.load("dense"), tmp_path_factory.mktemp("long") / "store", AGENTS)


def forge_long_record(root: Path, n_tokens: int) -> Path:
    """A whole-file (format 2) snapshot of ``n_tokens`` zero tokens and empty layers, built from a
    real record's identity: every digest, the key, the file name and the checksum are right."""
    real = read_header(Store.open(root).snapshot_files()[0]).metadata
    raw = bytes(4 * n_tokens)
    tokens_digest = tokens_digest_of_bytes(raw)
    key = key_of(
        ModelIdentity.from_dict(json.loads(real["kvsnap.model"])),
        real["kvsnap.prompt_digest"],
        tokens_digest,
        n_tokens,
    )
    layers = [{"class": "KVCache", "empty": True}]
    keep = ("kvsnap.model", "kvsnap.model_digest", "kvsnap.prompt_digest", "kvsnap.name")
    meta = {k: real[k] for k in keep} | {
        "kvsnap.format": "2",
        "kvsnap.key": key,
        "kvsnap.tokens_digest": tokens_digest,
        "kvsnap.n_tokens": str(n_tokens),
        "kvsnap.layers": json.dumps(layers),
    }
    meta.update(
        {k: v for k, v in real.items() if k not in meta and k not in (CHECKSUM_KEY, "kvsnap.chain")}
    )
    path = root / "snapshots" / snapshot_filename(key)
    with open(path, "wb") as f:
        write_snapshot(f, [OutTensor("tokens", "I32", (n_tokens,), memoryview(raw))], meta)
    return path


def test_regression_a_25m_token_record_is_refused_by_ls_and_scan_before_its_tokens_are_read(
    built, tmp_path
):
    import shutil

    root = tmp_path / "store"
    shutil.copytree(built, root)
    victim = forge_long_record(root, 25_000_000)

    t0 = time.perf_counter()
    r = run_kvsnap_in_1gib("ls", root)
    no_traceback(r)
    assert r.returncode == 0 and time.perf_counter() - t0 < 30, r.stdout + r.stderr
    # rich wraps at the terminal width, padding lines with spaces: compare with all whitespace
    # removed
    expected = f"unreadable: {victim}: kvsnap.n_tokens is 25000000, over the {MAX_TOKENS}"
    assert "".join(expected.split()) in "".join(r.stdout.split()), r.stdout

    tracemalloc.start()
    good, bad = Store.open(root).scan()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [i.name for i in good] == ["alpha"] and [p.path for p in bad] == [victim]
    assert peak < 8 << 20, peak  # the record's 100 MB of tokens never entered memory


def test_regression_a_record_longer_than_the_models_context_is_refused_by_the_start_scan(
    built, demo_models, tmp_path
):
    import shutil

    root = tmp_path / "store"
    shutil.copytree(built, root)
    model_dir = demo_models.path("dense")
    context = context_tokens(model_dir)
    assert (
        context
        == json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
        < MAX_TOKENS
    )
    victim = forge_long_record(root, context + 1)
    found = prefetch(str(root), model_dir, KVSettings(), budget_bytes=1 << 30)
    assert [i.name for i in found.infos] == ["alpha"], found.infos
    [problem] = found.problems
    assert (
        problem.path == victim
        and f"kvsnap.n_tokens is {context + 1}, over the {context} a record may hold here"
        in problem.reason
    )
