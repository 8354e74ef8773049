"""What replication needs from the node it feeds (``ReplicaTarget``) and what it is told
to do (``Assignment``).

Rules of this module:
- Interfaces only, no behaviour: the server implements ``ReplicaTarget`` over its engine
  (one ``VBucket`` per vbucket); tests implement it in memory. The replication code
  (``manager.py``, ``source.py``) talks to the node through this protocol alone, so it
  never reaches into the engine's vbuckets, storage or streams.
- Every method but ``rollback`` is synchronous and called from the event loop; each
  must be quick (memory work; persistence is the flusher's). ``rollback`` may touch
  the disk, so it is async (the implementation moves blocking work to a thread).
- ``apply_snapshot`` gets WHOLE snapshots only, in seqno order, exactly as the source
  sent them (seqno, CAS, revision, flags, expiry, delete time unchanged). It raises
  ``ValueError`` (the engine's ``ReplicationError``) with nothing changed when the
  snapshot is not acceptable, or a ``StatusError`` (``NotMyVbucket``, a storage
  ``TemporaryFailure``); the caller treats both as a failed stream and retries.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from ...protocol.opcodes import VBucketState
from ..engine.item import Item

__all__ = ["Assignment", "Position", "ReplicaTarget"]

#: what a replica's stream request sends: (start, snap_start, snap_end, vb_uuid)
Position = tuple[int, int, int, int]


class Assignment(NamedTuple):
    """The desired state of one vbucket on this node.

    ``source`` ("HOST:PORT") is the node holding the active copy; with state replica or
    pending the vbucket is fed from it. ``takeover`` asks for a TAKEOVER stream: when
    the source hands the vbucket over, it becomes active here (and dead there).
    """

    state: VBucketState
    source: str | None = None
    takeover: bool = False


class ReplicaTarget(Protocol):
    """The node replication writes into (see the module rules)."""

    #: this node's address "HOST:PORT", used in replication connection names
    node_name: str

    def state(self, vb: int) -> VBucketState:
        """The vbucket's current state."""
        ...

    def set_state(self, vb: int, state: VBucketState, *, takeover: bool = False) -> None:
        """Change the vbucket's state; ``takeover``: the change is a hand-over from the
        source (becoming active then adds no failover entry). Also ends this node's
        producer streams of the vbucket (STREAM_END state-changed)."""
        ...

    def position(self, vb: int) -> Position:
        """``(start, snap_start, snap_end, vb_uuid)`` for the next stream request."""
        ...

    def persisted_seqno(self, vb: int) -> int:
        """The highest seqno of the vbucket on disk (what a SEQNO_ACKNOWLEDGED reports as
        persisted, acks.py)."""
        ...

    def adopt_failover_log(self, vb: int, entries: list[tuple[int, int]]) -> None:
        """The source accepted the stream: take its failover log (newest first)."""
        ...

    def apply_snapshot(self, vb: int, start: int, end: int, flags: int, items: list[Item]) -> None:
        """Apply one whole snapshot (see the module rules for what it raises)."""
        ...

    async def rollback(self, vb: int, seqno: int) -> int:
        """Roll the vbucket back to at most ``seqno``; returns the seqno it now holds
        (0: emptied, a full re-sync follows)."""
        ...
