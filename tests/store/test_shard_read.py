"""One rank's slice of a stored snapshot, read from a real store built by one process: the heads
or layers of that rank and nothing else, every row checked, equal to the same slice of the whole
state; a damaged copy on that rank refused by name; a file without row digests read whole."""

from __future__ import annotations

import pytest
from helpers.stores import AGENTS, build_store

from kvsnap.errors import SnapshotError
from kvsnap.snapshot.format import TOKENS
from kvsnap.snapshot.shard_view import ShardView
from kvsnap.store.local import Store
from kvsnap.store.shard_read import ReadMeter, load_shard_state


def _whole_and_record(store_root):
    store = Store.open(store_root)
    good, _ = store.scan()
    info = max(good, key=lambda i: i.n_tokens)
    return store, info, store.load_arrays(info)


def _store_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def test_tensor_parallel_ranks_read_their_heads_only_and_together_the_whole_state(built):
    import mlx.core as mx

    store, info, whole = _whole_and_record(built)
    parts, meters = [], []
    for rank in (0, 1):
        meter = ReadMeter()
        arrays, layers = load_shard_state(store, info, None, ShardView("tensor", rank, 2), meter)
        assert layers == info.layers
        parts.append(arrays)
        meters.append(meter)
    for name, a in whole.items():
        if name == TOKENS:
            assert parts[0][name].tolist() == a.tolist()
            continue
        joined = mx.concatenate([parts[0][name], parts[1][name]], axis=1)
        assert mx.array_equal(joined, a).item(), name
    # each rank read about half of what the snapshot holds: its heads, plus the headers
    reached = _store_bytes(built) - sum(
        p.stat().st_size for p in (built / "snapshots").iterdir() if p != info.path
    )
    for meter in meters:
        assert meter.whole_files == 0
        assert meter.nbytes < reached / 2 + 16 * 1024 * meter.files


def test_pipeline_ranks_read_their_layers_renumbered(demo_models, tmp_path):
    import mlx.core as mx

    lm = demo_models.load("hybrid")
    root = build_store(lm, tmp_path / "snaps", AGENTS)
    store, info, whole = _whole_and_record(root)
    n = len(info.layers)
    meter = ReadMeter()
    arrays, layers = load_shard_state(
        store, info, None, ShardView("pipeline", 0, 2, n // 2, n), meter
    )
    assert layers == info.layers[n // 2 :]
    for name, a in arrays.items():
        if name == TOKENS:
            continue
        head, _, rest = name.partition(".")
        assert mx.array_equal(a, whole[f"{int(head) + n // 2}.{rest}"]).item(), name
    assert {name.split(".")[0] for name in arrays} - {TOKENS} == {str(i) for i in range(n - n // 2)}


def test_a_damaged_copy_on_one_rank_is_refused_there_by_name(built, monkeypatch):
    store, info, _ = _whole_and_record(built)
    block = f"blocks/{info.chain.blocks[0][0]}.safetensors"
    monkeypatch.setenv("KVSNAP_FAULT_DAMAGED_COPY", f"1:{block}")
    load_shard_state(store, info, None, ShardView("tensor", 0, 2), ReadMeter())  # rank 0 is fine
    with pytest.raises(SnapshotError, match=r"row \d+ does not hash") as err:
        load_shard_state(store, info, None, ShardView("tensor", 1, 2), ReadMeter())
    assert err.value.path.endswith(block)


def test_a_part_without_row_digests_is_read_whole_then_cut(built, monkeypatch):
    import mlx.core as mx

    from kvsnap.snapshot import rows

    store, info, whole = _whole_and_record(built)
    monkeypatch.setattr(rows.RowDigests, "of", classmethod(lambda cls, header: None))
    meter = ReadMeter()
    arrays, _ = load_shard_state(store, info, None, ShardView("tensor", 1, 2), meter)
    assert meter.whole_files == meter.files - 1  # every part; the record is read as always
    name = next(n for n in whole if n != TOKENS)
    heads = whole[name].shape[1]
    assert mx.array_equal(arrays[name], whole[name][:, heads // 2 :]).item()
