"""The checkpoint manager of one vbucket: its checkpoints and the cursors reading them.

Rules of this module:
- ``CheckpointManager`` composes the writing half, ``CheckpointList``
  (checkpoint_list.py: queueing with dedup, slot compaction, closing, freeing, memory),
  and owns the cursors. Cursors are passive records (checkpoint.py); this class alone
  moves them (kv_engine's split): ``take``, ``take_wire``, ``advance_to``, and the list's
  callbacks when it compacts a checkpoint (the cursors in it are re-placed after their
  ``last_seqno``) or closes one (cursors that read all of it move to the new one). Every
  move keeps ``Checkpoint.num_cursors`` right and lets the list free what no cursor
  holds any more.
- The persistence cursor (``PERSISTENCE_CURSOR``) exists from the start and is never
  dropped or removed: a checkpoint holding unpersisted items can never be freed.
- Cursor dropping (memory pressure) is decided bucket-wide by the bucket; this class
  only offers candidates (``droppable_cursors``) and drops the ones it is told to.
- Reads (``read_snapshots``, ``read_wire_snapshots``) are pure: they return the
  snapshots after a position and the position reached; the caller decides to move a
  cursor there (``take``) or to keep the position for later (``peek``). Snapshots follow
  checkpoint.py's rules: whole snapshots only, ``max_items`` a soft limit checked
  between them; one starting at a checkpoint's first slot carries the CHECKPOINT flag.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

from ...protocol.opcodes import SnapshotMarkerFlag
from .checkpoint import Checkpoint, Cursor, CursorRegistration, Snapshot, WireSnapshot
from .checkpoint_list import CheckpointList, CheckpointMemory
from .item import Item

__all__ = [
    "PERSISTENCE_CURSOR",
    "CheckpointManager",
    "CheckpointMemory",
    "PeekMark",
    "read_snapshots",
    "read_wire_snapshots",
]

PERSISTENCE_CURSOR = "persistence"
_MEMORY = int(SnapshotMarkerFlag.MEMORY)
_MEMORY_CHECKPOINT = int(SnapshotMarkerFlag.MEMORY | SnapshotMarkerFlag.CHECKPOINT)

#: what ``peek`` hands out and ``advance_to`` takes back: (checkpoint, offset, last
#: seqno, the checkpoint's ``gen`` then); checkpoint None when the cursor was dropped
PeekMark = tuple["Checkpoint | None", int, int, int]


class CheckpointManager:
    """Open + closed checkpoints of one vbucket and the named cursors reading them."""

    __slots__ = ("_cursors", "_list", "persistence_cursor", "queue", "queue_snapshot", "vbid")

    def __init__(
        self,
        vbid: int,
        memory: CheckpointMemory,
        *,
        start_seqno: int,
        max_items: int,
        max_bytes: int,
    ) -> None:
        """``start_seqno`` is the first seqno the first checkpoint may hold (high + 1)."""
        self.vbid = vbid
        lst = self._list = CheckpointList(
            vbid,
            memory,
            start_seqno=start_seqno,
            max_items=max_items,
            max_bytes=max_bytes,
            on_compacted=self._compacted,
            on_closed=self._closed,
        )
        #: ``queue(item)``: append to the open checkpoint, superseding that key's older
        #: slot (the list's own method: the ingest hot path pays no extra call)
        self.queue = lst.queue
        #: ``queue_snapshot(items)``: a replica's whole snapshot in a checkpoint of its own
        self.queue_snapshot = lst.queue_snapshot
        self._cursors: dict[str, Cursor] = {}
        self.persistence_cursor = self._place(PERSISTENCE_CURSOR, lst.open, 0, start_seqno - 1)

    def _compacted(self, ckpt: Checkpoint) -> None:
        """The list removed slots of ``ckpt``: re-place its cursors by seqno."""
        seqnos = ckpt.seqnos
        for c in self._cursors.values():
            if c.checkpoint is ckpt:
                c.offset = bisect_right(seqnos, c.last_seqno)

    def _closed(self, old: Checkpoint, new: Checkpoint) -> None:
        """``old`` closed: cursors that read all of it move on to ``new``, unpinning it."""
        end = len(old.items)
        for c in self._cursors.values():
            if c.checkpoint is old and c.offset >= end:
                old.num_cursors -= 1
                new.num_cursors += 1
                c.checkpoint = new
                c.offset = 0

    def create_checkpoint(self) -> int:
        """Close the open checkpoint now (if it holds anything); returns the open id.
        The current high seqno becomes a snapshot boundary for every cursor."""
        return self._list.create_checkpoint()

    def free_unreferenced(self, *, retained: bool = False) -> int:
        """Free the oldest closed checkpoints no cursor is in, except those still within
        the retention time (all of them with ``retained``); returns bytes freed."""
        return self._list.free_unreferenced(retained=retained)

    def release_retained(self, *, all_of_them: bool = False) -> int:
        """Free retained checkpoints whose time is up (or all: memory pressure)."""
        return self._list.free_unreferenced(retained=all_of_them)

    @property
    def retained_bytes(self) -> int:
        """Memory of the oldest closed checkpoints that no cursor needs: those retention
        keeps (or whose time is up and that the next ``release_retained`` frees)."""
        return self._list.retained_bytes

    # ------------------------------------------------------------------ cursors

    def register_cursor(self, name: str, start_seqno: int) -> CursorRegistration:
        """Place a cursor so that its first item is the first one after ``start_seqno``.

        Replaces a cursor of the same name. See ``CursorRegistration`` for the backfill
        contract when memory no longer reaches back to ``start_seqno``.
        """
        if name == PERSISTENCE_CURSOR:
            raise ValueError("the persistence cursor cannot be re-registered")
        if name in self._cursors:
            self.remove_cursor(name)
        first = self._list.checkpoints[0]
        if start_seqno + 1 < first.start_seqno:
            cursor = self._place(name, first, 0, start_seqno)
            backfill = True
        else:
            target = first
            for ckpt in self._list.checkpoints:
                if ckpt.start_seqno <= start_seqno + 1:
                    target = ckpt
                else:
                    break
            cursor = self._place(name, target, target.offset_after(start_seqno), start_seqno)
            backfill = False
        return CursorRegistration(cursor, backfill)

    def _place(self, name: str, ckpt: Checkpoint, offset: int, last_seqno: int) -> Cursor:
        cursor = Cursor(name, ckpt, offset, last_seqno)
        ckpt.num_cursors += 1
        self._cursors[name] = cursor
        return cursor

    def remove_cursor(self, name_or_cursor: str | Cursor) -> bool:
        """Remove a stream's cursor (unknown names are ignored); returns True if removed."""
        name = name_or_cursor if isinstance(name_or_cursor, str) else name_or_cursor.name
        if name == PERSISTENCE_CURSOR:
            raise ValueError("the persistence cursor cannot be removed")
        cursor = self._cursors.get(name)
        if cursor is None or (not isinstance(name_or_cursor, str) and cursor is not name_or_cursor):
            return False
        del self._cursors[name]
        self._detach(cursor)
        self.free_unreferenced()
        return True

    def drop_cursor(self, cursor: Cursor) -> int:
        """Drop a stream's cursor under memory pressure; returns bytes freed."""
        if cursor is self.persistence_cursor:
            raise ValueError("the persistence cursor is never dropped")
        if self._cursors.get(cursor.name) is cursor:
            del self._cursors[cursor.name]
        self._detach(cursor)
        cursor.dropped = True
        return self.free_unreferenced(retained=True)  # memory pressure: retention yields

    def droppable_cursors(self) -> list[tuple[int, Cursor]]:
        """(bytes pinned, cursor) for stream cursors behind the persistence cursor.

        Only those pin memory that dropping them can free: checkpoints the persistence
        cursor has not passed cannot be freed anyway.
        """
        pckpt = self.persistence_cursor.checkpoint
        assert pckpt is not None
        out = []
        for c in self._cursors.values():
            ck = c.checkpoint
            if c is self.persistence_cursor or ck is None or ck.id >= pckpt.id:
                continue
            pinned = 0
            while ck is not None and ck is not pckpt:
                pinned += ck.mem
                ck = ck.next
            out.append((pinned, c))
        return out

    def _detach(self, cursor: Cursor) -> None:
        """The cursor leaves the checkpoints for good (removed or dropped)."""
        ckpt = cursor.checkpoint
        if ckpt is not None:
            ckpt.num_cursors -= 1
            cursor.checkpoint = None

    # ------------------------------------------------------------------ reading & moving

    def take(self, cursor: Cursor, max_items: int) -> list[Snapshot]:
        """Whole snapshots after ``cursor``, stopping once >= ``max_items`` items; the
        cursor moves past them. ``[]`` when there is nothing new or it was dropped."""
        ckpt = cursor.checkpoint
        if ckpt is None:
            return []
        snaps, ckpt, offset, last = read_snapshots(
            ckpt, cursor.offset, cursor.last_seqno, max_items
        )
        self._move(cursor, ckpt, offset, last)
        return snaps

    def take_wire(self, cursor: Cursor, max_items: int) -> list[WireSnapshot]:
        """``take`` for streams: the same snapshots and cursor move, as wire runs."""
        ckpt = cursor.checkpoint
        if ckpt is None:
            return []
        snaps, ckpt, offset, last = read_wire_snapshots(
            ckpt, cursor.offset, cursor.last_seqno, max_items
        )
        self._move(cursor, ckpt, offset, last)
        return snaps

    def peek(self, cursor: Cursor, max_items: int) -> tuple[list[Snapshot], PeekMark]:
        """Like ``take`` but the cursor stays; returns the position to ``advance_to``.

        The flusher peeks at collect time and advances only once the batch is durable.
        """
        ckpt = cursor.checkpoint
        if ckpt is None:
            return [], (None, 0, cursor.last_seqno, 0)
        snaps, ckpt, offset, last = read_snapshots(
            ckpt, cursor.offset, cursor.last_seqno, max_items
        )
        return snaps, (ckpt, offset, last, ckpt.gen)

    def advance_to(self, cursor: Cursor, mark: PeekMark) -> None:
        """Move ``cursor`` to a position ``peek`` returned (re-placed by seqno if its
        checkpoint was compacted since); never backwards."""
        ckpt, offset, last, gen = mark
        here = cursor.checkpoint
        if here is None or ckpt is None:
            return
        if gen != ckpt.gen:
            offset = ckpt.offset_after(last)
        if ckpt.closed and offset >= len(ckpt.items) and ckpt.next is not None:
            # all of a closed checkpoint is read: step out of it so it can be freed (it
            # closed while this batch was being written, after ``_closed`` moved the
            # cursors that were at its end)
            ckpt, offset = ckpt.next, 0
        if (ckpt.id, offset) <= (here.id, cursor.offset):
            return
        self._move(cursor, ckpt, offset, last)

    def _move(self, cursor: Cursor, ckpt: Checkpoint, offset: int, last_seqno: int) -> None:
        old = cursor.checkpoint
        cursor.offset = offset
        cursor.last_seqno = last_seqno
        if ckpt is not old:
            old.num_cursors -= 1  # type: ignore[union-attr]  # callers checked: not None
            ckpt.num_cursors += 1
            cursor.checkpoint = ckpt
            self.free_unreferenced()

    @property
    def cursors(self) -> Iterable[Cursor]:
        return list(self._cursors.values())

    def get_cursor(self, name: str) -> Cursor | None:
        return self._cursors.get(name)

    # ------------------------------------------------------------------ lookups & stats

    def persistence_caught_up(self) -> bool:
        """True when the persistence cursor has read everything queued."""
        p = self.persistence_cursor
        return p.checkpoint is self._list.open and p.offset >= len(self._list.open.items)

    def open_checkpoint_items(self) -> int:
        """Slots (live or superseded) in the open checkpoint."""
        return len(self._list.open.items)

    @property
    def open_checkpoint_id(self) -> int:
        return self._list.open.id

    @property
    def memory_start_seqno(self) -> int:
        """Lowest seqno memory can still serve (oldest checkpoint's start)."""
        return self._list.checkpoints[0].start_seqno

    @property
    def num_checkpoints(self) -> int:
        return len(self._list.checkpoints)

    @property
    def checkpoints(self) -> list[Checkpoint]:
        return list(self._list.checkpoints)

    @property
    def mem_usage(self) -> int:
        return sum(c.mem for c in self._list.checkpoints)

    def find_item(self, key: bytes) -> Item | None:
        """Newest in-memory item for ``key`` (searches newest checkpoint first)."""
        for ckpt in reversed(self._list.checkpoints):
            slot = ckpt.index.get(key)
            if slot is not None:
                return ckpt.items[slot]
        return None

    def num_items(self) -> int:
        return sum(c.num_items for c in self._list.checkpoints)

    def stats(self) -> dict[str, int | str]:
        """Couchbase-like ``checkpoint`` stats of this vbucket."""
        out: dict[str, int | str] = {
            "open_checkpoint_id": self._list.open.id,
            "num_checkpoints": len(self._list.checkpoints),
            "num_open_checkpoint_items": self._list.open.num_items,
            "num_items": self.num_items(),
            "mem_usage": self.mem_usage,
            "memory_start_seqno": self.memory_start_seqno,
            "num_cursors": len(self._cursors),
        }
        for c in self._cursors.values():
            out[f"cursor:{c.name}:checkpoint_id"] = c.checkpoint_id
            out[f"cursor:{c.name}:last_seqno"] = c.last_seqno
            out[f"cursor:{c.name}:dropped"] = "true" if c.dropped else "false"
        return out


def read_snapshots(
    ckpt: Checkpoint, off: int, last: int, max_items: int
) -> tuple[list[Snapshot], Checkpoint, int, int]:
    """Snapshots of items after slot ``off`` of ``ckpt``, stopping once >= ``max_items``
    items; also the (checkpoint, offset, last seqno) reached (``last`` if none)."""
    out: list[Snapshot] = []
    n = 0
    while True:
        items = ckpt.items
        end = len(items)
        if off >= end:
            nxt = ckpt.next
            if nxt is None:
                break
            ckpt, off = nxt, 0
            continue
        if n >= max_items:
            break
        chunk = list(filter(None, items[off:end]))
        last = chunk[-1].seqno
        out.append(
            Snapshot(chunk[0].seqno, last, _MEMORY_CHECKPOINT if off == 0 else _MEMORY, chunk)
        )
        n += len(chunk)
        off = end
    return out, ckpt, off, last


def read_wire_snapshots(
    ckpt: Checkpoint, off: int, last: int, max_items: int
) -> tuple[list[WireSnapshot], Checkpoint, int, int]:
    """``read_snapshots`` as wire runs (``Checkpoint.segments``): the same snapshots and
    the same position reached."""
    out: list[WireSnapshot] = []
    n = 0
    while True:
        end = len(ckpt.items)
        if off >= end:
            nxt = ckpt.next
            if nxt is None:
                break
            ckpt, off = nxt, 0
            continue
        if n >= max_items:
            break
        segs, count, first = ckpt.segments(off, end)
        last = ckpt.last_seqno  # slot end - 1: the last slot is never superseded
        out.append(
            WireSnapshot(first, last, _MEMORY_CHECKPOINT if off == 0 else _MEMORY, segs, count)
        )
        n += count
        off = end
    return out, ckpt, off, last
