"""Per-record CRC-32C: written with every record, checked before a record is served
(point reads, both backfill paths), format-1 stores migrated at open; and the storage
errors a full disk and a full map raise."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import lmdb
import pytest

from dcp.producer.engine import (
    Bucket,
    ChecksumError,
    DiskFullError,
    StorageError,
    StorageFullError,
)
from dcp.producer.engine.records import (
    CRC_SIZE,
    ITEM_RECORD,
    decode_item,
    item_key,
    record_intact,
)
from dcp.producer.engine.storage import _wrap
from dcp.protocol.opcodes import Status


def _flip(bucket: Bucket, vb: int, seqno: int, at: int) -> None:
    """Flip one bit of the stored record (vb, seqno) at byte ``at`` (negative: from the
    end), as a bad disk sector would, leaving LMDB's own structure intact."""
    st = bucket.storage
    with st.env.begin(write=True) as txn:
        raw = bytearray(txn.get(item_key(vb, seqno), db=st.item_db(vb)))
        raw[at] ^= 0x10
        txn.put(item_key(vb, seqno), bytes(raw), db=st.item_db(vb))


def _stored(bucket: Bucket, vb: int, seqno: int) -> bytes:
    st = bucket.storage
    with st.env.begin() as txn:
        return bytes(txn.get(item_key(vb, seqno), db=st.item_db(vb)))


def test_every_record_ends_with_the_crc32c_of_its_bytes(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"value-a", flags=7)
    bucket.delete(0, b"a")  # a tombstone (no stored body) carries one too
    bucket.set(0, b"b", b"value-b")
    bucket.flusher.flush_all()
    for seqno in (2, 3):
        raw = _stored(bucket, 0, seqno)
        body, trailer = raw[:-CRC_SIZE], raw[-CRC_SIZE:]
        assert trailer == google_crc32c.value(body).to_bytes(4, "little")
        assert record_intact(raw)
        assert not record_intact(raw[:-1] + bytes([raw[-1] ^ 1]))
    item = decode_item(0, _stored(bucket, 0, 3))
    assert (item.key, item.value) == (b"b", b"value-b")  # the trailer is not in the value


def _reopened_with_damage(open_bucket: Callable[..., Bucket], at: int) -> Bucket:
    b = open_bucket()
    b.set(1, b"good", b"g" * 100)
    b.set(1, b"bad", b"v" * 100)
    b.set(2, b"other", b"o" * 100)
    b.flusher.flush_all()
    b.close()
    b = open_bucket()  # warm-up: values are read from disk from now on
    _flip(b, 1, 2, at)
    return b


def test_a_flipped_value_byte_fails_the_get_with_einternal_and_a_log_line(
    open_bucket: Callable[..., Bucket], caplog: pytest.LogCaptureFixture
) -> None:
    b = _reopened_with_damage(open_bucket, -CRC_SIZE - 10)  # inside the value
    with caplog.at_level(logging.ERROR, logger="dcp.storage"):
        with pytest.raises(ChecksumError) as ei:
            b.get(1, b"bad")
    assert ei.value.status == Status.EINTERNAL and not ei.value.retriable
    assert (ei.value.vbucket, ei.value.seqno, ei.value.key) == (1, 2, b"bad")
    assert [r.getMessage() for r in caplog.records] == [
        "checksum mismatch in the stored record of vb 1 seqno 2 key b'bad': the data file "
        "is damaged there (dcpctl inspect DATA_DIR check lists every damaged record)"
    ]
    assert b.get(1, b"good").value == b"g" * 100  # the rest is served
    assert b.get(2, b"other").value == b"o" * 100


@pytest.mark.parametrize(
    "at", [0, 12, ITEM_RECORD.size - 1, -1], ids=["op", "delete-time", "extras", "trailer"]
)
def test_a_flip_anywhere_in_the_record_is_caught(
    open_bucket: Callable[..., Bucket], at: int
) -> None:
    b = _reopened_with_damage(open_bucket, at)
    with pytest.raises(ChecksumError):
        b.storage.get(1, 2)


def test_backfill_stops_at_a_damaged_record_and_returns_none_of_its_bytes(
    open_bucket: Callable[..., Bucket],
) -> None:
    b = _reopened_with_damage(open_bucket, -CRC_SIZE - 10)
    st = b.storage
    with st.open_backfill(1, 0) as scan:  # the ready-frame path of DCP streams
        with pytest.raises(ChecksumError, match="vb 1 seqno 2"):
            scan.read_frames(100, 2**64 - 1, 0xAB)
        assert scan.done
    with st.open_backfill(1, 0) as scan:  # the item path (streams without values)
        with pytest.raises(ChecksumError, match="vb 1 seqno 2"):
            scan.read(100)
    with st.open_backfill(1, 0) as scan:  # before the damaged record: served as usual
        chunk = scan.read_frames(100, 1, 0xAB)
        assert chunk.count == 1 and chunk.last == 1
    with st.open_backfill(2, 0) as scan:  # another vbucket is unaffected
        assert scan.read_frames(100, 2**64 - 1, 0).count == 1
    assert st.open_scans == 0


def test_backfill_frames_carry_the_body_without_the_trailer(bucket: Bucket) -> None:
    bucket.set(3, b"k", b"value")
    bucket.flusher.flush_all()
    with bucket.storage.open_backfill(3, 0) as scan:
        chunk = scan.read_frames(10, 2**64 - 1, 7)
    (run,) = chunk.segments
    frame = bytes(run.wire[: run.end])  # type: ignore[union-attr]
    assert int.from_bytes(frame[8:12], "big") == len(frame) - 24  # body length
    assert frame.endswith(b"k" + b"value")


def _write_format_1(
    data: Path,
    num_vbuckets: int,
    items: list[tuple[int, int, bytes]],
    open_bucket: Callable[..., Bucket],
) -> None:
    """A store as the engine wrote it before checksums: records without the trailer and
    ``format`` 1 in the meta DB."""
    b = open_bucket(num_vbuckets=num_vbuckets)
    for vb, _seqno, key in items:
        b.set(vb, key, b"old-" + key)
    b.flusher.flush_all()
    b.close()
    env = lmdb.open(str(data), max_dbs=num_vbuckets + 4)
    with env.begin(write=True) as txn:
        for vb, seqno, _key in items:
            db = env.open_db(b"seq:%04x" % vb, txn=txn)
            raw = txn.get(item_key(vb, seqno), db=db)
            txn.put(item_key(vb, seqno), raw[:-CRC_SIZE], db=db)
        txn.put(b"format", b"1", db=env.open_db(b"meta", txn=txn))
    env.close()


def test_a_format_1_store_gets_checksums_at_open(
    tmp_path: Path, open_bucket: Callable[..., Bucket]
) -> None:
    items = [(0, 1, b"a"), (0, 2, b"b"), (3, 1, b"c")]
    _write_format_1(tmp_path / "data", 4, items, open_bucket)
    b = open_bucket()
    assert b.storage.migrated == 3
    for vb, seqno, key in items:
        raw = _stored(b, vb, seqno)
        assert record_intact(raw)
        assert b.get(vb, key).value == b"old-" + key
    with b.storage.env.begin() as txn:
        assert txn.get(b"format", db=b.storage.meta_db) == b"2"
    b.close()
    assert open_bucket().storage.migrated == 0  # once only


def test_only_a_full_map_is_storage_full_a_full_disk_is_not() -> None:
    """Growing the map helps a full map only; on ENOSPC it reserves space the disk does
    not have (the final flush grew toward 2 TiB)."""
    full_map = _wrap(lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL"), "flush aborted")
    assert isinstance(full_map, StorageFullError)
    for exc in (
        lmdb.DiskError("mdb_txn_commit: No space left on device"),
        lmdb.Error("mdb_txn_commit: No space left on device"),
    ):
        err = _wrap(exc, "flush aborted")
        assert isinstance(err, DiskFullError) and not isinstance(err, StorageFullError)
    eio = _wrap(lmdb.Error("mdb_txn_commit: Input/output error"), "flush aborted")
    assert type(eio) is StorageError and eio.status == Status.ETMPFAIL


def test_a_full_disk_during_a_flush_keeps_the_items_queued(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"1")

    def enospc(_batch: object) -> None:
        raise lmdb.DiskError("mdb_txn_commit: No space left on device")

    bucket.storage.before_commit = enospc
    with pytest.raises(DiskFullError):
        bucket.flusher.flush_all()
    assert bucket.vbucket(0).persisted_seqno == 0 and bucket.flusher.has_pending()
    bucket.storage.before_commit = None
    assert bucket.flusher.flush_all() == 1
