"""A history window keeps superseded versions on disk; a backfill for a client that did
not ask for change streams must still give each key once: its newest version at or below
the disk snapshot's end, exactly what the same writes give without history."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dcp.producer.engine import Bucket
from dcp.producer.engine.backfill import BackfillScan
from dcp.protocol.frames import FrameReader

from .conftest import FakeClock, UuidSource, small_config

END = 2**64 - 1


def frames_of(
    scan: BackfillScan, upto: int = END, chunk: int = 3
) -> list[tuple[int, bytes, bytes]]:
    """(seqno, key, value) of every record the ready-frame path returns, read in small
    chunks so that skipped records fall on chunk edges too."""
    out: list[tuple[int, bytes, bytes]] = []
    while not scan.done:
        for seg in scan.read_frames(chunk, upto, 0x55).segments:
            if isinstance(seg, list):
                out += [(it.seqno, it.key, it.value) for it in seg]
                continue
            reader = FrameReader()
            reader.feed(bytes(seg.wire[: seg.end]))
            for f in reader.read_frames():
                out.append((int.from_bytes(f.extras[:8], "big"), f.key, f.value))
    return out


def items_of(scan: BackfillScan) -> list[tuple[int, bytes, bytes]]:
    out: list[tuple[int, bytes, bytes]] = []
    while items := scan.read(2):
        out += [(it.seqno, it.key, it.value) for it in items]
    return out


def write(b: Bucket, ops: list[tuple[bytes, bytes | None]]) -> None:
    """Each op in its own checkpoint and flush, so no deduplication happens in memory:
    the disk gets every version (with history) or only the newest (without)."""
    for key, value in ops:
        if value is None:
            b.delete(0, key)
        else:
            b.set(0, key, value)
        b.vbucket(0).checkpoints.create_checkpoint()
        b.flusher.flush_all()


OPS: list[tuple[bytes, bytes | None]] = [
    (b"a", b"a1"),  # 1
    (b"b", b"b1"),  # 2
    (b"a", b"a2"),  # 3
    (b"c", b"c1"),  # 4
    (b"b", None),  # 5: a tombstone supersedes b1
    (b"a", b"a3"),  # 6
    (b"d", b"d1"),  # 7
    (b"c", b"c2"),  # 8
]


@pytest.mark.parametrize("start", [0, 2, 3, 5, 7])
@pytest.mark.parametrize("read", [frames_of, items_of], ids=["frames", "items"])
def test_plain_scan_with_history_equals_the_scan_without_history(
    open_bucket: Callable[..., Bucket],
    tmp_path_factory: pytest.TempPathFactory,
    clock: FakeClock,
    uuids: UuidSource,
    start: int,
    read: Callable[[BackfillScan], list[tuple[int, bytes, bytes]]],
) -> None:
    hist = open_bucket(history_seconds=3600.0)
    write(hist, OPS)
    with hist.storage.open_backfill(0, start) as scan:
        every = read(scan)
        assert scan.may_contain_duplicates and scan.history
    assert [s for s, _, _ in every] == list(range(start + 1, 9))
    with hist.storage.open_backfill(0, start, every_version=False) as scan:
        plain = read(scan)
        assert not scan.may_contain_duplicates and not scan.history
    newest = {k: (s, k, v) for s, k, v in every}
    assert plain == sorted(newest.values())
    keys = [k for _, k, _ in plain]
    assert len(keys) == len(set(keys))

    plain_bucket = Bucket.open(
        tmp_path_factory.mktemp("nohist") / "data", small_config(), clock=clock, uuid_source=uuids
    )
    try:
        write(plain_bucket, OPS)
        with plain_bucket.storage.open_backfill(0, start) as scan:
            assert [(s, k) for s, k, _ in read(scan)] == [(s, k) for s, k, _ in plain]
    finally:
        plain_bucket.close(clean=True)


def test_newest_at_or_below_the_snapshot_end_not_a_later_write(
    open_bucket: Callable[..., Bucket],
) -> None:
    """A version flushed after the scan opened is not in its snapshot: the version it
    supersedes is still the key's newest there and must be sent."""
    b = open_bucket(history_seconds=3600.0)
    write(b, OPS[:4])  # a1 b1 a2 c1
    with b.storage.open_backfill(0, 0, every_version=False) as scan:
        write(b, [(b"c", b"c-late"), (b"b", b"b-late")])
        assert scan.end_seqno == 4
        assert frames_of(scan) == [(2, b"b", b"b1"), (3, b"a", b"a2"), (4, b"c", b"c1")]


def test_a_cut_below_the_end_leaves_out_keys_whose_newest_is_past_it(
    open_bucket: Callable[..., Bucket],
) -> None:
    """As without history: the disk snapshot is (start, end]; a stream ending inside it
    gets the records up to its end that are the newest of their key in the snapshot."""
    b = open_bucket(history_seconds=3600.0)
    write(b, OPS)
    with b.storage.open_backfill(0, 0, every_version=False) as scan:
        assert frames_of(scan, upto=6) == [(5, b"b", b""), (6, b"a", b"a3")]
    with b.storage.open_backfill(0, 0, every_version=False) as scan:
        chunk = scan.read_frames(100, 5, 0)  # b's tombstone (5) is its newest
        assert (chunk.first, chunk.last, chunk.count) == (5, 5, 1) and scan.done


def test_every_version_superseded_but_the_last(open_bucket: Callable[..., Bucket]) -> None:
    b = open_bucket(history_seconds=3600.0)
    write(b, [(b"k", b"%d" % i) for i in range(10)])
    with b.storage.open_backfill(0, 0, every_version=False) as scan:
        assert frames_of(scan, chunk=1) == [(10, b"k", b"9")]
    with b.storage.open_backfill(0, 0, every_version=False) as scan:
        chunk = scan.read_frames(100, 9, 0)  # only superseded versions up to 9
        assert chunk.count == 0 and scan.done
    assert b.storage.open_scans == 0


def test_the_superseded_bound_covers_versions_superseded_inside_one_flush(
    open_bucket: Callable[..., Bucket],
) -> None:
    """Two versions of a key in one flush batch (two checkpoints, one flush): the first
    is superseded on disk at once, and the storage's bound must say so, or a plain scan
    would skip its search and send the key twice."""
    b = open_bucket(history_seconds=3600.0)
    b.set(0, b"new", b"n1")  # 1: never superseded
    b.vbucket(0).checkpoints.create_checkpoint()
    b.flusher.flush_all()
    assert b.storage.superseded_high[0] == 0
    b.set(0, b"k", b"1")  # 2
    b.vbucket(0).checkpoints.create_checkpoint()
    b.set(0, b"k", b"2")  # 3
    b.vbucket(0).checkpoints.create_checkpoint()
    b.flusher.flush_all()
    with b.storage.open_backfill(0, 0) as scan:
        assert len(frames_of(scan)) == 3  # both versions are on disk
    assert b.storage.superseded_high[0] == 2
    with b.storage.open_backfill(0, 0, every_version=False) as scan:
        assert frames_of(scan) == [(1, b"new", b"n1"), (3, b"k", b"2")]


def test_the_superseded_bound_is_rebuilt_at_warm_up(open_bucket: Callable[..., Bucket]) -> None:
    b = open_bucket(history_seconds=3600.0)
    write(b, OPS)
    high = b.storage.superseded_high[0]
    assert high == 4  # superseded: a1 (1), b1 (2), a2 (3), c1 (4, by c2 at 8)
    b.close(clean=True)
    b2 = open_bucket(history_seconds=3600.0)
    assert b2.storage.superseded_high[0] == high
    with b2.storage.open_backfill(0, 0, every_version=False) as scan:
        keys = [k for _, k, _ in frames_of(scan)]
    assert sorted(keys) == [b"a", b"b", b"c", b"d"]


def test_a_scan_starting_past_every_overwrite_reads_as_is(
    open_bucket: Callable[..., Bucket],
) -> None:
    """The bound lets a resume past the last overwrite skip the search; what it reads is
    still each key once (there is nothing superseded above the bound)."""
    b = open_bucket(history_seconds=3600.0)
    write(b, [*OPS, (b"e", b"e1"), (b"f", b"f1")])  # 9, 10: new keys
    assert b.storage.superseded_high[0] < 8
    with b.storage.open_backfill(0, 8, every_version=False) as scan:
        assert frames_of(scan) == [(9, b"e", b"e1"), (10, b"f", b"f1")]
