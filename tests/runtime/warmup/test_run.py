"""A warm-up reading a store and writing back prompts that share its blocks checks each
block once: the header and checksum a pin's read checked are not checked again by every
write-back that names the block (it was once per prompt written back)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest
from helpers.cli import build_args, run_kvsnap
from helpers.models import LONG_SYSTEM


def _agent(name: str, user: str) -> dict:
    return {
        "name": name,
        "messages": [
            {"role": "system", "content": LONG_SYSTEM},
            {"role": "user", "content": user},
            {"role": "assistant", "content": "Sure, on it."},
        ],
    }


BUILT = [_agent("a", "Review the parser module please."), _agent("b", "Review the writer now.")]
NEW = [_agent(f"n{i}", f"Now check file number {i} and its tests.") for i in range(3)]


@pytest.mark.parametrize("arch", ["dense", "hybrid"])
def test_a_warm_up_checks_each_part_once_however_many_write_backs_share_it(
    arch, demo_models, tmp_path, monkeypatch
):
    import kvsnap.store.checking
    import kvsnap.store.reading
    from kvsnap.prompts import load_warm_prompts
    from kvsnap.runtime.engine.engine import Engine, EngineConfig
    from kvsnap.store.local import Store
    from kvsnap.store.paths import chain_relpaths

    monkeypatch.setenv("KVSNAP_CACHE_DIR", str(tmp_path / "cache"))
    model, store_dir = demo_models.path(arch), tmp_path / "snaps"
    built, warm = tmp_path / "built.json", tmp_path / "warm.json"
    built.write_text(json.dumps(BUILT))
    warm.write_text(json.dumps(BUILT + NEW))
    r = run_kvsnap(*build_args(built, model, store_dir), env={"KVSNAP_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    store = Store.open(store_dir, readonly=True)
    stamps = {p: p.stat().st_mtime_ns for p in (store.root / "blocks").iterdir()}

    headers: Counter = Counter()  # a part's header checked (against itself and its chain)
    checksums: Counter = Counter()  # a part's data hashed and compared with its header's
    lock = threading.Lock()

    def counted(counter: Counter, real, where=lambda a: a[0]):
        def call(*a, **k):
            with lock:
                counter[str(Path(where(a)).relative_to(store.root))] += 1
            return real(*a, **k)

        return call

    for module in (kvsnap.store.reading, kvsnap.store.checking):
        monkeypatch.setattr(module, "inspect_part", counted(headers, module.inspect_part))
    monkeypatch.setattr(
        kvsnap.store.checking, "check_data", counted(checksums, kvsnap.store.checking.check_data)
    )
    # a read's checksum is over the bytes it read (``read_tensors``, finished in ``read_part``)
    monkeypatch.setattr(
        kvsnap.store.reading, "read_tensors", counted(checksums, kvsnap.store.reading.read_tensors)
    )
    engine = Engine(
        EngineConfig(
            model=str(model),
            snapshots=str(store_dir),
            warm_prompts=load_warm_prompts(warm),
            warm_prompts_file=str(warm),
        )
    )
    engine.start()
    try:
        assert engine.wait_warm(120)
        snaps = engine.status()["snapshots"]
        assert (snaps["loaded"], snaps["written"], snaps["rejected"]) == (2, 3, 0), snaps
    finally:
        engine.shutdown()
    after = Store.open(store_dir, readonly=True).scan()[0]
    assert len(after) == 5
    # the preamble's blocks, which all five records reach: read once by the pins, then named
    # by the three write-backs without a check of their own, and not rewritten
    shared = set.intersection(*(set(chain_relpaths(i)) for i in after))
    shared = {rel for rel in shared if rel.startswith("blocks/")}
    assert shared and all(
        stamps[store.root / rel] == (store.root / rel).stat().st_mtime_ns for rel in shared
    )
    assert all(headers[rel] == checksums[rel] == 1 for rel in shared), (headers, checksums)
    parts = {k for k in headers | checksums if not k.startswith("snapshots/")}
    assert {k: n for k, n in headers.items() if k in parts and n != 1} == {}
    assert {k: n for k, n in checksums.items() if k in parts and n != 1} == {}
