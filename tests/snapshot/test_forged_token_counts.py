"""A valid record claiming 25M tokens made `kvsnap ls` peak at 1.3 GB and the
server's start scan read all of it. Token counts are bounded before any token is read: by
kvsnap's MAX_TOKENS everywhere, and by the model's context where the model is known.

Real files written the way an attacker would (key, digests and checksum recomputed).
"""

from __future__ import annotations

import json
import time
import tracemalloc

from helpers.cli import no_traceback, run_kvsnap_in_1gib
from helpers.forged import forge_long_record

from kvsnap.key import KVSettings
from kvsnap.runtime.warmup.prefetch import context_tokens, prefetch
from kvsnap.snapshot.header import MAX_TOKENS
from kvsnap.store.local import Store

AGENTS = [
    {
        "name": "alpha",
        "messages": [
            {"role": "system", "content": "You are the alpha agent. Review the code briefly."}
        ],
    }
]


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
