"""The checkpoint manager's cursor bookkeeping under random work (checkpoint_manager.py:
the manager alone moves cursors; every move keeps ``num_cursors`` and memory right)."""

from __future__ import annotations

import random

from .test_checkpoint import Seq, manager


def test_the_manager_alone_moves_cursors_and_keeps_their_counts_right() -> None:
    """Random queueing, reads, peeks, closes, registrations, removals and drops: after
    every step each checkpoint counts exactly the cursors positioned in it, a removed or
    dropped cursor is in none, and every stream reads each seqno at most once, in order
    (the bookkeeping of checkpoint_manager.py: placing, moving, closing, compaction)."""
    rng = random.Random(5)
    mgr, mem = manager(max_items=40)
    seq = Seq(mgr)
    names = ["a", "b", "c"]
    live: dict[str, object] = {}
    last: dict[str, int] = {}
    gone: list = []
    mark = None
    for _step in range(3000):
        r = rng.random()
        if r < 0.55:
            seq.put(b"k%d" % rng.randrange(30))
        elif r < 0.7 and live:
            name = rng.choice(sorted(live))
            for s in mgr.take(live[name], rng.choice([1, 10, 1000])):
                for it in s.items:
                    assert it.seqno > last[name]
                    last[name] = it.seqno
        elif r < 0.78:
            if mark is None:
                _, mark = mgr.peek(mgr.persistence_cursor, rng.choice([5, 1000]))
            else:
                mgr.advance_to(mgr.persistence_cursor, mark)
                mark = None
        elif r < 0.82:
            mgr.create_checkpoint()
        elif r < 0.9:
            name = rng.choice(names)
            start = max(mgr.memory_start_seqno - 1, seq.next - 1 - rng.randrange(50))
            reg = mgr.register_cursor(name, start)  # (re-registering may free memory:
            live[name] = reg.cursor  # then it is a backfill, reads go on)
            last[name] = start
        elif r < 0.95 and live:
            name = rng.choice(sorted(live))
            gone.append(live.pop(name))
            assert mgr.remove_cursor(gone[-1])
        elif live:
            name = rng.choice(sorted(live))
            gone.append(live.pop(name))
            mgr.drop_cursor(gone[-1])
            assert mgr.take(gone[-1], 10) == []
        cursors = list(mgr.cursors)
        assert len(cursors) == len(live) + 1  # + the persistence cursor
        for ckpt in mgr.checkpoints:
            assert ckpt.num_cursors == sum(c.checkpoint is ckpt for c in cursors)
        assert all(c.checkpoint is None and c.position == (-1, -1) for c in gone)
        assert mem.used == sum(c.mem for c in mgr.checkpoints)
