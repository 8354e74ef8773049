"""Rows as Arrow columns: the vectorized frame decoder against the per-row rules, the
change-set rule in Arrow, and the conversion to the source's schema.

Frames are built as bytes with the wire layouts (dcp/protocol/layout.py), so a field read
from a wrong offset, a byte-order slip or a null in the wrong place fails here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("numpy")

from hypothesis import given, settings
from hypothesis import strategies as st

from dcp.protocol.layout import (
    HDR_DELETION_V1,
    HDR_DELETION_V2,
    HDR_EXPIRATION,
    HDR_MUTATION,
)
from dcp.spark.arrow import POSITION_SHIFT, to_record_batch
from dcp.spark.changes import (
    OP_DELETION,
    OP_EXPIRATION,
    OP_MUTATION,
    Chunk,
    Rows,
)
from dcp.spark.columns import from_frames, from_rows, from_runs

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
item = st.tuples(
    st.sampled_from(["mut", "del1", "del2", "exp"]),
    st.binary(min_size=1, max_size=40),  # key (any bytes: not always UTF-8)
    st.binary(max_size=300),  # value: inline (<= 12 bytes) and far views
    U64,  # cas
    U64,  # rev_seqno
    U32,  # flags
    U32,  # expiry
    st.integers(0, 7),  # datatype
)


def _frame(
    kind: str, key: bytes, value: bytes, by: int, rev: int, cas: int, flags: int, exp: int, dt: int
) -> tuple[bytes, tuple]:
    """One item frame and the row the per-row rules (changes.py) give for it."""
    kl = len(key)
    if kind == "mut":
        head = HDR_MUTATION.pack(
            0x80, 0x57, kl, 31, dt, 3, 31 + kl + len(value), 9, cas, by, rev, flags, exp, 0, 0, 0
        )
        return head + key + value, (by, OP_MUTATION, key, value, cas, rev, flags, exp, dt)
    if kind == "del1":
        head = HDR_DELETION_V1.pack(
            0x80, 0x58, kl, 18, dt, 3, 18 + kl + len(value), 9, cas, by, rev, 0
        )
        return head + key + value, (by, OP_DELETION, key, value or None, cas, rev, None, None, dt)
    if kind == "del2":
        head = HDR_DELETION_V2.pack(
            0x80, 0x58, kl, 21, dt, 3, 21 + kl + len(value), 9, cas, by, rev, 5, 0
        )
        return head + key + value, (by, OP_DELETION, key, value or None, cas, rev, None, None, dt)
    # an expiration's datatype byte is not a row value: the rules give 0 whatever it says
    head = HDR_EXPIRATION.pack(0x80, 0x59, kl, 20, dt, 3, 20 + kl, 9, cas, by, rev, 5)
    return head + key, (by, OP_EXPIRATION, key, None, cas, rev, None, None, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(item, min_size=1, max_size=40), st.binary(max_size=30), st.binary(max_size=30))
def test_frames_decode_to_the_rows_of_the_per_row_rules(items, before, after) -> None:
    """Any mix of mutations, deletions (both layouts) and expirations, anywhere in a
    buffer with other bytes around it, decodes to exactly the per-row tuples."""
    parts, starts, want = [before], [], []
    pos = len(before)
    for seqno, (kind, key, value, cas, rev, flags, exp, dt) in enumerate(items, 1):
        frame, row = _frame(kind, key, value, seqno, rev, cas, flags, exp, dt)
        starts.append(pos)
        parts.append(frame)
        want.append(row)
        pos += len(frame)
    parts.append(after)
    batch = from_frames(b"".join(parts), starts)
    got = list(zip(*(c.to_pylist() for c in batch.columns), strict=True))
    assert got == want
    assert from_rows(want).equals(batch)


def _rows(*specs: tuple[int, bytes, bytes]) -> Rows:
    rows = Rows()
    for seqno, key, value in specs:
        rows.add(from_rows([(seqno, OP_MUTATION, key, value, seqno, 1, 0, 0, 0)]))
    return rows


def test_change_sets_keep_the_last_version_of_each_key_per_segment_in_order() -> None:
    """The rule applies per change set: a key repeated inside one keeps its newest row,
    the same key in two change sets (two ranges of one vbucket) keeps one row in each."""
    chunk = Chunk()
    chunk.add(
        1,
        1,
        5,
        _rows((1, b"a", b"1"), (2, b"b", b"2"), (3, b"a", b"3"), (4, b"c", b"4"), (5, b"b", b"5")),
    )
    chunk.add(1, 6, 7, _rows((6, b"a", b"6"), (7, b"a", b"7")))
    chunk.add_rollback(2, 0)
    chunk.add_rollback(3, 0)
    assert chunk.seqno == [3, 4, 5, 7, 0, 0]
    assert chunk.value == [b"3", b"4", b"5", b"7", None, None]
    assert [seg[:4] for seg in chunk.segments] == [
        (1, 1, 5, 3),
        (1, 6, 7, 1),
        (2, 0, 0, 1),
        (3, 0, 0, 1),
    ]
    unique = Chunk()
    unique.add(9, 1, 2, _rows((1, b"a", b"1"), (2, b"b", b"2")))
    assert unique.seqno == [1, 2] and unique.segments == [(9, 1, 2, 2, 0, 0)]


def test_rows_split_drop_and_last_seqno() -> None:
    rows = _rows((1, b"a", b""), (2, b"b", b""), (3, b"c", b""), (4, b"d", b""))
    tail = rows.split_after(2)
    assert rows.column(0) == [1, 2] and tail.column(0) == [3, 4]
    assert (len(rows), len(tail), rows.last_seqno(), tail.last_seqno()) == (2, 2, 2, 4)
    tail.drop_last()
    assert tail.column(0) == [3] and len(tail) == 1
    rows.extend(tail)
    assert rows.column(0) == [1, 2, 3]


def test_record_batch_carries_segments_rollbacks_positions_and_raw_bits() -> None:
    """The source's schema from a chunk: per-row vbucket/snapshot/uuid from the segments,
    cas and seqnos above 2**63 bit for bit as longs, a non-UTF-8 key with replacement
    characters, a rollback row with nulls and its generation in ``position``."""
    chunk = Chunk()
    big = 2**63 + 5
    rows = Rows()
    rows.add(
        from_rows(
            [
                (1, OP_MUTATION, b"k1", b"v", big, 1, 7, 0, 1),
                (2, OP_DELETION, b"\xffk", None, 1_700_000_000_123_456_789, 2, None, None, 0),
            ]
        )
    )
    chunk.add(4, 1, 2, rows, uuid=2**64 - 1)
    chunk.add_rollback(4, 1, uuid=77, gen=2)
    rb = to_record_batch(chunk)
    rows = rb.to_pylist()
    assert [r["vbucket"] for r in rows] == [4, 4, 4]
    assert [r["op"] for r in rows] == ["mutation", "deletion", "rollback"]
    assert rows[0]["cas"] == big - 2**64 and rows[0]["vb_uuid"] == -1
    assert rows[1]["key"] == "\ufffdk" and rows[1]["value"] is None
    assert rows[1]["timestamp"].timestamp() == pytest.approx(1_700_000_000.123456)
    assert (rows[0]["snapshot_start"], rows[0]["snapshot_end"], rows[0]["flags"]) == (1, 2, 7)
    assert rows[1]["flags"] is None and rows[1]["expiry"] is None
    rb_row = rows[2]
    assert rb_row["key"] is None and rb_row["cas"] is None and rb_row["timestamp"] is None
    assert rb_row["position"] == (2 << POSITION_SHIFT) + 1 and rb_row["vb_uuid"] == 77
    assert [r["position"] for r in rows[:2]] == [1, 2]


def test_distinct_check_never_calls_repeated_keys_distinct() -> None:
    """The quick check may only say "distinct" when no key repeats: short keys followed by
    other bytes, keys equal in their first and last 8 bytes, empty keys, slices."""
    import pyarrow as pa

    from dcp.spark.changes import _all_distinct

    assert _all_distinct(pa.array([b"a", b"ab", b"abc", b"", b"b"]))
    assert not _all_distinct(pa.array([b"a", b"ab", b"a"]))
    assert not _all_distinct(pa.array([b"", b"x", b""]))
    long_a, long_b = b"12345678-middle-A-87654321", b"12345678-middle-B-87654321"
    rows = _rows((1, long_a, b"1"), (2, long_b, b"2"), (3, long_a, b"3"))
    chunk = Chunk()
    chunk.add(5, 1, 3, rows)
    assert chunk.key == [long_b, long_a] and chunk.seqno == [2, 3]
    sliced = pa.array([b"k1", b"k2", b"k3", b"k2"]).slice(1)
    assert not _all_distinct(sliced)
    assert _all_distinct(sliced.slice(1))


class _Run:
    """What ``from_runs`` reads of an ``ItemFrames`` event."""

    def __init__(self, buf: bytes, starts: list[int], nbytes: int) -> None:
        self.buf, self.starts, self.nbytes = buf, starts, nbytes


def test_runs_of_one_chunk_decode_together_and_a_small_run_does_not_pin_the_chunk() -> None:
    """Every run of a chunk gets exactly its rows; a run much smaller than its chunk gets a
    copy of its own, so keeping it does not keep the other runs' bytes alive."""
    frames, runs, pos = [], [], 0
    for first, count, size in ((1, 200, 2000), (1, 1, 10), (201, 50, 2000)):
        starts = []
        for seqno in range(first, first + count):
            frame, _row = _frame("mut", b"k%d" % seqno, b"v" * size, seqno, 1, 0, 0, 0, 0)
            starts.append(pos)
            frames.append(frame)
            pos += len(frame)
        runs.append(_Run(b"", starts, sum(len(frames[-1]) for _ in starts)))
    buf = b"".join(frames)
    for r in runs:
        r.buf = buf
    big, small, other = from_runs(runs)
    assert big.column(0).to_pylist() == list(range(1, 201))
    assert small.column(0).to_pylist() == [1] and small.column(3).to_pylist() == [b"v" * 10]
    assert other.column(0).to_pylist() == list(range(201, 251))
    assert small.get_total_buffer_size() < 4096  # not the chunk's ~500 KB
    assert big.get_total_buffer_size() >= len(buf) // 2  # a slice: no copy for a big run
