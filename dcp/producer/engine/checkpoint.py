"""Checkpoints, their wire log, cursor positions and the snapshots read from them.

Rules of this module:
- A checkpoint is a list of items in seqno order plus a dict key -> slot. Only the
  *open* checkpoint deduplicates: a newer item for a key it holds sets the old slot to
  ``None`` and is appended (appending beats removing from the middle of a list). Superseded
  slots are removed only by compaction (``CheckpointManager``), which bumps ``gen`` and
  re-places every cursor in the checkpoint from its ``last_seqno``: ``seqnos`` keeps each
  slot's seqno (ascending), so "the slot after seqno s" is a bisection whatever was
  removed. A position handed out earlier (``peek``) carries the ``gen`` it was taken at
  and is re-placed the same way when it comes back.
- Checkpoints are chained oldest -> newest through ``next``; reads from a cursor's
  position (``checkpoint_reads.py``) walk that chain.
- A ``Cursor`` is a passive record of a position: only its ``CheckpointManager`` moves
  it (kv_engine's split: the manager owns every cursor move, so the bookkeeping below
  has one writer). Reads hand out WHOLE snapshots only. A snapshot ends at a consistent
  point: the end of a closed checkpoint or the open checkpoint's last item *at take()
  time*, and its items are copied out then, so later dedup cannot change what was
  handed out. A snapshot ending in the middle of a checkpoint could miss an item
  deduplicated by a later one, which is why ``max_items`` is a soft limit that never
  splits a snapshot.
- ``num_cursors`` on each checkpoint counts the cursors positioned in it; the manager
  keeps it right on every move, since it decides when a closed checkpoint may be freed.
- The wire log: a checkpoint also keeps the DCP_MUTATION frame of every mutation slot,
  encoded once at queue time with opaque 0, back to back in one ``bytearray`` (``wire``;
  ``starts`` holds each slot's offset; a frame's length and seqno are read from its own
  header and extras when needed). Streams read runs of live mutation slots as byte
  ranges (``CheckpointManager.take_wire``), so sending a snapshot is a few copies of
  contiguous memory plus a 4-byte opaque patch per frame, and never touches the items
  (scattered in memory: per-item reads were the cost; perf notes in docs/benchmarks.md).
  ``kinds`` has one byte per slot: 1 a live mutation (its frame is in the wire), 2 a
  live other item (deletion, expiration: encoded per stream), 0 superseded; runs are
  found with ``bytearray.find`` (C speed), and superseded or other slots break them.
  The wire is append-only; compaction (``CheckpointManager``) replaces it with a new
  object, and captured runs keep the old one alive, so what a run promised never
  changes. Only the 4 opaque bytes of a frame are ever rewritten: the first stream to
  send a contiguous range stamps its opaque into the wire itself (``stamp_*``), and
  streams with the same opaque (consumers built alike ask for the same one) then copy
  that range without touching each frame; any other stream patches its own copy.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_right
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...protocol.layout import HDR_MUTATION, HEADER, HEADER_SIZE, MUTATION_EXTRAS, U32, U64
from ...protocol.opcodes import Magic, Opcode

if TYPE_CHECKING:
    from .item import Item

__all__ = ["Checkpoint", "Cursor", "CursorRegistration", "Snapshot", "WireRun", "WireSnapshot"]

#: ``Checkpoint.kinds`` values
DEAD = 0
LIVE_FRAME = 1
LIVE_OTHER = 2
DEAD_BYTE = bytes([DEAD])
OTHER_BYTE = bytes([LIVE_OTHER])
_BODYLEN = U32.unpack_from  # at a frame's offset + 8
_SEQNO = U64.unpack_from  # a mutation's by_seqno, at offset + HEADER_SIZE

# Encoding of the wire log's frames (``CheckpointManager.queue``): opaque 0, a stream
# patches its own in. The layouts are dcp/protocol/layout.py's.
MUTATION = int(Opcode.DCP_MUTATION)
REQUEST = int(Magic.REQUEST)
#: extras length of a DCP_MUTATION (by seqno, rev seqno, flags, expiry, lock, nmeta, nru)
MUTATION_EXTLEN = MUTATION_EXTRAS.size
frame_head = HEADER.pack
frame_head_extras = HDR_MUTATION.pack  # + mutation extras
#: (key length, value length) -> pack of a whole mutation frame (header, extras, key,
#: value) in one call; bounded, sizes beyond it are packed in three steps
_FRAME_PACKS: dict[tuple[int, int], Callable[..., bytes]] = {}
_FRAME_PACKS_MAX = 4096


def frame_pack(kl: int, vl: int) -> Callable[..., bytes] | None:
    """The one-call packer of a mutation frame with these key/value lengths (None once
    the cache is full: the caller packs the header, key and value separately)."""
    pack = _FRAME_PACKS.get((kl, vl))
    if pack is None and len(_FRAME_PACKS) < _FRAME_PACKS_MAX:
        pack = _FRAME_PACKS[(kl, vl)] = struct.Struct(f"{HDR_MUTATION.format}{kl}s{vl}s").pack
    return pack


class Checkpoint:
    """One chunk of a vbucket's change queue.

    ``start_seqno`` is the first seqno this checkpoint may hold (the previous one's last
    seqno + 1), ``last_seqno`` the seqno of its last item (``start_seqno - 1`` if empty).
    """

    __slots__ = (
        "closed",
        "closed_at",
        "gen",
        "id",
        "index",
        "items",
        "kinds",
        "last_seqno",
        "mem",
        "next",
        "num_cursors",
        "queued",
        "seqnos",
        "stamp_from",
        "stamp_opaque",
        "stamp_upto",
        "start_seqno",
        "starts",
        "wire",
        "wire_dead",
    )

    def __init__(self, ckpt_id: int, start_seqno: int) -> None:
        self.id = ckpt_id
        self.start_seqno = start_seqno
        self.last_seqno = start_seqno - 1
        self.items: list[Item | None] = []
        self.index: dict[bytes, int] = {}
        self.mem = 0
        self.num_cursors = 0
        self.next: Checkpoint | None = None
        self.closed = False
        self.closed_at = -1.0  # clock time it closed (retention only; see checkpoint_manager)
        self.queued = 0  # items queued into it, superseded ones included (closing rule)
        # the wire log (module rules): frames of mutation slots, per-slot offsets/seqnos
        self.wire = bytearray()
        self.starts = array("I")  # per slot: offset of its frame in ``wire`` (< 4 GiB)
        self.kinds = bytearray()  # per slot: LIVE_FRAME, LIVE_OTHER or DEAD
        self.seqnos = array("Q")  # per slot: its item's seqno (ascending, dead slots too)
        self.gen = 0  # bumped when compaction removes slots (offsets change)
        self.wire_dead = 0  # bytes of superseded frames still in ``wire``
        # live frames starting in [stamp_from, stamp_upto) of ``wire`` carry stamp_opaque
        self.stamp_from = 0
        self.stamp_upto = 0
        self.stamp_opaque = b""

    def release(self) -> None:
        """Drop everything (the checkpoint was freed); captured runs keep their wire."""
        self.items = []
        self.index = {}
        self.wire = bytearray()
        self.starts = array("I")
        self.kinds = bytearray()
        self.seqnos = array("Q")
        self.gen += 1
        self.wire_dead = 0
        self.stamp_from = self.stamp_upto = 0

    def segments(self, a: int, b: int) -> tuple[list[WireRun | Item], int, int]:
        """Live slots ``[a, b)`` as runs of wire frames and single other items, in slot
        order; also their count and the first live seqno. ``b - 1`` must be live."""
        kinds = self.kinds
        find = kinds.find
        items = self.items
        starts = self.starts
        wire = self.wire
        segs: list[WireRun | Item] = []
        count = 0
        first = -1
        s = a
        while s < b:
            k = kinds[s]
            if k == LIVE_FRAME:
                stop = find(DEAD_BYTE, s, b)
                other = find(OTHER_BYTE, s, stop if stop >= 0 else b)
                if other >= 0:
                    stop = other
                elif stop < 0:
                    stop = b
                last = starts[stop - 1]
                segs.append(
                    WireRun(
                        self, wire, starts[s:stop], last + HEADER_SIZE + _BODYLEN(wire, last + 8)[0]
                    )
                )
                count += stop - s
                if first < 0:
                    first = _SEQNO(wire, starts[s] + HEADER_SIZE)[0]
                s = stop
                continue
            if k == LIVE_OTHER:
                it = items[s]
                segs.append(it)  # type: ignore[arg-type]
                count += 1
                if first < 0:
                    first = it.seqno  # type: ignore[union-attr]
            s += 1
        return segs, count, first

    @property
    def num_items(self) -> int:
        """Live (not superseded) items."""
        return len(self.index)

    def offset_after(self, seqno: int) -> int:
        """Slot of the first item with a seqno above ``seqno`` (len(items) if none)."""
        return bisect_right(self.seqnos, seqno)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"Checkpoint(id={self.id}, {state}, seqnos {self.start_seqno}.."
            f"{self.last_seqno}, {self.num_items} items, {self.mem} B)"
        )


class Snapshot:
    """A range of seqnos and the items in it, as one snapshot marker announces them."""

    __slots__ = ("end", "flags", "items", "start")

    def __init__(self, start: int, end: int, flags: int, items: list[Item]) -> None:
        self.start = start
        self.end = end
        self.flags = flags
        self.items = items

    def __repr__(self) -> str:
        return (
            f"Snapshot({self.start}..{self.end}, flags=0x{self.flags:02x}, {len(self.items)} items)"
        )


class WireRun:
    """Consecutive live mutation frames of one checkpoint's wire, captured at take time:
    ``starts`` are their offsets in ``wire`` (frame i ends where i + 1 starts; the last
    ends at ``end``). Frames carry opaque 0: a stream patches its own opaque into its
    copy. Read-only once made. A run read from disk (``BackfillScan.read_frames``) has
    ``ckpt`` None: it belongs to one stream and already carries that stream's opaque."""

    __slots__ = ("ckpt", "end", "starts", "wire")

    def __init__(self, ckpt: Checkpoint | None, wire: bytearray, starts: array, end: int) -> None:
        self.ckpt = ckpt
        self.wire = wire
        self.starts = starts
        self.end = end

    def __len__(self) -> int:
        return len(self.starts)

    def seqno(self, i: int) -> int:
        """By-seqno of frame ``i`` (from its extras)."""
        return _SEQNO(self.wire, self.starts[i] + HEADER_SIZE)[0]

    def count_upto(self, seqno: int) -> int:
        """How many frames have a seqno <= ``seqno`` (frames are in seqno order)."""
        lo, hi = 0, len(self.starts)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.seqno(mid) <= seqno:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def cut(self, lo: int, hi: int) -> WireRun:
        """Frames ``[lo, hi)`` of this run."""
        end = self.starts[hi] if hi < len(self.starts) else self.end
        return WireRun(self.ckpt, self.wire, self.starts[lo:hi], end)

    def __repr__(self) -> str:
        if not self.starts:
            return "WireRun(empty)"
        return (
            f"WireRun({len(self.starts)} frames, seqnos {self.seqno(0)}.."
            f"{self.seqno(len(self.starts) - 1)})"
        )


class WireSnapshot:
    """A snapshot as ``take_wire`` hands it out: ``segments`` are ``WireRun``s and the
    ``Item``s that are not in the wire (deletions, expirations), in seqno order."""

    __slots__ = ("count", "end", "flags", "segments", "start")

    def __init__(self, start: int, end: int, flags: int, segments: list, count: int) -> None:
        self.start = start
        self.end = end
        self.flags = flags
        self.segments = segments
        self.count = count

    def __repr__(self) -> str:
        return (
            f"WireSnapshot({self.start}..{self.end}, flags=0x{self.flags:02x}, "
            f"{self.count} items in {len(self.segments)} segments)"
        )


class Cursor:
    """A named reader's position in one vbucket's checkpoints (a stream or the
    persistence cursor): a plain record, moved only by its ``CheckpointManager``
    (``take``, ``take_wire``, ``advance_to``...); everyone else reads it.

    ``checkpoint``/``offset``: the slot of the next read (``checkpoint`` None once the
    cursor was removed or dropped). ``last_seqno`` is the end of the last snapshot handed
    out (or the registration seqno). ``dropped`` becomes True when memory pressure
    dropped the cursor: the manager hands it nothing more and the stream must backfill.
    """

    __slots__ = ("checkpoint", "dropped", "last_seqno", "name", "offset")

    def __init__(self, name: str, checkpoint: Checkpoint, offset: int, last_seqno: int) -> None:
        self.name = name
        self.dropped = False
        self.last_seqno = last_seqno
        self.checkpoint: Checkpoint | None = checkpoint
        self.offset = offset

    @property
    def position(self) -> tuple[int, int]:
        """(checkpoint id, slot offset) of the next read; (-1, -1) once dropped."""
        if self.checkpoint is None:
            return (-1, -1)
        return (self.checkpoint.id, self.offset)

    @property
    def checkpoint_id(self) -> int:
        return -1 if self.checkpoint is None else self.checkpoint.id

    def __repr__(self) -> str:
        flag = " dropped" if self.dropped else ""
        return f"Cursor({self.name!r}, last_seqno={self.last_seqno}, at={self.position}{flag})"


class CursorRegistration:
    """Result of ``register_cursor``.

    ``backfill`` False: memory holds every item (or its dedup successor) after the
    requested seqno and the cursor is placed right after it. ``backfill`` True: memory
    no longer reaches back that far; the cursor sits at the start of memory and the
    stream must first backfill from disk (up to the disk's persisted seqno P, which is
    >= the memory start - 1), then read the cursor skipping items with seqno <= P.
    """

    __slots__ = ("backfill", "cursor")

    def __init__(self, cursor: Cursor, backfill: bool) -> None:
        self.cursor = cursor
        self.backfill = backfill

    def __repr__(self) -> str:
        return f"CursorRegistration({self.cursor!r}, backfill={self.backfill})"
