"""The checkpoint manager of one vbucket: queue items, place cursors, free memory.

Rules of this module:
- Items enter only through ``queue`` (seqno order, the vbucket assigns seqnos). The open
  checkpoint is closed once ``checkpoint_max_items`` items were queued into it (counting
  the ones deduplicated since, so hot keys still get regular boundaries),
  ``checkpoint_max_bytes`` bytes, or on request (``create_checkpoint``).
- The persistence cursor (``PERSISTENCE_CURSOR``) exists from the start and is never
  dropped or removed: a checkpoint holding unpersisted items can never be freed.
- A closed checkpoint is freed once it is the oldest and no cursor is in it, and (with
  ``CheckpointMemory.retain_seconds``) it closed that long ago or memory pressure asks
  for it (``release_retained``); memory is accounted in bytes in the bucket-wide
  ``CheckpointMemory``.
- Cursor dropping (memory pressure) is decided bucket-wide by the bucket; this class
  only offers candidates (``droppable_cursors``) and drops the ones it is told to.
- ``queue`` also appends a mutation's frame to the open checkpoint's wire log (see
  ``checkpoint.py``); the frame is charged with the item (as the DCP body it carries)
  and refunded when the item is superseded; the superseded slot itself stays, charged
  ``DEAD_SLOT_BYTES``. Compaction (``_compact``) removes superseded slots and frames
  once they are more than half of the checkpoint (and over ``COMPACT_MIN_SLOTS`` slots
  or ``WIRE_COMPACT_MIN`` wire bytes), and always when a checkpoint closes: what is held
  but not charged stays within that bound, and a closed checkpoint holds live items
  only. Without slot compaction a stalled cursor let 10 M overwrites of 100 k keys pin
  ~130 MiB of superseded slots (docs/benchmarks.md, slow-consumer).
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable

from .checkpoint import DEAD, LIVE_FRAME, LIVE_OTHER, Checkpoint, Cursor, CursorRegistration
from .item import ITEM_OVERHEAD, Item

__all__ = ["PERSISTENCE_CURSOR", "CheckpointManager", "CheckpointMemory"]

PERSISTENCE_CURSOR = "persistence"
#: superseded wire bytes an open checkpoint may hold before compaction is considered
WIRE_COMPACT_MIN = 16 * 1024
#: superseded slots an open checkpoint may hold before compaction is considered
COMPACT_MIN_SLOTS = 1024
#: what a superseded slot still costs: its list entry, wire offset, seqno and kind byte
DEAD_SLOT_BYTES = 21
#: a checkpoint closes before its wire reaches this (wire offsets are 32-bit)
_WIRE_MAX = 3 << 30

_MUT = 0x57
_frame_head = struct.Struct(">BBHBBHIIQ").pack  # opaque 0: a stream patches its own in
_frame_head_extras = struct.Struct(">BBHBBHIIQQQIIIHB").pack  # + mutation extras
_BODYLEN = struct.Struct(">I").unpack_from
#: (key length, value length) -> pack of a whole mutation frame (header, extras, key,
#: value) in one call; bounded, sizes beyond it are packed in three steps
_FRAME_PACKS: dict[tuple[int, int], Callable[..., bytes]] = {}
_FRAME_PACKS_MAX = 4096


def _frame_pack(kl: int, vl: int) -> Callable[..., bytes] | None:
    pack = _FRAME_PACKS.get((kl, vl))
    if pack is None and len(_FRAME_PACKS) < _FRAME_PACKS_MAX:
        pack = _FRAME_PACKS[(kl, vl)] = struct.Struct(f">BBHBBHIIQQQIIIHB{kl}s{vl}s").pack
    return pack


class CheckpointMemory:
    """Bucket-wide checkpoint memory: bytes used, the quota, the pressure hook.

    ``threshold`` is the level that triggers ``on_pressure``: the quota, raised a little
    after an attempt that could not get under it, so a bucket whose memory is pinned by
    the (slow) persistence cursor does not rescan every cursor on every write.

    ``retain_seconds``: a closed checkpoint no cursor needs any more is kept this long
    after it closed (``clock`` seconds), unless memory pressure wants it back. A stream
    request for a range that just went to disk is then still served from memory, cut
    at the checkpoint boundaries it was planned on: a consumer that plans ranges and
    reads them a moment later (the Spark source) reads them exactly, where the disk
    would hand out one merged snapshot.
    """

    __slots__ = ("clock", "on_pressure", "quota", "retain_seconds", "threshold", "used")

    def __init__(self, quota: int, on_pressure: Callable[[], None] | None = None, *,
                 retain_seconds: float = 0.0, clock: Callable[[], float] | None = None
                 ) -> None:
        self.used = 0
        self.quota = quota
        self.threshold = quota
        self.on_pressure = on_pressure or (lambda: None)
        if retain_seconds and clock is None:
            raise ValueError("retaining checkpoints needs a clock")
        self.retain_seconds = retain_seconds
        self.clock = clock


class CheckpointManager:
    """Open + closed checkpoints of one vbucket and the named cursors reading them."""

    __slots__ = ("_checkpoints", "_cursors", "_max_bytes", "_max_items", "_memory", "_next_id",
                 "_open", "persistence_cursor", "vbid")

    def __init__(self, vbid: int, memory: CheckpointMemory, *, start_seqno: int,
                 max_items: int, max_bytes: int) -> None:
        """``start_seqno`` is the first seqno the first checkpoint may hold (high + 1)."""
        self.vbid = vbid
        self._memory = memory
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._next_id = 2
        self._open = Checkpoint(1, start_seqno)
        self._checkpoints: deque[Checkpoint] = deque([self._open])
        self._cursors: dict[str, Cursor] = {}
        self.persistence_cursor = Cursor(PERSISTENCE_CURSOR, self, self._open, 0,
                                         start_seqno - 1)
        self._cursors[PERSISTENCE_CURSOR] = self.persistence_cursor

    # ------------------------------------------------------------------ queueing

    def queue(self, item: Item) -> None:
        """Append ``item`` to the open checkpoint, superseding that key's older slot."""
        ckpt = self._open
        key = item.key
        value = item.value
        body = item.body
        items = ckpt.items
        wire = ckpt.wire
        ckpt.starts.append(len(wire))
        ckpt.seqnos.append(item.seqno)
        if item.op == _MUT:
            kl = len(key)
            if body:
                flen = 24 + len(body)
                wire += _frame_head(0x80, _MUT, kl, 31, item.datatype, self.vbid, len(body), 0,
                                    item.cas)
                wire += body
            else:
                vl = len(value)
                flen = 55 + kl + vl
                pack = _frame_pack(kl, vl)
                if pack is not None:
                    wire += pack(0x80, _MUT, kl, 31, item.datatype, self.vbid, 31 + kl + vl, 0,
                                 item.cas, item.seqno, item.rev_seqno, item.flags, item.expiry,
                                 0, 0, 0, key, value)
                else:
                    wire += _frame_head_extras(0x80, _MUT, kl, 31, item.datatype, self.vbid,
                                               31 + kl + vl, 0, item.cas, item.seqno,
                                               item.rev_seqno, item.flags, item.expiry, 0, 0, 0)
                    wire += key
                    wire += value
            ckpt.kinds.append(LIVE_FRAME)
            # A frame is charged as the DCP body it carries: its 24-byte header and the
            # per-slot entries are part of ITEM_OVERHEAD (they replace the body object a
            # queued mutation no longer has).
            size = len(key) + len(value) + len(body) + flen - 24 + ITEM_OVERHEAD
        else:
            ckpt.kinds.append(LIVE_OTHER)
            size = len(key) + len(value) + len(body) + ITEM_OVERHEAD
        index = ckpt.index
        slot = index.get(key)
        if slot is not None:
            old = items[slot]
            items[slot] = None
            size -= (len(old.key) + len(old.value) + len(old.body)  # type: ignore[union-attr]
                     + ITEM_OVERHEAD - DEAD_SLOT_BYTES)
            if ckpt.kinds[slot] == LIVE_FRAME:
                dead = 24 + _BODYLEN(wire, ckpt.starts[slot] + 8)[0]
                size -= dead - 24
                ckpt.wire_dead += dead
            ckpt.kinds[slot] = DEAD
        index[key] = len(items)
        items.append(item)
        ckpt.mem += size
        if ((ckpt.wire_dead > WIRE_COMPACT_MIN and 2 * ckpt.wire_dead > len(wire))
                or (len(items) > 2 * len(index) and len(items) > COMPACT_MIN_SLOTS)):
            self._compact(ckpt)  # refunds the dead slots itself
            items = ckpt.items
        ckpt.last_seqno = item.seqno
        mem = self._memory
        mem.used += size
        ckpt.queued += 1
        if (ckpt.queued >= self._max_items or ckpt.mem >= self._max_bytes
                or len(ckpt.wire) >= _WIRE_MAX):
            self._close_open()
        if mem.used > mem.threshold:
            mem.on_pressure()

    def _compact(self, ckpt: Checkpoint) -> int:
        """Remove superseded slots and frames; returns the bytes refunded.

        The live frames are copied into a new wire (captured runs keep the old one), and
        every cursor in ``ckpt`` is re-placed after its ``last_seqno`` (checkpoint.py)."""
        dead_slots = len(ckpt.items) - len(ckpt.index)
        if not dead_slots and not ckpt.wire_dead:
            return 0
        old = ckpt.wire
        new = bytearray()
        starts = ckpt.starts
        kinds = ckpt.kinds
        items = ckpt.items
        seqnos = ckpt.seqnos
        n_items: list[Item | None] = []
        n_starts = array("I")
        n_kinds = bytearray()
        n_seqnos = array("Q")
        index = ckpt.index
        for key, slot in sorted(index.items(), key=lambda kv: kv[1]):
            index[key] = len(n_items)
            n_items.append(items[slot])
            n_starts.append(len(new))
            n_seqnos.append(seqnos[slot])
            k = kinds[slot]
            n_kinds.append(k)
            if k == LIVE_FRAME:
                a = starts[slot]
                new += old[a:a + 24 + _BODYLEN(old, a + 8)[0]]
        ckpt.items = n_items
        ckpt.starts = n_starts
        ckpt.kinds = n_kinds
        ckpt.seqnos = n_seqnos
        ckpt.wire = new
        ckpt.wire_dead = 0
        ckpt.stamp_from = ckpt.stamp_upto = 0
        ckpt.gen += 1
        for c in self._cursors.values():
            if c._ckpt is ckpt:
                c._offset = bisect_right(n_seqnos, c.last_seqno)
        refund = dead_slots * DEAD_SLOT_BYTES
        ckpt.mem -= refund
        self._memory.used -= refund
        return refund

    def create_checkpoint(self) -> int:
        """Close the open checkpoint now (if it holds anything); returns the open id.

        The current high seqno becomes a snapshot boundary for every cursor.
        """
        if self._open.items:
            self._close_open()
        return self._open.id

    def _close_open(self) -> None:
        old = self._open
        old.closed = True
        mem = self._memory
        if mem.retain_seconds:
            old.closed_at = mem.clock()  # type: ignore[misc]
        self._compact(old)
        new = Checkpoint(self._next_id, old.last_seqno + 1)
        self._next_id += 1
        old.next = new
        self._open = new
        self._checkpoints.append(new)
        # Cursors that have read all of the old checkpoint move on now, unpinning it.
        end = len(old.items)
        for c in self._cursors.values():
            if c._ckpt is old and c._offset >= end:
                c._move(new, 0)
        self.free_unreferenced()

    def free_unreferenced(self, *, retained: bool = False) -> int:
        """Free the oldest closed checkpoints no cursor is in, except those still within
        the retention time (all of them with ``retained``); returns bytes freed."""
        ckpts = self._checkpoints
        freed = 0
        mem = self._memory
        if retained:
            keep_after = float("inf")  # free whatever no cursor needs
        elif mem.retain_seconds:
            keep_after = mem.clock() - mem.retain_seconds  # type: ignore[misc]
        else:
            keep_after = -1.0  # closed_at stays -1.0 without retention
        while len(ckpts) > 1:
            first = ckpts[0]
            if first.num_cursors or not first.closed or first.closed_at > keep_after:
                break
            ckpts.popleft()
            freed += first.mem
            first.mem = 0
            first.release()
        if freed:
            mem = self._memory
            mem.used -= freed
            if mem.used <= mem.quota:
                mem.threshold = mem.quota
        return freed

    def release_retained(self, *, all_of_them: bool = False) -> int:
        """Free retained checkpoints whose time is up (or all: memory pressure)."""
        return self.free_unreferenced(retained=all_of_them)

    @property
    def retained_bytes(self) -> int:
        """Memory of the oldest closed checkpoints that no cursor needs: those retention
        keeps (or whose time is up and that the next ``release_retained`` frees)."""
        n = 0
        for c in self._checkpoints:
            if c.num_cursors or not c.closed:
                break
            n += c.mem
        return n

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
        first = self._checkpoints[0]
        if start_seqno + 1 < first.start_seqno:
            cursor = Cursor(name, self, first, 0, start_seqno)
            backfill = True
        else:
            target = first
            for ckpt in self._checkpoints:
                if ckpt.start_seqno <= start_seqno + 1:
                    target = ckpt
                else:
                    break
            cursor = Cursor(name, self, target, target.offset_after(start_seqno), start_seqno)
            backfill = False
        self._cursors[name] = cursor
        return CursorRegistration(cursor, backfill)

    def remove_cursor(self, name_or_cursor: str | Cursor) -> bool:
        """Remove a stream's cursor (unknown names are ignored); returns True if removed."""
        name = name_or_cursor if isinstance(name_or_cursor, str) else name_or_cursor.name
        if name == PERSISTENCE_CURSOR:
            raise ValueError("the persistence cursor cannot be removed")
        cursor = self._cursors.get(name)
        if cursor is None or (not isinstance(name_or_cursor, str) and cursor is not name_or_cursor):
            return False
        del self._cursors[name]
        cursor._detach()
        self.free_unreferenced()
        return True

    def drop_cursor(self, cursor: Cursor) -> int:
        """Drop a stream's cursor under memory pressure; returns bytes freed."""
        if cursor is self.persistence_cursor:
            raise ValueError("the persistence cursor is never dropped")
        if self._cursors.get(cursor.name) is cursor:
            del self._cursors[cursor.name]
        cursor._detach()
        cursor.dropped = True
        return self.free_unreferenced(retained=True)  # memory pressure: retention yields

    def droppable_cursors(self) -> list[tuple[int, Cursor]]:
        """(bytes pinned, cursor) for stream cursors behind the persistence cursor.

        Only those pin memory that dropping them can free: checkpoints the persistence
        cursor has not passed cannot be freed anyway.
        """
        pckpt = self.persistence_cursor._ckpt
        assert pckpt is not None
        out = []
        for c in self._cursors.values():
            ck = c._ckpt
            if c is self.persistence_cursor or ck is None or ck.id >= pckpt.id:
                continue
            pinned = 0
            while ck is not None and ck is not pckpt:
                pinned += ck.mem
                ck = ck.next
            out.append((pinned, c))
        return out

    @property
    def cursors(self) -> Iterable[Cursor]:
        return list(self._cursors.values())

    def get_cursor(self, name: str) -> Cursor | None:
        return self._cursors.get(name)

    # ------------------------------------------------------------------ lookups & stats

    def persistence_caught_up(self) -> bool:
        """True when the persistence cursor has read everything queued."""
        p = self.persistence_cursor
        return p._ckpt is self._open and p._offset >= len(self._open.items)

    def open_checkpoint_items(self) -> int:
        """Slots (live or superseded) in the open checkpoint."""
        return len(self._open.items)

    @property
    def open_checkpoint_id(self) -> int:
        return self._open.id

    @property
    def memory_start_seqno(self) -> int:
        """Lowest seqno memory can still serve (oldest checkpoint's start)."""
        return self._checkpoints[0].start_seqno

    @property
    def checkpoints(self) -> list[Checkpoint]:
        return list(self._checkpoints)

    @property
    def mem_usage(self) -> int:
        return sum(c.mem for c in self._checkpoints)

    def find_item(self, key: bytes) -> Item | None:
        """Newest in-memory item for ``key`` (searches newest checkpoint first)."""
        for ckpt in reversed(self._checkpoints):
            slot = ckpt.index.get(key)
            if slot is not None:
                return ckpt.items[slot]
        return None

    def num_items(self) -> int:
        return sum(c.num_items for c in self._checkpoints)

    def stats(self) -> dict[str, int | str]:
        """Couchbase-like ``checkpoint`` stats of this vbucket."""
        out: dict[str, int | str] = {
            "open_checkpoint_id": self._open.id,
            "num_checkpoints": len(self._checkpoints),
            "num_open_checkpoint_items": self._open.num_items,
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
