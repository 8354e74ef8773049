"""The chain of one vbucket's checkpoints: queueing, slot compaction, closing, freeing.

Rules of this module:
- ``CheckpointList`` is the writing half of ``CheckpointManager`` (which composes it and
  owns the cursors). Items enter only through ``queue`` (seqno order, the vbucket
  assigns seqnos). The open checkpoint is closed once ``checkpoint_max_items`` items were
  queued into it (counting the ones deduplicated since, so hot keys still get regular
  boundaries), ``checkpoint_max_bytes`` bytes, or on request (``create_checkpoint``).
- This module never moves a cursor: compaction and closing call the manager back
  (``on_compacted``, ``on_closed``), which re-places or moves the cursors concerned
  before anything is freed.
- Memory is accounted in bytes in the bucket-wide ``CheckpointMemory``. A queued item is
  charged with its key, value, body and ``ITEM_OVERHEAD``; a mutation's frame in the
  wire log (checkpoint.py) is charged as the DCP body it carries. A superseded item is
  refunded at once except ``DEAD_SLOT_BYTES``: its slot stays until compaction.
- Compaction (``compact_slots``) removes superseded slots and frames once they are more
  than half of the open checkpoint (and over ``COMPACT_MIN_SLOTS`` slots or
  ``WIRE_COMPACT_MIN`` wire bytes), and always when a checkpoint closes: what is held but
  not charged stays within that bound, and a closed checkpoint holds live items only.
  Without it a stalled cursor let 10 M overwrites of 100 k keys pin ~130 MiB of
  superseded slots (docs/benchmarks.md, slow-consumer). The live frames go to a NEW wire
  (runs captured earlier keep the old one, so what they promised never changes).
- A closed checkpoint is freed once it is the oldest and no cursor is in it, and (with
  ``CheckpointMemory.retain_seconds``) it closed that long ago or memory pressure asks
  for it (``release_retained``).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable

from ...protocol.layout import HEADER_SIZE, MUTATION_FRAME_OVERHEAD, U32
from .checkpoint import (
    DEAD,
    LIVE_FRAME,
    LIVE_OTHER,
    MUTATION,
    MUTATION_EXTLEN,
    REQUEST,
    Checkpoint,
    frame_head,
    frame_head_extras,
    frame_pack,
)
from .item import ITEM_OVERHEAD, Item

__all__ = [
    "COMPACT_MIN_SLOTS",
    "DEAD_SLOT_BYTES",
    "WIRE_COMPACT_MIN",
    "CheckpointList",
    "CheckpointMemory",
    "compact_slots",
]

#: superseded wire bytes an open checkpoint may hold before compaction is considered
WIRE_COMPACT_MIN = 16 * 1024
#: superseded slots an open checkpoint may hold before compaction is considered
COMPACT_MIN_SLOTS = 1024
#: what a superseded slot still costs: its list entry, wire offset, seqno and kind byte
DEAD_SLOT_BYTES = 21
#: a checkpoint closes before its wire reaches this (wire offsets are 32-bit)
_WIRE_MAX = 3 << 30
_MUT = MUTATION
_REQ = REQUEST
_EXT = MUTATION_EXTLEN
_HDR = HEADER_SIZE
_OVERHEAD = MUTATION_FRAME_OVERHEAD
_BODYLEN = U32.unpack_from


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

    def __init__(
        self,
        quota: int,
        on_pressure: Callable[[], None] | None = None,
        *,
        retain_seconds: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.used = 0
        self.quota = quota
        self.threshold = quota
        self.on_pressure = on_pressure or (lambda: None)
        if retain_seconds and clock is None:
            raise ValueError("retaining checkpoints needs a clock")
        self.retain_seconds = retain_seconds
        self.clock = clock


class CheckpointList:
    """The open + closed checkpoints of one vbucket, oldest first (see the module rules).

    ``checkpoints`` and ``open`` are read by the manager; only this class changes them.
    """

    __slots__ = (
        "_max_bytes",
        "_max_items",
        "_next_id",
        "_on_closed",
        "_on_compacted",
        "checkpoints",
        "memory",
        "open",
        "vbid",
    )

    def __init__(
        self,
        vbid: int,
        memory: CheckpointMemory,
        *,
        start_seqno: int,
        max_items: int,
        max_bytes: int,
        on_compacted: Callable[[Checkpoint], None],
        on_closed: Callable[[Checkpoint, Checkpoint], None],
    ) -> None:
        """``on_compacted(ckpt)``: the slots of ``ckpt`` moved, re-place its cursors.
        ``on_closed(old, new)``: ``old`` closed and ``new`` is open; cursors that read
        all of ``old`` should move to ``new``."""
        self.vbid = vbid
        self.memory = memory
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._on_compacted = on_compacted
        self._on_closed = on_closed
        self._next_id = 2
        self.open = Checkpoint(1, start_seqno)
        self.checkpoints: deque[Checkpoint] = deque([self.open])

    def queue(self, item: Item) -> None:
        """Append ``item`` to the open checkpoint, superseding that key's older slot."""
        ckpt = self.open
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
                flen = _HDR + len(body)
                wire += frame_head(
                    _REQ, _MUT, kl, _EXT, item.datatype, self.vbid, len(body), 0, item.cas
                )
                wire += body
            else:
                vl = len(value)
                flen = _OVERHEAD + kl + vl
                pack = frame_pack(kl, vl)
                if pack is not None:
                    wire += pack(
                        _REQ,
                        _MUT,
                        kl,
                        _EXT,
                        item.datatype,
                        self.vbid,
                        _EXT + kl + vl,
                        0,
                        item.cas,
                        item.seqno,
                        item.rev_seqno,
                        item.flags,
                        item.expiry,
                        0,
                        0,
                        0,
                        key,
                        value,
                    )
                else:
                    wire += frame_head_extras(
                        _REQ,
                        _MUT,
                        kl,
                        _EXT,
                        item.datatype,
                        self.vbid,
                        _EXT + kl + vl,
                        0,
                        item.cas,
                        item.seqno,
                        item.rev_seqno,
                        item.flags,
                        item.expiry,
                        0,
                        0,
                        0,
                    )
                    wire += key
                    wire += value
            ckpt.kinds.append(LIVE_FRAME)
            # A frame is charged as the DCP body it carries: its 24-byte header and the
            # per-slot entries are part of ITEM_OVERHEAD (they replace the body object a
            # queued mutation no longer has).
            size = len(key) + len(value) + len(body) + flen - _HDR + ITEM_OVERHEAD
        else:
            ckpt.kinds.append(LIVE_OTHER)
            size = len(key) + len(value) + len(body) + ITEM_OVERHEAD
        index = ckpt.index
        slot = index.get(key)
        if slot is not None:
            old: Item = items[slot]  # type: ignore[assignment]  # indexed slots are live
            items[slot] = None
            size -= len(old.key) + len(old.value) + len(old.body) + ITEM_OVERHEAD - DEAD_SLOT_BYTES
            if ckpt.kinds[slot] == LIVE_FRAME:
                dead = _HDR + _BODYLEN(wire, ckpt.starts[slot] + 8)[0]
                size -= dead - _HDR
                ckpt.wire_dead += dead
            ckpt.kinds[slot] = DEAD
        index[key] = len(items)
        items.append(item)
        ckpt.mem += size
        if (ckpt.wire_dead > WIRE_COMPACT_MIN and 2 * ckpt.wire_dead > len(wire)) or (
            len(items) > 2 * len(index) and len(items) > COMPACT_MIN_SLOTS
        ):
            self._compact(ckpt)  # refunds the dead slots itself
            items = ckpt.items
        ckpt.last_seqno = item.seqno
        mem = self.memory
        mem.used += size
        ckpt.queued += 1
        if (
            ckpt.queued >= self._max_items
            or ckpt.mem >= self._max_bytes
            or len(ckpt.wire) >= _WIRE_MAX
        ):
            self._close_open()
        if mem.used > mem.threshold:
            mem.on_pressure()

    def _compact(self, ckpt: Checkpoint) -> int:
        """Compact ``ckpt``, have its cursors re-placed and refund the removed slots;
        returns the bytes refunded."""
        dead_slots = len(ckpt.items) - len(ckpt.index)
        if not compact_slots(ckpt):
            return 0
        self._on_compacted(ckpt)
        refund = dead_slots * DEAD_SLOT_BYTES
        ckpt.mem -= refund
        self.memory.used -= refund
        return refund

    def queue_snapshot(self, items: list[Item]) -> None:
        """Queue a whole snapshot received from another node into a checkpoint of its
        own: the open one is closed first if it holds anything and after the last item,
        never in between (the size limits wait), so every reader sees the source's
        snapshot boundaries and no boundary the source did not have."""
        if self.open.items:
            self._close_open()
        if not self._queue_fresh(items):
            limits = self._max_items, self._max_bytes
            self._max_items = self._max_bytes = 1 << 62
            try:
                queue = self.queue
                for item in items:
                    queue(item)
            finally:
                self._max_items, self._max_bytes = limits
        if self.open.items:
            self._close_open()
        mem = self.memory
        if mem.used > mem.threshold:
            mem.on_pressure()

    def _queue_fresh(self, items: list[Item]) -> bool:
        """``queue`` for the common snapshot, in one loop: mutations with no body and no
        key twice, into the (empty) open checkpoint, so there is nothing to supersede or
        compact and the accounting is summed once. False (nothing done) for anything
        else: the caller queues item by item."""
        ckpt = self.open
        if ckpt.items or not items:
            return False
        keys = {it.key for it in items}
        if len(keys) != len(items):
            return False
        for it in items:
            if it.op != _MUT or it.body:
                return False
        wire = ckpt.wire
        starts = ckpt.starts
        seqnos = ckpt.seqnos
        kinds = ckpt.kinds
        index = ckpt.index
        slots = ckpt.items
        vbid = self.vbid
        size = 0
        for it in items:
            key = it.key
            value = it.value
            kl = len(key)
            vl = len(value)
            starts.append(len(wire))
            seqnos.append(it.seqno)
            kinds.append(LIVE_FRAME)
            pack = frame_pack(kl, vl)
            if pack is not None:
                wire += pack(
                    _REQ, _MUT, kl, _EXT, it.datatype, vbid, _EXT + kl + vl, 0, it.cas,
                    it.seqno, it.rev_seqno, it.flags, it.expiry, 0, 0, 0, key, value,
                )  # fmt: skip
            else:
                wire += frame_head_extras(
                    _REQ, _MUT, kl, _EXT, it.datatype, vbid, _EXT + kl + vl, 0, it.cas,
                    it.seqno, it.rev_seqno, it.flags, it.expiry, 0, 0, 0,
                )  # fmt: skip
                wire += key
                wire += value
            index[key] = len(slots)
            slots.append(it)
            # as ``queue`` charges a frame: key + value + the DCP body + the overhead
            size += 2 * (kl + vl) + _OVERHEAD - _HDR + ITEM_OVERHEAD
        ckpt.mem += size
        ckpt.last_seqno = items[-1].seqno
        ckpt.queued += len(items)
        self.memory.used += size
        return True

    def create_checkpoint(self) -> int:
        """Close the open checkpoint now (if it holds anything); returns the open id.

        The current high seqno becomes a snapshot boundary for every cursor.
        """
        if self.open.items:
            self._close_open()
        return self.open.id

    def _close_open(self) -> None:
        old = self.open
        old.closed = True
        mem = self.memory
        if mem.retain_seconds:
            old.closed_at = mem.clock()  # type: ignore[misc]
        self._compact(old)
        new = Checkpoint(self._next_id, old.last_seqno + 1)
        self._next_id += 1
        old.next = new
        self.open = new
        self.checkpoints.append(new)
        self._on_closed(old, new)  # cursors at its end move on now, unpinning it
        self.free_unreferenced()

    def free_unreferenced(self, *, retained: bool = False) -> int:
        """Free the oldest closed checkpoints no cursor is in, except those still within
        the retention time (all of them with ``retained``); returns bytes freed."""
        ckpts = self.checkpoints
        freed = 0
        mem = self.memory
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
        for c in self.checkpoints:
            if c.num_cursors or not c.closed:
                break
            n += c.mem
        return n


def compact_slots(ckpt: Checkpoint) -> bool:
    """Remove the superseded slots and frames of ``ckpt``; False when it holds none (it
    is left as it is)."""
    if len(ckpt.items) == len(ckpt.index) and not ckpt.wire_dead:
        return False
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
            new += old[a : a + _HDR + _BODYLEN(old, a + 8)[0]]
    ckpt.items = n_items
    ckpt.starts = n_starts
    ckpt.kinds = n_kinds
    ckpt.seqnos = n_seqnos
    ckpt.wire = new
    ckpt.wire_dead = 0
    ckpt.stamp_from = ckpt.stamp_upto = 0
    ckpt.gen += 1
    return True
