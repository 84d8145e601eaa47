"""Which part of a logical snapshot one rank holds: heads under tensor parallelism (split or
kept whole, as the rank's own model holds them), layers under pipeline parallelism, and the one
line naming both sides when a rank cannot take a state."""

from __future__ import annotations

import pytest

from kvsnap.errors import UsageError
from kvsnap.snapshot.shard_view import ShardError, ShardView

KV = [{"class": "KVCache", "offset": 4}]
SSM = [{"class": "ArraysCache", "size": 2, "present": [0, 1]}]


def test_tensor_parallel_ranks_take_contiguous_head_ranges():
    shapes = {"0.keys": (1, 4, 4, 8), "0.values": (1, 4, 4, 8)}
    assert ShardView("tensor", 0, 2).cut(KV, shapes)["0.keys"].rows == (0, 2)
    assert ShardView("tensor", 1, 2).cut(KV, shapes)["0.values"].rows == (2, 4)
    assert ShardView("tensor", 3, 4).cut(KV, shapes)["0.keys"].rows == (3, 4)


def test_a_rank_keeps_whole_what_its_model_keeps_whole_and_splits_what_it_splits():
    view = ShardView("tensor", 1, 2)
    # a replicated cache (DeepSeek's latent KV: one head on every rank)
    assert (
        view.cut(KV, {"0.keys": (1, 1, 4, 8)}, {"0.keys": (1, 1, None, 8)})["0.keys"].rows is None
    )
    assert view.cut(KV, {"0.keys": (1, 4, 4, 8)}, {"0.keys": (1, 2, None, 8)})["0.keys"].rows == (
        2,
        4,
    )
    # an SSM state the rank's model holds whole
    whole = view.cut(SSM, {"0.state.0": (1, 3, 256)}, {"0.state.0": (1, 3, 256)})
    assert whole["0.state.0"].rows is None


def test_what_a_tensor_parallel_rank_cannot_take_is_one_usage_error_naming_both():
    view = ShardView("tensor", 0, 2)
    with pytest.raises(ShardError, match=r"0\.state\.0 is a ArraysCache layer's whole state"):
        view.cut(SSM, {"0.state.0": (1, 3, 256)})
    with pytest.raises(ShardError, match=r"holds 3 KV heads, which 2 tensor-parallel ranks"):
        view.cut(KV, {"0.keys": (1, 3, 4, 8)})
    with pytest.raises(
        ShardError,
        match=r"is \[1, 4, 4, 8\] in the snapshot, but rank 0 of 2 \(tensor parallel\) "
        r"holds \[1, 3, T, 8\]",
    ):
        view.cut(KV, {"0.keys": (1, 4, 4, 8)}, {"0.keys": (1, 3, None, 8)})
    with pytest.raises(ShardError, match=r"holds \[1, 3, 128\]"):
        view.cut(SSM, {"0.state.0": (1, 3, 256)}, {"0.state.0": (1, 3, 128)})
    assert issubclass(ShardError, UsageError)  # the launch ends with one line, exit 2


def test_pipeline_ranks_take_their_layers_renumbered_from_zero():
    layers = [*KV, *SSM, *KV]
    shapes = {"0.keys": (1, 2, 4, 8), "1.state.0": (1, 3, 256), "2.keys": (1, 2, 4, 8)}
    last = ShardView("pipeline", 0, 2, 1, 3)
    assert {k: (c.local_name, c.rows) for k, c in last.cut(layers, shapes).items()} == {
        "1.state.0": ("0.state.0", None),
        "2.keys": ("1.keys", None),
    }
    assert last.local_layers(layers) == [*SSM, *KV]
    first = ShardView("pipeline", 1, 2, 0, 1)
    assert list(first.cut(layers, shapes)) == ["0.keys"]
    with pytest.raises(ShardError, match="holds 3 layers, but rank 0 of 2 .* runs layers up to 4"):
        ShardView("pipeline", 0, 2, 3, 5).local_layers(layers)
