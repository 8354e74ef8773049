"""What ``DcpClient`` delivers: snapshot batches, rollback events and (raw mode) events.

Rules of this module:
- Per-item events (``Mutation``, ``Deletion``, ``Expiration``, and in raw mode
  ``SnapshotMarker``/``StreamEnd``) are plain slotted classes built positionally (the
  hot path): no validation, no frozen dataclasses. Treat them as read-only. The change
  items are ``dcp.protocol.events``' own classes, which the protocol session builds
  directly: no conversion per item.
- A ``SnapshotBatch`` is one vbucket's *complete* snapshot; it is the unit of delivery
  and of commit. ``commit()`` calls back into the client that delivered it (a coroutine
  for ``DcpClient``, a blocking call for ``BlockingDcpClient``): ``commit_fn``.
- A batch also carries the delivering client's bookkeeping: the rollback ``epoch`` and
  stream generation (``gen``) it was streamed under (``positions.Session`` accepts
  commits of the current ones only) and the connection's ``flow`` control, whose window
  its bytes occupy until it is handed out. The client sets these; applications leave
  them alone.
- No I/O and no trio in this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from dcp.protocol.events import Deletion, Expiration, Mutation
from dcp.protocol.flow_control import FlowControl
from dcp.protocol.opcodes import SnapshotMarkerFlag

from .errors import UsageError
from .offset import FailoverLog, Offset

__all__ = [
    "CommitFn",
    "Deletion",
    "Event",
    "Expiration",
    "Mutation",
    "RollbackEvent",
    "SnapshotBatch",
    "SnapshotMarker",
    "StreamEnd",
]

Event = Mutation | Deletion | Expiration
#: What ``commit()`` of a batch or rollback event calls, with the item: ``DcpClient.commit``
#: (returns a coroutine) or ``BlockingDcpClient.commit`` (returns a bool).
CommitFn = Callable[[Any], Any]


class SnapshotMarker:
    """Raw mode only: a snapshot marker as it arrived."""

    __slots__ = ("end", "flags", "start", "vbucket")
    kind = "snapshot_marker"

    def __init__(self, vbucket: int, start: int, end: int, flags: int) -> None:
        self.vbucket = vbucket
        self.start = start
        self.end = end
        self.flags = flags

    def __repr__(self) -> str:
        return (
            f"SnapshotMarker(vb={self.vbucket}, start={self.start}, end={self.end}, "
            f"flags=0x{self.flags:02x})"
        )


class StreamEnd:
    """Raw mode only: the server ended a stream (``reason`` is a ``StreamEndStatus``)."""

    __slots__ = ("reason", "vbucket")
    kind = "stream_end"

    def __init__(self, vbucket: int, reason: int) -> None:
        self.vbucket = vbucket
        self.reason = reason

    def __repr__(self) -> str:
        return f"StreamEnd(vb={self.vbucket}, reason={self.reason})"


def _not_bound(_item: object) -> Any:
    raise UsageError("this item was not delivered by a client, so it cannot be committed")


class SnapshotBatch:
    """One vbucket's complete snapshot: every change in ``[start, end]`` the server sent.

    Attributes:
        vbucket: the vbucket.
        start, end: the snapshot range (``end`` is the commit point).
        flags: snapshot marker flags (see ``is_memory``/``is_disk``/``is_history``).
        events: the mutations/deletions/expirations in seqno order (may be empty).
        nbytes: wire bytes of the snapshot (what flow control counted).
        purge_seqno: the server's purge seqno if a v2.2 marker reported one, else 0.
        epoch, gen, flow, commit_fn: the delivering client's bookkeeping (module rules).
    """

    __slots__ = (
        "commit_fn",
        "end",
        "epoch",
        "events",
        "failover_log",
        "flags",
        "flow",
        "gen",
        "nbytes",
        "purge_seqno",
        "start",
        "vbucket",
    )
    kind = "snapshot"

    def __init__(
        self,
        vbucket: int,
        start: int,
        end: int,
        flags: int,
        events: list[Event],
        nbytes: int,
        failover_log: FailoverLog,
        epoch: int,
        gen: int,
        flow: FlowControl,
        commit_fn: CommitFn = _not_bound,
        purge_seqno: int = 0,
    ) -> None:
        self.vbucket = vbucket
        self.start = start
        self.end = end
        self.flags = flags
        self.events = events
        self.nbytes = nbytes
        self.failover_log = failover_log
        self.epoch = epoch
        self.gen = gen
        self.flow = flow
        self.commit_fn = commit_fn
        self.purge_seqno = purge_seqno

    @property
    def vb_uuid(self) -> int:
        """The newest vbucket uuid of the failover log this snapshot was streamed under."""
        return self.failover_log[0][0] if self.failover_log else 0

    @property
    def is_memory(self) -> bool:
        return bool(self.flags & SnapshotMarkerFlag.MEMORY)

    @property
    def is_disk(self) -> bool:
        return bool(self.flags & SnapshotMarkerFlag.DISK)

    @property
    def is_history(self) -> bool:
        return bool(self.flags & SnapshotMarkerFlag.HISTORY)

    @property
    def offset(self) -> Offset:
        """The position after this snapshot (what committing it stores)."""
        return Offset(
            self.vbucket,
            self.vb_uuid,
            self.end,
            self.end,
            self.end,
            self.failover_log,
            self.purge_seqno,
        )

    def commit(self) -> Any:
        """Commit this snapshot (and everything before it on this vbucket).

        ``await batch.commit()`` with ``DcpClient``; ``batch.commit()`` with
        ``BlockingDcpClient``. Returns True when the committed position advanced.
        """
        return self.commit_fn(self)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __repr__(self) -> str:
        return (
            f"SnapshotBatch(vb={self.vbucket}, start={self.start}, end={self.end}, "
            f"flags=0x{self.flags:02x}, events={len(self.events)})"
        )


class RollbackEvent:
    """The server's history of ``vbucket`` diverged from what this client has seen.

    Delivered before the stream resumes. The application must undo (or mark undone)
    every change of this vbucket with seqno > ``rollback_seqno``, then ``commit()`` the
    event (or any later batch of the vbucket) so the new position is saved.

    Attributes:
        vbucket, vb_uuid (the uuid the client asked with), seqno (the start it asked for),
        rollback_seqno, failover_log (the client's log after dropping entries above it).
        epoch, commit_fn: the delivering client's bookkeeping (module rules).
    """

    __slots__ = (
        "commit_fn",
        "epoch",
        "failover_log",
        "rollback_seqno",
        "seqno",
        "vb_uuid",
        "vbucket",
    )
    kind = "rollback"

    def __init__(
        self,
        vbucket: int,
        vb_uuid: int,
        seqno: int,
        rollback_seqno: int,
        failover_log: FailoverLog,
        epoch: int,
        commit_fn: CommitFn = _not_bound,
    ) -> None:
        self.vbucket = vbucket
        self.vb_uuid = vb_uuid
        self.seqno = seqno
        self.rollback_seqno = rollback_seqno
        self.failover_log = failover_log
        self.epoch = epoch
        self.commit_fn = commit_fn

    @property
    def offset(self) -> Offset:
        s = self.rollback_seqno
        uuid = self.failover_log[0][0] if self.failover_log else 0
        return Offset(self.vbucket, uuid, s, s, s, self.failover_log)

    def commit(self) -> Any:
        """Record that the application has undone everything above ``rollback_seqno``."""
        return self.commit_fn(self)

    def __repr__(self) -> str:
        return (
            f"RollbackEvent(vb={self.vbucket}, vb_uuid={self.vb_uuid}, seqno={self.seqno}, "
            f"rollback_seqno={self.rollback_seqno})"
        )
