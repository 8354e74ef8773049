"""RangeRead's decisions without a server: what a merged snapshot read whole reports."""

from __future__ import annotations

import logging

import pytest

from dcp.protocol.opcodes import SnapshotMarkerFlag
from dcp.spark.batch_plan import VbRange
from dcp.spark.changes import Chunk, mutation_row
from dcp.spark.columns import from_rows
from dcp.spark.errors import MergedSnapshotError
from dcp.spark.ranges import RangeRead

DISK = int(SnapshotMarkerFlag.DISK)


def _receive(rr: RangeRead, seqnos: range, rev: int) -> None:
    """Items as the executor adds them (a record batch per run), then its decision call."""
    for s in seqnos:
        row = mutation_row(7, s, rev, s << 16, 0, 0, 0, 0, b"k%d" % s, b"v")
        rr.rows.add(from_rows([row]))
        if s >= rr.stop:
            rr.item_done(s)


def _merged_disk_snapshot(policy: str) -> tuple[RangeRead, Chunk]:
    """The range (10, 20] planned; since then the disk merged it into the snapshot
    [14, 30] (11..13 replaced by later revisions, which sit past the planned end)."""
    out = Chunk()
    rr = RangeRead(VbRange(7, 0xABC, 10, 20), out, policy)
    rr.marker(14, 30, DISK)
    _receive(rr, range(14, 21), rev=1)
    _receive(rr, range(21, 31), rev=2)
    return rr, out


def test_reread_tags_the_merged_snapshot_from_the_range_start_and_says_so(caplog) -> None:
    """The rows of a change set are tagged [range start + 1, end] (docs/spark.md,
    Reading); handed out whole, a merged snapshot keeps that start, and the warning
    names the tags the rows carry, not only the server's snapshot start."""
    caplog.set_level(logging.WARNING, logger="dcp.spark")
    rr, out = _merged_disk_snapshot("reread")
    assert rr.done
    ((vb, start, end, n, _uuid, _gen),) = out.segments
    assert (vb, start, end, n) == (7, 11, 30, 17)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "server's snapshot [14, 30]" in msg
    assert "snapshot_start=11, snapshot_end=30" in msg


def test_fail_names_the_server_snapshot() -> None:
    with pytest.raises(MergedSnapshotError) as info:
        _merged_disk_snapshot("fail")
    err = info.value
    assert (err.start, err.end, err.snapshot_start, err.snapshot_end) == (10, 20, 14, 30)


def test_a_snapshot_above_the_buffer_bound_is_handed_out_in_parts(monkeypatch) -> None:
    """A snapshot bigger than ``BUFFER_BYTES`` is accepted and handed out before its end
    (``partial``: a retry cannot repeat it any more), the rest follows as another part, and
    the rows are all there once, in order."""
    import dcp.spark.ranges as ranges

    monkeypatch.setattr(ranges, "BUFFER_BYTES", 2000)
    out = Chunk()
    rr = RangeRead(VbRange(7, 0xABC, 0, 40), out)
    rr.marker(1, 40, DISK)
    for s in range(1, 41):
        row = mutation_row(7, s, 1, s << 16, 0, 0, 0, 0, b"k%d" % s, b"v")
        rr.rows.add(from_rows([row]), 100)  # 100 wire bytes a row: the bound is 20 rows
        rr.count_pending()
        if s >= rr.stop:
            rr.item_done(s)
    assert rr.done and rr.partial
    assert len(out.segments) >= 2
    assert out.seqno == list(range(1, 41))
    starts = [seg[1] for seg in out.segments]
    ends = [seg[2] for seg in out.segments]
    assert starts[0] == 1 and ends[-1] == 40 and starts[1:] == [e + 1 for e in ends[:-1]]
