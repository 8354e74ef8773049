"""Per-stream receive state: the snapshot being assembled for one vbucket stream.

Rules of this module:
- Nothing of a snapshot leaves this buffer before the snapshot is complete. A snapshot
  is complete when (a) an item with seqno >= its end arrives, (b) the next snapshot
  marker of the same stream arrives (the items up to the end were deduplicated away),
  (c) STREAM_END(OK) arrives (the stream reached its end seqno), or (d) a
  SEQNO_ADVANCED reaches the end. Disk and memory snapshots follow the same rule.
- A snapshot's end is clamped to the stream's end seqno, so a finite stream's last
  batch ends exactly where the stream ends.
- A partial snapshot is discarded (never delivered) when its stream ends for any other
  reason or its connection is lost; the stream is then requested again from the last
  committed point.
- The reader's hot loop appends to ``items`` and adds to ``held`` directly; this class
  only holds state and does the (rare) transitions. No I/O.
"""

from __future__ import annotations

import enum
from typing import Any

from .structs import SnapshotBatch

__all__ = ["StreamBuffer", "StreamState"]

FailoverLog = tuple[tuple[int, int], ...]


class StreamState(enum.IntEnum):
    """REQUESTED --OK--> STREAMING --STREAM_END--> (removed)
    REQUESTED --ROLLBACK/error--> (removed; re-requested or failed)"""

    REQUESTED = 0
    STREAMING = 1


class StreamBuffer:
    """One vbucket stream on one connection, and its snapshot in progress."""

    __slots__ = (
        "asked_seqno", "asked_uuid", "end", "end_seqno", "epoch", "flags", "gen", "held",
        "items", "log", "opaque", "open", "purge_seqno", "start", "state", "vbucket",
    )

    def __init__(
        self, vbucket: int, opaque: int, epoch: int, gen: int, end_seqno: int,
        asked_uuid: int, asked_seqno: int,
    ) -> None:
        self.vbucket = vbucket
        self.opaque = opaque
        self.epoch = epoch
        self.gen = gen
        self.end_seqno = end_seqno
        self.asked_uuid = asked_uuid
        self.asked_seqno = asked_seqno
        self.state = StreamState.REQUESTED
        self.log: FailoverLog = ()
        self.start = 0
        self.end = 0
        self.flags = 0
        self.items: list = []
        self.held = 0  # wire bytes of the partial snapshot not yet released to flow control
        self.open = False  # a marker arrived and its snapshot is not complete yet
        self.purge_seqno = 0

    def begin(self, start: int, end: int, flags: int) -> None:
        """A snapshot marker arrived (the previous snapshot must be completed first)."""
        self.start = start
        self.end = end if end < self.end_seqno else self.end_seqno
        self.flags = flags
        self.open = True

    def complete(self, fc: Any, commit_fn: Any) -> SnapshotBatch:
        """The snapshot is whole: build its batch and move its bytes held -> queued."""
        held = self.held
        batch = SnapshotBatch(
            self.vbucket, self.start, self.end, self.flags, self.items, held, self.log,
            self.epoch, self.gen, fc, commit_fn, self.purge_seqno,
        )
        fc.held -= held
        fc.queued += held
        self.items = []
        self.held = 0
        self.open = False
        return batch

    def discard(self, fc: Any) -> None:
        """Drop the partial snapshot; its bytes count as processed for flow control."""
        fc.held -= self.held
        fc.ackable += self.held
        self.items = []
        self.held = 0
        self.open = False

    def __repr__(self) -> str:
        return (f"StreamBuffer(vb={self.vbucket}, opaque={self.opaque}, state={self.state.name}, "
                f"snapshot=[{self.start},{self.end}] open={self.open} items={len(self.items)})")
