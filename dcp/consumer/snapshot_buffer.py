"""Per-stream receive state: the snapshot being assembled for one vbucket stream.

Rules of this module:
- Nothing of a snapshot leaves this buffer before the snapshot is complete. When a
  snapshot is complete (an item at its end, the next marker, SEQNO_ADVANCED reaching
  its end, STREAM_END(OK)) is decided by the protocol session
  (``dcp.protocol.session``), which also clamps a snapshot's end to the stream's end
  seqno and does the flow-control accounting; this buffer collects the items and the
  marker fields the batch carries.
- A partial snapshot is discarded (never delivered) when its stream ends for any other
  reason or its connection is lost; the stream is then requested again from the last
  committed point.
- State and the rare transitions only. No I/O.
"""

from __future__ import annotations

import enum

from dcp.protocol.flow_control import FlowControl

from .batches import CommitFn, Event, SnapshotBatch

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
        "asked_seqno",
        "asked_uuid",
        "end",
        "end_seqno",
        "epoch",
        "flags",
        "gen",
        "items",
        "log",
        "opaque",
        "purge_seqno",
        "start",
        "state",
        "vbucket",
    )

    def __init__(
        self,
        vbucket: int,
        opaque: int,
        epoch: int,
        gen: int,
        end_seqno: int,
        asked_uuid: int,
        asked_seqno: int,
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
        self.items: list[Event] = []
        self.purge_seqno = 0

    def begin(self, start: int, end: int, flags: int, purge_seqno: int | None) -> None:
        """A snapshot marker arrived (``end`` already clamped by the session)."""
        self.start = start
        self.end = end
        self.flags = flags
        if purge_seqno is not None:
            self.purge_seqno = purge_seqno

    def complete(self, nbytes: int, fc: FlowControl, commit_fn: CommitFn) -> SnapshotBatch:
        """The snapshot is whole (its ``nbytes`` are queued in ``fc``): build its batch."""
        batch = SnapshotBatch(
            self.vbucket,
            self.start,
            self.end,
            self.flags,
            self.items,
            nbytes,
            self.log,
            self.epoch,
            self.gen,
            fc,
            commit_fn,
            self.purge_seqno,
        )
        self.items = []
        return batch

    def discard(self) -> None:
        """Drop the partial snapshot (the session made its bytes ackable)."""
        self.items = []

    def __repr__(self) -> str:
        return (
            f"StreamBuffer(vb={self.vbucket}, opaque={self.opaque}, state={self.state.name}, "
            f"snapshot=[{self.start},{self.end}] items={len(self.items)})"
        )
