"""Checkpoint manager and cursors: dedup, whole snapshots, placement, freeing, memory."""

from __future__ import annotations

from dcp.producer.engine import (
    CheckpointManager,
    CheckpointMemory,
    Item,
    ItemOp,
    Snapshot,
)
from dcp.producer.engine.checkpoint_list import COMPACT_MIN_SLOTS, DEAD_SLOT_BYTES
from dcp.producer.engine.item import item_size
from dcp.protocol.opcodes import SnapshotMarkerFlag

MEM = SnapshotMarkerFlag.MEMORY
CKPT = SnapshotMarkerFlag.CHECKPOINT


class Seq:
    """Feeds a manager items with increasing seqnos, like a vbucket does."""

    def __init__(self, mgr: CheckpointManager, start: int = 1) -> None:
        self.mgr = mgr
        self.next = start

    def put(self, *keys: bytes, value: bytes = b"v") -> list[int]:
        out = []
        for k in keys:
            s = self.next
            self.next += 1
            self.mgr.queue(Item.mutation(0, s, 1, s, 0, 0, 0, k, value))
            out.append(s)
        return out


def manager(
    max_items: int = 100, max_bytes: int = 1 << 30, quota: int = 1 << 30, start_seqno: int = 1
) -> tuple[CheckpointManager, CheckpointMemory]:
    mem = CheckpointMemory(quota)
    return CheckpointManager(
        0, mem, start_seqno=start_seqno, max_items=max_items, max_bytes=max_bytes
    ), mem


def flat(snaps: list[Snapshot]) -> list[tuple[int, bytes]]:
    return [(it.seqno, it.key) for s in snaps for it in s.items]


def test_seed_dedup_example_gives_one_snapshot_2_to_3() -> None:
    """set A, set B, set A -> a cursor from 0 sees one snapshot 2..3 with B@2, A@3."""
    mgr, _ = manager()
    Seq(mgr).put(b"A", b"B", b"A")
    snaps = mgr.take(mgr.register_cursor("s", 0).cursor, 100)
    assert len(snaps) == 1
    assert (snaps[0].start, snaps[0].end) == (2, 3)
    assert flat(snaps) == [(2, b"B"), (3, b"A")]
    assert snaps[0].flags == MEM | CKPT


def test_cursor_registered_before_writes_sees_the_same_dedup() -> None:
    mgr, _ = manager()
    cur = mgr.register_cursor("s", 0).cursor
    Seq(mgr).put(b"A", b"B", b"A")
    snaps = mgr.take(cur, 100)
    assert [(s.start, s.end) for s in snaps] == [(2, 3)]


def test_dedup_happens_only_in_the_open_checkpoint() -> None:
    mgr, _ = manager()
    seq = Seq(mgr)
    seq.put(b"A", b"B")
    mgr.create_checkpoint()
    seq.put(b"A")
    snaps = mgr.take(mgr.register_cursor("s", 0).cursor, 100)
    assert [(s.start, s.end) for s in snaps] == [(1, 2), (3, 3)]
    assert flat(snaps) == [(1, b"A"), (2, b"B"), (3, b"A")]
    assert snaps[1].flags == MEM | CKPT


def test_take_copies_items_so_later_dedup_cannot_change_them() -> None:
    mgr, _ = manager()
    seq = Seq(mgr)
    cur = mgr.register_cursor("s", 0).cursor
    seq.put(b"A", b"B")
    first = mgr.take(cur, 100)
    seq.put(b"A")  # supersedes A@1 in the open checkpoint
    assert flat(first) == [(1, b"A"), (2, b"B")]
    second = mgr.take(cur, 100)
    assert [(s.start, s.end, s.flags) for s in second] == [(3, 3, MEM)]


def test_take_is_a_soft_limit_and_never_splits_a_snapshot() -> None:
    mgr, _ = manager(max_items=5)
    Seq(mgr).put(*[b"k%d" % i for i in range(12)])  # checkpoints of 5, 5, 2
    cur = mgr.register_cursor("s", 0).cursor
    first = mgr.take(cur, 3)
    assert [(s.start, s.end) for s in first] == [(1, 5)]
    rest = mgr.take(cur, 6)
    assert [(s.start, s.end) for s in rest] == [(6, 10), (11, 12)]
    assert mgr.take(cur, 100) == []


def test_snapshot_ends_at_open_checkpoint_current_last_item() -> None:
    mgr, _ = manager()
    seq = Seq(mgr)
    cur = mgr.register_cursor("s", 0).cursor
    seq.put(b"a", b"b")
    assert [(s.start, s.end) for s in mgr.take(cur, 1)] == [(1, 2)]
    seq.put(b"c")
    assert [(s.start, s.end) for s in mgr.take(cur, 1)] == [(3, 3)]
    assert cur.last_seqno == 3


def test_checkpoint_closes_at_item_count_and_at_byte_size() -> None:
    mgr, _ = manager(max_items=3)
    Seq(mgr).put(b"a", b"b", b"c", b"d")
    assert [len(c.items) for c in mgr.checkpoints] == [3, 1]
    mgr2, _ = manager(max_bytes=1000)
    Seq(mgr2).put(b"a", b"b", value=b"x" * 600)
    assert len(mgr2.checkpoints) == 3  # each 600-byte item fills a checkpoint


def test_register_cursor_mid_memory_starts_after_start_seqno() -> None:
    mgr, _ = manager(max_items=4)
    Seq(mgr).put(*[b"k%d" % i for i in range(10)])
    reg = mgr.register_cursor("s", 6)
    assert not reg.backfill
    snaps = mgr.take(reg.cursor, 100)
    assert [it.seqno for s in snaps for it in s.items] == [7, 8, 9, 10]
    assert snaps[0].flags == MEM  # begins mid-checkpoint


def test_register_cursor_at_high_seqno_gets_nothing_until_new_items() -> None:
    mgr, _ = manager()
    seq = Seq(mgr)
    seq.put(b"a", b"b")
    cur = mgr.register_cursor("s", 2).cursor
    assert mgr.take(cur, 10) == []
    seq.put(b"c")
    assert flat(mgr.take(cur, 10)) == [(3, b"c")]


def test_closed_checkpoints_without_cursors_are_freed_and_memory_accounted() -> None:
    mgr, mem = manager(max_items=2)
    seq = Seq(mgr)
    seq.put(b"a", b"b", b"c", b"d", b"e")
    assert len(mgr.checkpoints) == 3  # persistence cursor pins all
    total = mem.used
    assert total == sum(c.mem for c in mgr.checkpoints) > 0
    p = mgr.persistence_cursor
    mgr.take(p, 100)
    assert len(mgr.checkpoints) == 1
    assert mem.used == mgr.checkpoints[0].mem


def test_dedup_frees_the_superseded_item_memory() -> None:
    mgr, mem = manager()
    seq = Seq(mgr)
    seq.put(b"a", value=b"x" * 100)
    one = mem.used
    seq.put(b"a", value=b"x" * 100)
    # only the superseded slot (until compaction removes it) is still charged
    assert mem.used == one + DEAD_SLOT_BYTES
    assert mgr.checkpoints[0].num_items == 1


def test_open_checkpoint_compacts_superseded_slots_and_keeps_cursors_in_place() -> None:
    """10 keys rewritten 5000 times: slots stay bounded, every cursor still reads exactly
    what it has not read yet (no gap, no repeat), whatever compaction removed under it."""
    mgr, mem = manager(max_items=1_000_000)
    seq = Seq(mgr)
    keys = [b"k%d" % i for i in range(10)]
    mid = mgr.register_cursor("mid", 0).cursor
    seen: dict[bytes, int] = {}
    last = 0
    for round_ in range(5000):
        seq.put(*keys, value=b"v%d" % round_)
        if round_ % 37 == 0:  # the reader keeps up now and then, compaction in between
            for s in mgr.take(mid, 1 << 30):
                for it in s.items:
                    assert it.seqno > last  # never a repeat or a step back
                    last = it.seqno
                    seen[it.key] = it.seqno
    ckpt = mgr.checkpoints[-1]
    assert len(ckpt.items) <= 2 * len(keys) + COMPACT_MIN_SLOTS + 1
    assert ckpt.gen > 0  # compaction did happen
    for s in mgr.take(mid, 1 << 30):
        for it in s.items:
            assert it.seqno > last
            last = it.seqno
            seen[it.key] = it.seqno
    # the reader ends at the newest version of every key
    assert last == seq.next - 1
    newest = {it.key: it.seqno for it in ckpt.items if it is not None}
    assert {k: seen[k] for k in keys} == newest
    # memory: live items plus the (bounded) superseded slots, nothing else
    dead = len(ckpt.items) - len(ckpt.index)
    assert mem.used == ckpt.mem
    assert dead * DEAD_SLOT_BYTES < mem.used


def test_peek_mark_survives_compaction_of_its_checkpoint() -> None:
    mgr, _ = manager(max_items=1_000_000)
    seq = Seq(mgr)
    seq.put(*[b"k%d" % i for i in range(5)])
    p = mgr.persistence_cursor
    snaps, mark = mgr.peek(p, 100)
    assert flat(snaps)[-1] == (5, b"k4")
    # rewrite k0..k3 until compaction removes slots the mark counted
    gen = mgr.checkpoints[-1].gen
    while mgr.checkpoints[-1].gen == gen:
        seq.put(b"k0", b"k1", b"k2", b"k3")
    mgr.advance_to(p, mark)
    assert p.last_seqno == 5
    rest = flat(mgr.take(p, 1 << 30))
    # next: exactly the items written after seqno 5, newest version per key
    assert rest and rest[0][0] > 5
    assert sorted(k for _, k in rest) == [b"k0", b"k1", b"k2", b"k3"]


def test_closed_checkpoint_holds_no_superseded_slots() -> None:
    mgr, mem = manager(max_items=10)
    seq = Seq(mgr)
    reader = mgr.register_cursor("r", 0).cursor
    seq.put(b"a", b"b")
    assert flat(mgr.take(reader, 100)) == [(1, b"a"), (2, b"b")]  # sits inside checkpoint 1
    seq.put(b"a", b"b", b"a")
    mgr.create_checkpoint()
    closed = mgr.checkpoints[0]
    assert closed.closed and None not in closed.items
    assert [it.seqno for it in closed.items] == [4, 5]
    assert mem.used == sum(c.mem for c in mgr.checkpoints)
    seq.put(b"c")
    assert flat(mgr.take(reader, 100)) == [(4, b"b"), (5, b"a"), (6, b"c")]


def test_memory_no_longer_covering_start_means_backfill_from_memory_start() -> None:
    mgr, _ = manager(max_items=2)
    seq = Seq(mgr)
    seq.put(b"a", b"b", b"c", b"d", b"e")
    mgr.take(mgr.persistence_cursor, 100)  # frees checkpoints 1..4
    assert mgr.memory_start_seqno == 5
    reg = mgr.register_cursor("s", 1)
    assert reg.backfill
    assert [it.seqno for s in mgr.take(reg.cursor, 100) for it in s.items] == [5]
    assert not mgr.register_cursor("t", 4).backfill


def test_remove_cursor_unpins_checkpoints() -> None:
    mgr, _ = manager(max_items=2)
    seq = Seq(mgr)
    cur = mgr.register_cursor("s", 0).cursor
    seq.put(b"a", b"b", b"c")
    mgr.take(mgr.persistence_cursor, 100)
    assert len(mgr.checkpoints) == 2  # the stream cursor pins checkpoint 1
    assert mgr.remove_cursor(cur)
    assert len(mgr.checkpoints) == 1
    assert not mgr.remove_cursor("nobody")


def test_peek_does_not_move_and_advance_to_does() -> None:
    mgr, _ = manager()
    seq = Seq(mgr)
    seq.put(b"a", b"b")
    p = mgr.persistence_cursor
    snaps, mark = mgr.peek(p, 100)
    assert flat(snaps) == [(1, b"a"), (2, b"b")]
    seq.put(b"a")  # dedup while the batch is in flight
    assert flat(mgr.peek(p, 100)[0]) == [(2, b"b"), (3, b"a")]
    mgr.advance_to(p, mark)
    assert flat(mgr.take(p, 100)) == [(3, b"a")]


def test_droppable_cursors_are_only_those_behind_persistence() -> None:
    mgr, _ = manager(max_items=2)
    seq = Seq(mgr)
    slow = mgr.register_cursor("slow", 0).cursor
    seq.put(b"a", b"b", b"c", b"d", b"e")
    assert mgr.droppable_cursors() == []  # persistence is as far behind
    mgr.take(mgr.persistence_cursor, 100)
    ((pinned, cursor),) = mgr.droppable_cursors()
    assert cursor is slow and pinned > 0
    freed = mgr.drop_cursor(slow)
    assert freed == pinned
    assert slow.dropped and mgr.take(slow, 10) == []
    assert mgr.get_cursor("slow") is None


def test_stats_report_cursors_and_checkpoints() -> None:
    mgr, _ = manager()
    Seq(mgr).put(b"a")
    mgr.register_cursor("s", 0)
    st = mgr.stats()
    assert st["num_items"] == 1 and st["num_checkpoints"] == 1
    assert st["cursor:s:last_seqno"] == 0 and st["cursor:s:dropped"] == "false"
    assert st["cursor:persistence:checkpoint_id"] == 1


def test_deletions_are_queued_and_dedup_like_mutations() -> None:
    mgr, _ = manager()
    Seq(mgr).put(b"a")
    mgr.queue(Item(0, 2, 2, 2, 0, 0, 0, b"a", b"", ItemOp.DELETION, 5, b""))
    snaps = mgr.take(mgr.register_cursor("s", 0).cursor, 10)
    (it,) = snaps[0].items
    assert (it.seqno, it.op, it.delete_time) == (2, ItemOp.DELETION, 5)
    assert item_size(it) == 1 + 200


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def retaining_manager(seconds: float) -> tuple[CheckpointManager, CheckpointMemory, Clock]:
    clock = Clock()
    mem = CheckpointMemory(1 << 30, retain_seconds=seconds, clock=clock)
    return CheckpointManager(0, mem, start_seqno=1, max_items=3, max_bytes=1 << 30), mem, clock


def test_retained_checkpoints_still_serve_a_range_from_memory_cut_where_it_closed() -> None:
    mgr, mem, clock = retaining_manager(10.0)
    seq = Seq(mgr)
    seq.put(b"a", b"b", b"c")  # checkpoint 1 closes at 3 items: 1..3
    seq.put(b"a", b"b")  # open checkpoint: 4..5
    mgr.take(mgr.persistence_cursor, 100)  # persisted: checkpoint 1 is needed by no cursor
    assert mgr.memory_start_seqno == 1  # ... but retained
    clock.now += 5
    reg = mgr.register_cursor("late", 1)
    assert not reg.backfill
    snaps = mgr.take(reg.cursor, 100)
    assert [(s.start, s.end) for s in snaps] == [(2, 3), (4, 5)]  # real boundaries
    mgr.remove_cursor("late")
    clock.now += 5.1
    mgr.release_retained()
    assert mgr.memory_start_seqno == 4
    assert mem.used == sum(c.mem for c in mgr.checkpoints)


def test_retention_yields_to_memory_pressure_and_dropped_cursors() -> None:
    mgr, mem, _clock = retaining_manager(3600.0)
    seq = Seq(mgr)
    seq.put(b"a", b"b", b"c", b"d", b"e", b"f", b"g")
    mgr.take(mgr.persistence_cursor, 100)
    assert mgr.retained_bytes > 0 and len(mgr.checkpoints) == 3
    before = mem.used
    freed = mgr.release_retained(all_of_them=True)
    assert freed == before - mem.used > 0
    assert len(mgr.checkpoints) == 1 and mgr.retained_bytes == 0


def test_without_retention_closed_checkpoints_go_at_once() -> None:
    mgr, _ = manager(max_items=3)
    seq = Seq(mgr)
    seq.put(b"a", b"b", b"c", b"d")
    mgr.take(mgr.persistence_cursor, 100)
    assert mgr.memory_start_seqno == 4


def test_hot_keys_still_close_checkpoints_every_max_items_writes() -> None:
    """Compaction keeps the slots of 3 hot keys few, but the checkpoint still closes after
    max_items writes, so streams get regular boundaries."""
    mgr, _ = manager(max_items=2000)
    seq = Seq(mgr)
    for _ in range(3000):
        seq.put(b"a", b"b", b"c")
    closed = [c for c in mgr.checkpoints if c.closed]
    assert len(closed) == 4  # 9000 writes, a close every 2000
    assert all(len(c.items) == 3 for c in closed)


def test_a_checkpoint_closed_while_its_flush_was_in_flight_is_freed_when_it_completes() -> None:
    mgr, mem = manager()
    seq = Seq(mgr)
    seq.put(b"a", b"b")
    p = mgr.persistence_cursor
    _, mark = mgr.peek(p, 100)  # the flusher takes the batch ...
    mgr.create_checkpoint()  # ... the checkpoint closes meanwhile (the cursor is not at its end)
    assert len(mgr.checkpoints) == 2
    mgr.advance_to(p, mark)  # ... and the batch is durable: nothing pins checkpoint 1 any more
    assert len(mgr.checkpoints) == 1 and mem.used == 0
    seq.put(b"c")
    assert flat(mgr.take(p, 100)) == [(3, b"c")]
