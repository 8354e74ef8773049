"""Values the SDK hands to applications: change events, snapshot batches, offsets.

Rules of this module:
- Per-item events (``Mutation``, ``Deletion``, ``Expiration``, and in raw mode
  ``SnapshotMarker``/``StreamEnd``) are plain slotted classes built positionally (the
  hot path): no validation, no frozen dataclasses. Treat them as read-only. The change
  items are ``dcp.protocol.events``' own classes, which the protocol session builds
  directly: no conversion per item.
- A ``SnapshotBatch`` is one vbucket's *complete* snapshot; it is the unit of delivery
  and of commit. ``commit()`` calls back into the client that delivered it (a coroutine
  for ``DcpClient``, a blocking call for ``BlockingDcpClient``).
- Control values (``Offset``, ``MutationResult``, ``GetResult``) are frozen slotted
  dataclasses, validated once when built.
- No I/O and no trio in this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from dcp.protocol.events import Deletion, Expiration, Mutation
from dcp.protocol.opcodes import SEQNO_MAX, SnapshotMarkerFlag

from .errors import InvalidOffsetError, UsageError

__all__ = [
    "Deletion",
    "Event",
    "Expiration",
    "GetResult",
    "Mutation",
    "MutationResult",
    "Offset",
    "RollbackEvent",
    "SnapshotBatch",
    "SnapshotMarker",
    "StartFrom",
    "StreamEnd",
]

FailoverLog = tuple[tuple[int, int], ...]


class StartFrom(enum.Enum):
    """Where a vbucket without a saved or explicit offset starts."""

    BEGINNING = "beginning"  #: seqno 0: every change the server still has
    NOW = "now"  #: the vbucket's high seqno when the client first connects


Event = Mutation | Deletion | Expiration


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
        return (f"SnapshotMarker(vb={self.vbucket}, start={self.start}, end={self.end}, "
                f"flags=0x{self.flags:02x})")


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
    """

    __slots__ = ("_commit_fn", "_epoch", "_fc", "_gen", "end", "events", "failover_log",
                 "flags", "nbytes", "purge_seqno", "start", "vbucket")
    kind = "snapshot"

    def __init__(
        self, vbucket: int, start: int, end: int, flags: int, events: list, nbytes: int,
        failover_log: FailoverLog, epoch: int, gen: int, fc: Any, commit_fn: Any,
        purge_seqno: int = 0,
    ) -> None:
        self.vbucket = vbucket
        self.start = start
        self.end = end
        self.flags = flags
        self.events = events
        self.nbytes = nbytes
        self.failover_log = failover_log
        self._epoch = epoch
        self._gen = gen
        self._fc = fc
        self._commit_fn = commit_fn
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
        return Offset(self.vbucket, self.vb_uuid, self.end, self.end, self.end,
                      self.failover_log, self.purge_seqno)

    def commit(self) -> Any:
        """Commit this snapshot (and everything before it on this vbucket).

        ``await batch.commit()`` with ``DcpClient``; ``batch.commit()`` with
        ``BlockingDcpClient``. Returns True when the committed position advanced.
        """
        return self._commit_fn(self)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.events)

    def __repr__(self) -> str:
        return (f"SnapshotBatch(vb={self.vbucket}, start={self.start}, end={self.end}, "
                f"flags=0x{self.flags:02x}, events={len(self.events)})")


class RollbackEvent:
    """The server's history of ``vbucket`` diverged from what this client has seen.

    Delivered before the stream resumes. The application must undo (or mark undone)
    every change of this vbucket with seqno > ``rollback_seqno``, then ``commit()`` the
    event (or any later batch of the vbucket) so the new position is saved.

    Attributes:
        vbucket, vb_uuid (the uuid the client asked with), seqno (the start it asked for),
        rollback_seqno, failover_log (the client's log after dropping entries above it).
    """

    __slots__ = ("_commit_fn", "_epoch", "failover_log", "rollback_seqno", "seqno",
                 "vb_uuid", "vbucket")
    kind = "rollback"

    def __init__(
        self, vbucket: int, vb_uuid: int, seqno: int, rollback_seqno: int,
        failover_log: FailoverLog, epoch: int, commit_fn: Any = _not_bound,
    ) -> None:
        self.vbucket = vbucket
        self.vb_uuid = vb_uuid
        self.seqno = seqno
        self.rollback_seqno = rollback_seqno
        self.failover_log = failover_log
        self._epoch = epoch
        self._commit_fn = commit_fn

    @property
    def offset(self) -> Offset:
        s = self.rollback_seqno
        uuid = self.failover_log[0][0] if self.failover_log else 0
        return Offset(self.vbucket, uuid, s, s, s, self.failover_log)

    def commit(self) -> Any:
        """Record that the application has undone everything above ``rollback_seqno``."""
        return self._commit_fn(self)

    def __repr__(self) -> str:
        return (f"RollbackEvent(vb={self.vbucket}, vb_uuid={self.vb_uuid}, seqno={self.seqno}, "
                f"rollback_seqno={self.rollback_seqno})")


def _check_seqno(name: str, value: object) -> None:
    if type(value) is not int or not 0 <= value <= SEQNO_MAX:
        raise InvalidOffsetError(f"{name} must be an int in 0..2**64-1, not {value!r}")


@dataclass(frozen=True, slots=True)
class Offset:
    """A resume position of one vbucket (what an offset store saves).

    ``seqno`` is the last seqno the application has; committed offsets are snapshot
    ends, so ``snap_start == snap_end == seqno``. ``failover_log`` is newest first; when
    it is empty, ``vb_uuid`` stands alone (an offset from outside, e.g. another system).
    """

    vbucket: int
    vb_uuid: int = 0
    seqno: int = 0
    snap_start: int | None = None
    snap_end: int | None = None
    failover_log: FailoverLog = field(default=())
    purge_seqno: int = 0

    def __post_init__(self) -> None:
        if type(self.vbucket) is not int or not 0 <= self.vbucket <= 0xFFFF:
            raise InvalidOffsetError(f"vbucket must be an int in 0..65535, not {self.vbucket!r}")
        _check_seqno("vb_uuid", self.vb_uuid)
        _check_seqno("seqno", self.seqno)
        if self.snap_start is None:
            object.__setattr__(self, "snap_start", self.seqno)
        if self.snap_end is None:
            object.__setattr__(self, "snap_end", self.seqno)
        _check_seqno("snap_start", self.snap_start)
        _check_seqno("snap_end", self.snap_end)
        _check_seqno("purge_seqno", self.purge_seqno)
        if not self.snap_start <= self.seqno <= self.snap_end:  # type: ignore[operator]
            raise InvalidOffsetError(
                f"vbucket {self.vbucket}: need snap_start <= seqno <= snap_end, got "
                f"{self.snap_start} <= {self.seqno} <= {self.snap_end}"
            )
        log = tuple((int(u), int(s)) for u, s in self.failover_log)
        for u, s in log:
            _check_seqno("failover log uuid", u)
            _check_seqno("failover log seqno", s)
        object.__setattr__(self, "failover_log", log)
        if log and self.vb_uuid == 0:
            object.__setattr__(self, "vb_uuid", log[0][0])
        elif log and self.vb_uuid != log[0][0]:
            raise InvalidOffsetError(
                f"vbucket {self.vbucket}: vb_uuid {self.vb_uuid} is not the newest failover "
                f"log entry {log[0][0]}"
            )

    @classmethod
    def beginning(cls, vbucket: int) -> Offset:
        return cls(vbucket)

    def to_json(self) -> dict[str, Any]:
        return {
            "vb_uuid": self.vb_uuid, "seqno": self.seqno, "snap_start": self.snap_start,
            "snap_end": self.snap_end, "purge_seqno": self.purge_seqno,
            "failover_log": [[u, s] for u, s in self.failover_log],
        }

    @classmethod
    def from_json(cls, vbucket: int, obj: Any) -> Offset:
        if not isinstance(obj, dict):
            raise InvalidOffsetError(f"vbucket {vbucket}: offset must be an object, not {obj!r}")
        try:
            log = tuple((u, s) for u, s in obj.get("failover_log", ()))
            return cls(
                vbucket, obj.get("vb_uuid", 0), obj["seqno"], obj.get("snap_start"),
                obj.get("snap_end"), log, obj.get("purge_seqno", 0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidOffsetError):
                raise
            raise InvalidOffsetError(f"vbucket {vbucket}: malformed offset {obj!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class MutationResult:
    """Outcome of a write: the document's new CAS and, when the server reports it, the
    vbucket uuid and seqno of the change (HELLO MutationSeqno)."""

    key: bytes
    vbucket: int
    cas: int
    vb_uuid: int | None = None
    seqno: int | None = None


@dataclass(frozen=True, slots=True)
class GetResult:
    key: bytes
    value: bytes
    flags: int
    cas: int
    datatype: int
