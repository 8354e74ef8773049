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
