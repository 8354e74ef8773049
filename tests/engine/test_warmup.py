"""Warm-up: state survives restarts; an unclean shutdown starts a new history branch."""

from __future__ import annotations

import pytest

from dcp.producer.engine import LmdbStorage, StorageError
from dcp.producer.engine.records import VBStateRecord
from dcp.producer.engine.warmup import failover_seqno_after_crash, warm_up
from dcp.protocol.errors import KeyNotFound
from dcp.protocol.opcodes import VBucketState

from .conftest import small_config


def test_new_bucket_has_one_failover_entry_at_0_per_vbucket(open_bucket, uuids) -> None:
    b = open_bucket()
    logs = [b.vbucket(v).failover_log.entries for v in range(4)]
    assert logs == [[(0x1000 + v, 0)] for v in range(4)]
    assert all(b.vbucket(v).state == VBucketState.ACTIVE for v in range(4))


def test_clean_restart_keeps_everything_and_adds_no_failover_entry(open_bucket, clock) -> None:
    b = open_bucket()
    b.set(0, b"a", b"1", flags=4, expiry=100)
    b.set(0, b"b", b"2")
    b.delete(0, b"b")
    b.set(1, b"c", b"3")
    cas_a = b.get(0, b"a").cas
    log0 = list(b.vbucket(0).failover_log.entries)
    b.flusher.flush_all()
    b.close()
    b2 = open_bucket()
    assert not b2.warmup_unclean
    vb = b2.vbucket(0)
    assert (vb.high_seqno, vb.persisted_seqno) == (3, 3)
    assert vb.failover_log.entries == log0
    g = b2.get(0, b"a")
    assert (g.value, g.flags, g.cas) == (b"1", 4, cas_a)
    with pytest.raises(KeyNotFound):
        b2.get(0, b"b")
    assert b2.set(0, b"d", b"4").seqno == 4
    assert b2.set(0, b"d", b"5").cas > cas_a
    # the expiry heap was rebuilt
    clock.advance(200)
    assert b2.expire() == 1


def test_unclean_shutdown_adds_failover_entry_at_last_persisted_point(open_bucket) -> None:
    b = open_bucket()
    b.set(0, b"a", b"1")
    b.set(0, b"b", b"2")
    b.flusher.flush_all()
    b.set(0, b"c", b"3")  # never persisted
    b.vbucket(2).set_state(VBucketState.REPLICA)
    b.flusher.flush_all()
    b.set(0, b"d", b"4")
    old = list(b.vbucket(0).failover_log.entries)
    b.close(clean=False)
    b2 = open_bucket()
    assert b2.warmup_unclean
    vb = b2.vbucket(0)
    assert vb.high_seqno == 3
    assert vb.failover_log.entries[1:] == old
    assert vb.failover_log.entries[0][1] == 3 and vb.uuid != old[0][0]
    # replicas get no new entry
    assert len(b2.vbucket(2).failover_log) == 1
    # the new entry was persisted: a second crash does not need another one to be right
    b2.close(clean=False)
    b3 = open_bucket()
    assert b3.vbucket(0).failover_log.entries[1] == vb.failover_log.entries[0]


def test_close_with_unpersisted_items_is_recorded_unclean(open_bucket) -> None:
    b = open_bucket()
    b.set(0, b"a", b"1")
    b.close(clean=True)  # nothing flushed: the item is lost, consumers must roll back
    b2 = open_bucket()
    assert b2.warmup_unclean
    assert len(b2.vbucket(0).failover_log) == 2


def test_failover_seqno_rule_of_reference_5_3() -> None:
    assert failover_seqno_after_crash(VBStateRecord(1, [], 10, 5, 10)) == 10
    assert failover_seqno_after_crash(VBStateRecord(1, [], 8, 5, 10)) == 5


def test_unclean_warmup_prunes_entries_above_and_caps_at_max(open_bucket, uuids) -> None:
    b = open_bucket(max_failover_entries=3)
    vb = b.vbucket(0)
    b.set(0, b"a", b"1")
    b.flusher.flush_all()
    vb.failover_log.entries = [(0xF3, 50), (0xF2, 1), (0xF1, 0)]  # 50: a lost branch
    vb._state_changed()
    b.flusher.flush_all()
    b.close(clean=False)
    b2 = open_bucket(max_failover_entries=3)
    entries = b2.vbucket(0).failover_log.entries
    assert [s for _, s in entries] == [1, 1, 0]
    assert entries[1:] == [(0xF2, 1), (0xF1, 0)]


def test_warmup_rebuilds_disk_index_so_superseded_versions_still_get_deleted(open_bucket) -> None:
    b = open_bucket()
    b.set(0, b"a", b"1")
    b.flusher.flush_all()
    b.close()
    b2 = open_bucket()
    b2.set(0, b"a", b"2")
    b2.flusher.flush_all()
    with b2.storage.open_backfill(0, 0) as scan:
        assert [(it.seqno, it.value) for it in scan.read(10)] == [(2, b"2")]


def test_incompatible_data_dir_is_refused(open_bucket) -> None:
    b = open_bucket()
    b.close()
    with pytest.raises(StorageError):
        open_bucket(num_vbuckets=8)


def test_warm_up_reads_storage_and_config_alone_and_clears_the_clean_marker(
    open_bucket, tmp_path, uuids
) -> None:
    b = open_bucket()
    b.set(1, b"a", b"1", expiry=2_000_000_000)
    b.set(1, b"b", b"2")
    b.delete(1, b"b")
    cas_b = b.vbucket(1).key_meta(b"b")[2]
    b.flusher.flush_all()
    b.close()
    cfg = small_config()
    storage = LmdbStorage(tmp_path / "data", num_vbuckets=4, map_size=cfg.map_size, sync=False)
    try:
        assert storage.clean_shutdown
        w = warm_up(storage, cfg, uuids)
        assert not w.unclean and [v.vbid for v in w.vbuckets] == [0, 1, 2, 3]
        vb1 = w.vbuckets[1]
        assert (vb1.high_seqno, vb1.snap_end, vb1.state) == (3, 3, VBucketState.ACTIVE)
        assert vb1.index[b"a"][0::4] == (1, 2_000_000_000) and vb1.index[b"b"][6] == 1
        assert vb1.max_cas == cas_b
        assert w.vbuckets[0].index == {}
        assert storage.disk_keys(1) == {b"a": 1, b"b": 3}
    finally:
        storage.close()
    storage = LmdbStorage(tmp_path / "data", num_vbuckets=4, map_size=cfg.map_size)
    try:
        assert not storage.clean_shutdown  # a crash from now on is unclean
    finally:
        storage.close()
