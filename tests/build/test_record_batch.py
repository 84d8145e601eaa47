"""The build's manifest record is written once per batch, not once per entry: N agents cost a
constant number of manifest writes (each write reads, checks and rewrites the whole manifest,
so one per entry made a build O(N²)); a failed write fails the entries it held, and a crash
loses only the entries since the last write.

Real tiny model, real store, the real build pipeline; the store's manifest writer is spied on
(counted), never replaced, except where a failure is injected."""

from __future__ import annotations

import json

import pytest
from helpers.local_store import agents, build, write_agents

from kvsnap.build import record_batch
from kvsnap.build.record_batch import COST_SHARE, RecordBatch
from kvsnap.errors import StoreError
from kvsnap.snapshot.format import MANIFEST
from kvsnap.store.local import Store
from kvsnap.store.pending import pending_files


def _counting(monkeypatch) -> dict[str, int]:
    """Count every manifest write and read of any store (the real ones still run)."""
    counts = {"writes": 0, "reads": 0}
    write, read = Store._write_manifest, Store.read_manifest

    def counted_write(self, data: bytes) -> None:
        counts["writes"] += 1
        write(self, data)

    def counted_read(self) -> dict:
        counts["reads"] += 1
        return read(self)

    monkeypatch.setattr(Store, "_write_manifest", counted_write)
    monkeypatch.setattr(Store, "read_manifest", counted_read)
    return counts


@pytest.mark.parametrize("n_agents", [30, 60])
def test_n_agents_write_the_manifest_a_constant_number_of_times(
    lm, tmp_path, monkeypatch, n_agents
):
    agents_file = write_agents(
        tmp_path / "agents.json", agents([f"agent{i:03d}" for i in range(n_agents)])
    )
    counts = _counting(monkeypatch)
    report = build(lm, agents_file, tmp_path / "store")
    assert report.ok and report.count("built") == n_agents
    # one write at the end, plus at most one per FLUSH_SECONDS of building
    assert counts["writes"] <= 1 + report.seconds / record_batch.FLUSH_SECONDS, counts
    assert counts["reads"] <= 3 * counts["writes"] + 2, counts
    (record,) = Store.open(tmp_path / "store").read_manifest()["records"].values()
    assert sorted(e["name"] for e in record["entries"]) == [
        f"agent{i:03d}" for i in range(n_agents)
    ]
    assert pending_files(tmp_path / "store") == []  # the build's pending file is gone


def test_a_rebuild_after_an_edit_lists_every_entry_and_rewrites_only_the_edited_one(lm, tmp_path):
    names = ["alpha", "beta", "gamma", "delta"]
    agents_file = write_agents(tmp_path / "agents.json", agents(names))
    first = build(lm, agents_file, tmp_path / "store")
    edited = agents(names)
    edited[2]["messages"][0]["content"] += " Be brief."
    write_agents(agents_file, edited[:3] + [agents(["omega"])[0]])  # delta leaves, omega comes
    second = build(lm, agents_file, tmp_path / "store")
    status = {e.name: e.status for e in second.entries}
    assert status == {"alpha": "reused", "beta": "reused", "gamma": "built", "omega": "built"}
    (record,) = Store.open(tmp_path / "store").read_manifest()["records"].values()
    listed = {e["name"]: e["key"] for e in record["entries"]}
    want = {e.name: e.key for e in second.entries}
    assert listed == want and listed["alpha"] == {e.name: e.key for e in first.entries}["alpha"]


def test_a_manifest_that_cannot_be_written_fails_the_entries_it_held_and_a_rebuild_lists_them(
    lm, tmp_path, monkeypatch
):
    agents_file = write_agents(tmp_path / "agents.json", agents(["alpha", "beta"]))
    root = tmp_path / "store"
    Store.open(root, create=True).update_record("unrelated", lambda r: {"entries": []})
    before = (root / MANIFEST).read_bytes()

    def full_disk(self, data: bytes) -> None:
        raise StoreError(f"cannot write {self.root / MANIFEST} (No space left on device)")

    with monkeypatch.context() as m:
        m.setattr(Store, "_write_manifest", full_disk)
        report = build(lm, agents_file, root)
    assert not report.ok and {e.status for e in report.entries} == {"failed"}
    assert all("the manifest could not list it" in e.error for e in report.entries)
    assert (root / MANIFEST).read_bytes() == before and pending_files(root) == []
    again = build(lm, agents_file, root)
    assert again.ok and {e.status for e in again.entries} == {"reused"}  # nothing prefilled
    records = Store.open(root).read_manifest()["records"]
    assert sorted(e["name"] for r in records.values() for e in r.get("entries", [])) == [
        "alpha",
        "beta",
    ]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _entry(name: str, key: str) -> dict:
    return {"name": name, "key": key, "file": f"snapshots/{key}.safetensors"}


def test_a_batch_is_due_after_its_seconds_and_never_sooner_than_its_write_cost_allows(tmp_path):
    store = Store.open(tmp_path / "s", create=True)
    clock = Clock()
    batch = RecordBatch(store, "r", lambda record, e: {**record, "entries": [e]}, clock, 10.0)
    assert not batch.due()  # nothing pending
    with store.lock():
        batch.add(_entry("a", "a" * 32))
    clock.now += 9.9
    assert not batch.due()
    clock.now += 0.1
    assert batch.due()

    def slow_write(record: dict) -> dict:  # a manifest write that takes 2 s
        clock.now += 2.0
        return {**record, "entries": [*record.get("entries", []), _entry("b", "b" * 32)]}

    batch.upsert = lambda record, e: slow_write(record)
    batch.flush()
    assert batch.writes == 1 and not batch.pending
    with store.lock():
        batch.add(_entry("c", "c" * 32))
    clock.now += 10.0
    assert not batch.due()  # the write took 4 s (two 2 s upserts): 20× that must pass
    clock.now += COST_SHARE * batch._cost
    assert batch.due()
    batch.close()
    assert pending_files(store.root) == []


def test_a_batch_puts_entries_as_one_upsert_each_would_and_keeps_duplicate_names_it_holds_not(
    tmp_path,
):
    """An installed record may hold two entries of one name: only names the batch writes are
    replaced (as the per-entry upsert did), the rest stay as they are."""
    store = Store.open(tmp_path / "s", create=True)
    a1, a2, b_old = _entry("a", "1" * 32), _entry("a", "2" * 32), _entry("b", "3" * 32)
    store.update_record("r", lambda r: {"entries": [a1, b_old, a2], "other": 1})

    def upsert(record: dict, entry: dict) -> dict:
        entries = [e for e in record.get("entries", []) if e.get("name") != entry["name"]]
        return {
            **record,
            "updated": "now",
            "entries": sorted(entries + [entry], key=lambda e: e["name"]),
        }

    batch = RecordBatch(store, "r", upsert)
    b_new, c = _entry("b", "4" * 32), _entry("c", "5" * 32)
    with store.lock():
        batch.add(c)
        batch.add(b_new)
    batch.flush()
    record = store.read_manifest()["records"]["r"]
    assert record["entries"] == [a1, a2, b_new, c] and record["other"] == 1
    batch.flush(keep={"a", "c"})  # entries that left the agents file leave the record
    assert store.read_manifest()["records"]["r"]["entries"] == [a1, a2, c]
    writes = batch.writes
    batch.flush(keep={"a", "c"})
    assert batch.writes == writes  # unchanged: not rewritten
    batch.close()
    assert json.loads((store.root / MANIFEST).read_text())["records"]["r"]["other"] == 1
