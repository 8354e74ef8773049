"""A vbucket's replica half: applying its source's snapshots, adopting its failover log,
the stream-request position, the reset after a rollback; and what a snapshot must be.

Rules of this module:
- ``ReplicaVBucket`` is a base of ``VBucket`` (vbucket.py, the KV half): the methods only
  a replica uses live here so each file stays readable. It has no state of its own; it
  reads and writes the vbucket's attributes exactly as ``VBucket``'s own methods do (the
  annotations below list them) and is never used alone.
- A replica applies whole snapshots only (``apply_snapshot``), each exactly as the
  source sent it; ``check_snapshot`` decides whether a snapshot may be applied at all.
  It is pure: a refused snapshot changes nothing.
- Accepted: ``start <= end``; every item of this vbucket; seqnos strictly increasing,
  above the replica's high seqno and within ``[start, end]``; the end not below the
  high seqno. Anything else is ``ReplicationError`` naming the first offence: the
  source (or the connection) is broken, and applying part of it would corrupt the copy.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ...protocol.errors import NotMyVbucket
from ...protocol.opcodes import Status, VBucketState
from .checkpoint_manager import CheckpointManager, CheckpointMemory
from .errors import ReplicationError
from .item import Item, ItemOp

if TYPE_CHECKING:
    from .config import EngineConfig
    from .failover import FailoverTable

__all__ = ["ReplicaVBucket", "check_snapshot"]

_ACTIVE = VBucketState.ACTIVE
_PENDING = VBucketState.PENDING
_REPLICA = VBucketState.REPLICA
_MUTATION = int(ItemOp.MUTATION)

_OPS = frozenset(int(op) for op in ItemOp)


def check_snapshot(vbid: int, high_seqno: int, start: int, end: int, items: Sequence[Item]) -> None:
    """Raise ``ReplicationError`` unless the snapshot may be applied (module rules)."""
    if start > end:
        raise ReplicationError(f"vb {vbid}: snapshot [{start}, {end}] ends before it starts")
    if end < high_seqno:
        raise ReplicationError(
            f"vb {vbid}: snapshot [{start}, {end}] ends below the high seqno {high_seqno}"
        )
    last = high_seqno
    for it in items:
        seqno = it.seqno
        if it.vbucket != vbid:
            raise ReplicationError(f"vb {vbid}: item seqno {seqno} is for vb {it.vbucket}")
        if seqno <= last:
            raise ReplicationError(f"vb {vbid}: seqno {seqno} does not advance (previous {last})")
        if not start <= seqno <= end:
            raise ReplicationError(
                f"vb {vbid}: seqno {seqno} outside its snapshot [{start}, {end}]"
            )
        if it.op not in _OPS or not it.key:
            raise ReplicationError(f"vb {vbid}: seqno {seqno} is not a change of a key")
        last = seqno


class ReplicaVBucket:
    """The replica half of ``VBucket`` (see the module rules). No ``__slots__`` of its
    own: the vbucket's attributes are declared below for the type checker, and a slotted
    base would make them read-only to it."""

    # the vbucket's attributes these methods use (defined and owned by VBucket)
    vbid: int
    state: VBucketState
    failover_log: FailoverTable
    checkpoints: CheckpointManager
    high_seqno: int
    persisted_seqno: int
    persisted_snap_start: int
    persisted_snap_end: int
    purge_seqno: int
    history_start: int
    _index: dict[bytes, tuple]
    _expiries: list[tuple[int, int, bytes]]
    _max_cas: int
    _memory: CheckpointMemory
    _config: EngineConfig
    _notify: Callable[[int], None]

    def _state_changed(self) -> None:  # pragma: no cover - VBucket defines it
        raise NotImplementedError

    def apply_snapshot(self, start: int, end: int, flags: int, items: list[Item]) -> None:
        """Apply a whole snapshot received from the source node (replica or pending).

        Items keep the source's seqno, CAS, revision, flags, expiry and delete time; they
        go into a checkpoint of their own (``queue_snapshot``), so this vbucket's own
        streams and its flusher see the source's boundaries. ``flags`` is the marker's
        (kept for the caller's logs; boundaries are what matter here).

        Raises:
            NotMyVbucket: the vbucket is active or dead.
            ReplicationError: the snapshot is malformed (replica.py); nothing changed.
        """
        if self.state is not _REPLICA and self.state is not _PENDING:
            raise NotMyVbucket(Status.NOT_MY_VBUCKET, f"vbucket {self.vbid} is {self.state.name}")
        check_snapshot(self.vbid, self.high_seqno, start, end, items)
        if not items:
            if end > self.high_seqno:  # its last seqno was a purged tombstone (SEQNO_ADVANCED)
                self.high_seqno = end
                self._notify(self.vbid)
            return
        index = self._index
        expiries = self._expiries
        max_cas = self._max_cas
        for it in items:
            mutation = it.op == _MUTATION
            index[it.key] = (
                it.seqno,
                it.rev_seqno,
                it.cas,
                it.flags,
                it.expiry,
                it.datatype,
                0 if mutation else 1,
            )
            if mutation and it.expiry:
                heapq.heappush(expiries, (it.expiry, it.seqno, it.key))
            if it.cas > max_cas:
                max_cas = it.cas
        self._max_cas = max_cas
        self.high_seqno = end  # a whole snapshot: its end may lie past its last item
        self.checkpoints.queue_snapshot(items)
        self._notify(self.vbid)

    def adopt_failover_log(self, entries: list[tuple[int, int]]) -> None:
        """Take the source's failover log (its stream accepted us): a replica's history is
        its source's, so its own consumers get the same rollback decisions."""
        if self.state is _ACTIVE:
            raise NotMyVbucket(Status.NOT_MY_VBUCKET, f"vbucket {self.vbid} is active")
        new = [(int(u), int(s)) for u, s in entries][: self.failover_log.max_entries]
        if not new or any(not 0 < u < 1 << 64 for u, _ in new):
            raise ReplicationError(f"vb {self.vbid}: failover log {entries!r} is not valid")
        if any(new[i][1] < new[i + 1][1] for i in range(len(new) - 1)):
            raise ReplicationError(f"vb {self.vbid}: failover log {entries!r} is not newest first")
        if new != self.failover_log.entries:
            self.failover_log.entries = new
            self._state_changed()

    def drop_newest_failover_entry(self) -> bool:
        """Forget the newest failover entry if it starts at the high seqno and an older
        one exists (a replica whose source does not know that branch: the entry its own
        warm-up added after a crash). Its next stream request then names the previous
        branch, which the source may know; True when an entry was dropped."""
        entries = self.failover_log.entries
        if len(entries) < 2 or entries[0][1] != self.high_seqno or self.state is _ACTIVE:
            return False
        del entries[0]
        self._state_changed()
        return True

    def replication_position(self) -> tuple[int, int, int, int]:
        """(start, snap_start, snap_end, vb_uuid) of this replica's stream request: its
        high seqno is a whole snapshot's end, and uuid 0 at seqno 0 asks for everything."""
        high = self.high_seqno
        return high, high, high, self.failover_log.entries[0][0] if high else 0

    def reset_to(self, seqno: int, index: dict[bytes, tuple], max_cas: int) -> None:
        """The storage rolled this vbucket back to ``seqno`` (``LmdbStorage.rollback``):
        memory follows. Checkpoints start afresh (streams of the old ones must be ended
        by the caller), the key index is the one rebuilt from disk, failover entries
        above ``seqno`` go."""
        self._memory.used -= self.checkpoints.mem_usage
        self.checkpoints = CheckpointManager(
            self.vbid,
            self._memory,
            start_seqno=seqno + 1,
            max_items=self._config.checkpoint_max_items,
            max_bytes=self._config.checkpoint_max_bytes,
        )
        self.high_seqno = self.persisted_seqno = seqno
        self.persisted_snap_start = self.persisted_snap_end = seqno
        if seqno == 0:
            self.purge_seqno = self.history_start = 0
        self.failover_log.prune_above(seqno)
        self._index = index
        self._expiries = [(e[4], e[0], k) for k, e in index.items() if e[4] and not e[6]]
        heapq.heapify(self._expiries)
        self._max_cas = max(self._max_cas, max_cas)
        self._state_changed()
