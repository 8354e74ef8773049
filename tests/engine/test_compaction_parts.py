"""Compaction split by ownership: the policy (Compactor, no storage), the transaction
(LmdbStorage.compact + lmdb_compaction), the storage's bookkeeping (DiskIndex)."""

from __future__ import annotations

import lmdb
import pytest

from dcp.producer.engine import StorageError, VBStateRecord
from dcp.producer.engine import storage as storage_module
from dcp.producer.engine.compaction import Compactor
from dcp.producer.engine.disk_index import DiskIndex
from dcp.producer.engine.lmdb_compaction import VBucketCompaction

from .conftest import small_config


def test_the_compactor_plans_from_config_and_clock_alone(clock) -> None:
    cfg = small_config(history_seconds=60.0, history_bytes=4000, tombstone_purge_age=100.0)
    plan = Compactor([], cfg, clock).plan()
    assert plan.now == clock()
    assert plan.vbuckets == [0, 1, 2, 3]
    assert plan.purge_before == clock() - 100.0
    assert plan.history_cutoff_cas == int((clock() - 60.0) * 1e9)
    assert plan.history_bytes_per_vb == 1000
    off = Compactor([], small_config(), clock).plan(now=5.0, vbuckets=[2])
    assert (off.vbuckets, off.history_cutoff_cas, off.history_bytes_per_vb) == ([2], 0, 0)


def test_disk_index_merge_never_lowers_compactions_seqnos_nor_changes_the_callers_record() -> None:
    d = DiskIndex(2)
    d.compacted(VBucketCompaction(1, [], purge_seqno=7, pruned=0, history_start=3))
    rec = VBStateRecord(1, [(5, 0)], 10, 0, 10, purge_seqno=2, history_start=5)
    out = d.merged(1, rec)
    assert (out.purge_seqno, out.history_start) == (7, 5)
    assert (rec.purge_seqno, rec.history_start) == (2, 5)  # a copy was changed
    assert d.merged(0, rec) is rec  # nothing raised for vb 0


def test_disk_index_forgets_a_purged_key_only_if_no_newer_version_was_stored() -> None:
    d = DiskIndex(1)
    d.keys[0].update({b"gone": 3, b"rewritten": 9})
    d.compacted(VBucketCompaction(0, [(b"gone", 3), (b"rewritten", 4)], 4, 0, 0))
    assert d.keys[0] == {b"rewritten": 9}
    assert d.purge_seqno == [4]


def test_an_aborted_compaction_changes_neither_disk_nor_bookkeeping(
    open_bucket, clock, monkeypatch
) -> None:
    b = open_bucket(tombstone_purge_age=10.0)
    b.set(0, b"a", b"1")
    b.delete(0, b"a")  # seqno 2
    b.flusher.flush_all()
    clock.advance(20)
    real = storage_module.compact_vbucket

    def fail_after_the_work(*args, **kw):
        real(*args, **kw)  # deletes inside the transaction, which is then aborted
        raise lmdb.Error("mdb_txn_commit: Input/output error")

    monkeypatch.setattr(storage_module, "compact_vbucket", fail_after_the_work)
    with pytest.raises(StorageError, match="compaction of vb 0 aborted"):
        b.storage.compact(b.compactor.plan())
    assert b.storage.disk_keys(0) == {b"a": 2}
    with b.storage.open_backfill(0, 0) as scan:
        assert [it.seqno for it in scan.read(10)] == [2]
    monkeypatch.setattr(storage_module, "compact_vbucket", real)
    result = b.storage.compact(b.compactor.plan())
    assert b.compactor.complete(result) == 1
    assert b.storage.disk_keys(0) == {}
    assert b.vbucket(0).purge_seqno == 2 and b.vbucket(0).key_meta(b"a") is None
