"""The entries of an ``ActiveStream``'s send queue, and how memory snapshots become them.

Rules of this module:
- A stream's queue holds, in sending order: a ``Marker`` (a snapshot marker to write),
  then that snapshot's segments (``list[Item]`` or a ``WireRun``), and, after a disk
  backfill, ``BACKFILL_DONE``. active_stream.py sends them; this module only builds them.
- ``queue_memory`` copies the next snapshots out of the checkpoint (``take_wire``, or
  ``take`` for streams that strip values and encode each frame) at once, so later
  deduplication cannot change what a marker promised. It keeps seqnos in
  ``(skip, end]`` (``skip``: what a disk backfill already covered) while a marker keeps
  the snapshot's real end, even past ``end``: a client that asked for a cut inside a
  snapshot can see that its cut is not a consistent point. It stops after the snapshot
  that reaches ``end``. Synchronous; nothing here awaits.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .engine.checkpoint import WireRun
from .stream_frames import cut_segments

__all__ = ["BACKFILL_DONE", "Marker", "queue_memory"]

#: items (or frames) taken from the checkpoint per read
TAKE_ITEMS = 4096

#: the end of a disk backfill's snapshot (its items were all pushed before it)
BACKFILL_DONE = object()


class Marker:
    """A snapshot marker waiting in a stream's queue."""

    __slots__ = ("end", "flags", "start")

    def __init__(self, start: int, end: int, flags: int) -> None:
        self.start = start
        self.end = end
        self.flags = flags


def queue_memory(
    checkpoints: Any, cursor: Any, q: deque[Any], skip: int, end: int, *, no_value: bool
) -> int:
    """Append the next memory snapshots after ``cursor`` to ``q``. Returns the highest
    seqno (at most ``end``) now queued for sending, 0 when nothing was queued."""
    last = 0
    if no_value:
        for snap in checkpoints.take(cursor, TAKE_ITEMS) or ():
            items = snap.items
            s_end = snap.end
            if s_end <= skip:
                continue
            if items and items[0].seqno <= skip:
                items = [it for it in items if it.seqno > skip]
            if s_end > end:
                items = [it for it in items if it.seqno <= end]
            if not items:
                continue
            q.append(Marker(items[0].seqno, s_end, int(snap.flags)))
            q.append(items)
            last = min(s_end, end)
            if s_end >= end:
                break
        return last
    for ws in checkpoints.take_wire(cursor, TAKE_ITEMS) or ():
        s_end = ws.end
        if s_end <= skip:
            continue
        segs = ws.segments
        if ws.start <= skip or s_end > end:
            segs = cut_segments(segs, skip, end)  # keep (skip, end]
            if not segs:
                continue
        first = segs[0]
        start = first.seqno(0) if first.__class__ is WireRun else first.seqno
        q.append(Marker(start, s_end, ws.flags))
        group: list[Any] | None = None
        for seg in segs:
            if seg.__class__ is WireRun:
                group = None
                q.append(seg)
            elif group is None:
                group = [seg]
                q.append(group)
            else:
                group.append(seg)
        last = min(s_end, end)
        if s_end >= end:
            break
    return last
