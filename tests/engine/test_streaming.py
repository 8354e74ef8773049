"""A stream's view: memory cursor, cursor dropping, backfill + memory hand-over, no gap."""

from __future__ import annotations

import random

from dcp.producer.engine import Bucket, ItemOp


def state_after(items) -> dict[bytes, bytes | None]:
    out: dict[bytes, bytes | None] = {}
    for it in items:
        out[it.key] = it.value if it.op == ItemOp.MUTATION else None
    return out


def live(bucket: Bucket, vb: int) -> dict[bytes, bytes | None]:
    """The bucket's view of vb: key -> value, None for tombstones."""
    v = bucket.vbucket(vb)
    out: dict[bytes, bytes | None] = {}
    for key, e in v._index.items():
        out[key] = None if e[6] else bucket.get(vb, key).value
    return out


def stream(bucket: Bucket, vb: int, name: str, start: int, received: list, chunk: int = 50):
    """Follow the CursorRegistration contract like the server: backfill, then skip <= P."""
    mgr = bucket.vbucket(vb).checkpoints
    reg = mgr.register_cursor(name, start)
    skip = start
    if reg.backfill:
        with bucket.storage.open_backfill(vb, start) as scan:
            assert scan.end_seqno >= mgr.memory_start_seqno - 1  # the guarantee
            while items := scan.read(chunk):
                received.extend(items)
            skip = scan.end_seqno
    return reg.cursor, skip


def drain(mgr, cursor, skip: int, received: list) -> None:
    for snap in mgr.take(cursor, 1 << 30):
        received.extend(it for it in snap.items if it.seqno > skip)


def test_stream_from_zero_after_memory_was_freed_gets_every_key(open_bucket) -> None:
    b = open_bucket(checkpoint_max_items=10)
    rng = random.Random(1)
    for i in range(300):
        k = b"k%d" % rng.randrange(60)
        if i % 7 == 0 and b.vbucket(0).key_meta(k) and not b.vbucket(0).key_meta(k)[6]:
            b.delete(0, k)
        else:
            b.set(0, k, b"v%d" % i)
        if i % 45 == 0:
            b.flusher.flush_all()
    received: list = []
    cursor, skip = stream(b, 0, "s", 0, received)
    drain(b.vbucket(0).checkpoints, cursor, skip, received)
    assert state_after(received) == live(b, 0)
    seqnos = [it.seqno for it in received]
    assert seqnos == sorted(seqnos) and len(set(seqnos)) == len(seqnos)


def test_slow_cursor_is_dropped_over_quota_and_resumes_from_disk_without_gap(open_bucket) -> None:
    b = open_bucket(checkpoint_max_items=20, checkpoint_memory_quota=40_000)
    woken: list[int] = []
    b.add_listener(woken.append)
    received: list = []
    cursor, skip = stream(b, 1, "slow", 0, received)
    fast, _ = stream(b, 1, "fast", 0, [])
    mgr = b.vbucket(1).checkpoints
    n = 0
    for round_ in range(20):
        for i in range(30):
            b.set(1, b"k%d" % ((round_ * 30 + i) % 97), b"x" * 100)
            n += 1
        b.flusher.flush_all()
        mgr.take(fast, 1 << 30)
        if round_ == 2:
            drain(mgr, cursor, skip, received)  # the slow one reads once, then stalls
    assert cursor.dropped
    assert b.cursors_dropped >= 1
    assert b.checkpoint_memory() <= 40_000 + 20 * 400
    assert not fast.dropped
    assert b.vbucket(1).checkpoints.persistence_cursor.dropped is False
    assert mgr.take(cursor, 10) == []
    # the stream re-registers from what it has and backfills the rest
    last = received[-1].seqno
    cursor2, skip2 = stream(b, 1, "slow", last, received)
    drain(mgr, cursor2, skip2, received)
    assert state_after(received) == live(b, 1)


def test_dropping_is_never_done_to_the_persistence_cursor(open_bucket) -> None:
    b = open_bucket(checkpoint_max_items=5, checkpoint_memory_quota=2_000)
    for i in range(100):
        b.set(2, b"k%d" % i, b"x" * 50)  # nothing flushed: memory stays pinned
    assert b.checkpoint_memory() > 2_000
    assert b.vbucket(2).checkpoints.persistence_cursor.dropped is False
    b.flusher.flush_all()
    assert b.checkpoint_memory() <= 2_000


def test_quota_can_be_lowered_at_runtime(open_bucket) -> None:
    b = open_bucket(checkpoint_max_items=5)
    cur = b.vbucket(0).checkpoints.register_cursor("s", 0).cursor
    for i in range(50):
        b.set(0, b"k%d" % i, b"x" * 50)
    b.flusher.flush_all()
    b.checkpoint_memory_quota = 1000
    assert cur.dropped and b.checkpoint_memory() <= 1000


def test_persisted_open_checkpoints_are_closed_and_freed_under_pressure(open_bucket) -> None:
    b = open_bucket(checkpoint_memory_quota=20_000)
    for i in range(200):
        b.set(i % 4, b"k%d" % i, b"x" * 100)  # stays in the open checkpoints
    assert b.checkpoint_memory() > 20_000
    b.flusher.flush_all()
    assert b.checkpoint_memory() <= 20_000
    assert b.get(0, b"k0").value == b"x" * 100  # now read from disk


def test_with_retention_pressure_frees_what_it_closes_before_dropping_any_cursor(
    open_bucket, clock
) -> None:
    """Retained checkpoints are the first thing memory pressure takes, including the
    persisted open checkpoints it closes itself; a slow stream keeps its cursor when that
    is enough."""
    b = open_bucket(checkpoint_retain_seconds=3600.0, checkpoint_max_items=100_000)
    slow = b.vbucket(1).checkpoints.register_cursor("slow", 0).cursor
    for i in range(40):
        b.set(1, b"s%d" % i, b"x" * 100)  # pinned by the slow cursor (4-5 kB)
    for i in range(400):
        b.set(0, b"k%d" % i, b"x" * 100)  # persisted below, then only retention keeps it
    b.flusher.flush_all()
    pinned = b.vbucket(1).checkpoints.mem_usage
    assert b.checkpoint_memory() > 4 * pinned
    b.checkpoint_memory_quota = 2 * pinned
    assert not slow.dropped and b.cursors_dropped == 0
    assert b.checkpoint_memory() <= 2 * pinned
    assert b.vbucket(0).checkpoints.mem_usage == 0  # closed by pressure, not retained
    clock.advance(1)
    assert b.release_retained() == 0
