"""Session state: per vbucket, where the application is and where the next stream starts.

Rules of this module:
- Three positions per vbucket, each a (failover log, seqno) pair:
    * *committed* - what the application has committed; the only thing an offset store
      ever saves. Advanced only by ``commit`` (at-least-once: anything delivered but not
      committed is delivered again after a reconnect or restart).
    * *resume* - what the next stream request asks with. Equal to committed, except after
      a rollback (the reset position [R, R] with the pruned log) until a commit in the new
      epoch catches up.
    * *delivered tip* - the last batch/rollback handed to the application in the current
      stream generation; ``commit_delivered`` commits these.
- ``epoch`` counts rollbacks, ``gen`` counts stream requests. A commit is accepted only
  for items of the current epoch; batch commits also need the current generation (an
  older generation's batches are streamed again from the resume point, so committing
  them could pair data of an abandoned stream with a newer failover log).
- Positions are ordered by (epoch, seqno); committed positions never move backwards
  except through a rollback event of a newer epoch.
- ``to_latest``: ``end_seqno`` is the high seqno the vbucket's active had when the client
  started, and ``end_log`` the failover log it had then (cluster mode). "Latest" means
  that data as far as it survived: when a copy later streams the vbucket with a failover
  log that branched off below ``end_seqno`` (a failover lost the tail), the seqnos above
  the branch point will never come on that history, so the end is lowered to it
  (``clamp_end``) instead of waiting forever. Writes made on the new branch after the
  failover are not part of what "latest" named.
- No I/O; the client persists ``offsets()`` after a commit changed something.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dcp.protocol.opcodes import SEQNO_MAX

from .batches import RollbackEvent, SnapshotBatch
from .offset import Offset
from .rollback import log_for_offset, rolled_back_log

__all__ = ["Session", "VbPosition"]

FailoverLog = tuple[tuple[int, int], ...]


class VbPosition:
    """State of one vbucket (mutable; owned by ``Session``)."""

    __slots__ = (
        "c_epoch",
        "c_log",
        "c_purge",
        "c_seqno",
        "c_snap_end",
        "c_snap_start",
        "done",
        "end_log",
        "end_seqno",
        "epoch",
        "gen",
        "r_log",
        "r_purge",
        "r_seqno",
        "r_snap_end",
        "r_snap_start",
        "tip",
        "vbucket",
    )

    def __init__(self, offset: Offset) -> None:
        self.vbucket = offset.vbucket
        log = log_for_offset(offset.vb_uuid, offset.failover_log)
        self.c_log: FailoverLog = log
        snap_start, snap_end = offset.snapshot
        self.c_seqno = offset.seqno
        self.c_snap_start = snap_start
        self.c_snap_end = snap_end
        self.c_purge = offset.purge_seqno
        self.c_epoch = 0
        self.r_log: FailoverLog = log
        self.r_seqno = offset.seqno
        self.r_snap_start = snap_start
        self.r_snap_end = snap_end
        self.r_purge = offset.purge_seqno
        self.epoch = 0
        self.gen = 0
        self.end_seqno = SEQNO_MAX
        #: to_latest in a cluster: the failover log of the copy ``end_seqno`` was read from
        self.end_log: FailoverLog | None = None
        self.done = False
        self.tip: SnapshotBatch | RollbackEvent | None = None

    @property
    def resume_uuid(self) -> int:
        return self.r_log[0][0] if self.r_log else 0

    def committed_offset(self) -> Offset:
        log = tuple(e for e in self.c_log if e[1] != SEQNO_MAX) if self.c_log else ()
        uuid = self.c_log[0][0] if self.c_log else 0
        return Offset(
            self.vbucket,
            uuid,
            self.c_seqno,
            self.c_snap_start,
            self.c_snap_end,
            log if log and log[0][0] == uuid else (),
            self.c_purge,
        )

    def __repr__(self) -> str:
        return (
            f"VbPosition(vb={self.vbucket}, committed={self.c_seqno}, resume={self.r_seqno}, "
            f"epoch={self.epoch}, gen={self.gen}, done={self.done})"
        )


class Session:
    """Positions of every vbucket a client streams."""

    def __init__(self, offsets: Mapping[int, Offset]) -> None:
        self.positions: dict[int, VbPosition] = {vb: VbPosition(o) for vb, o in offsets.items()}

    def __getitem__(self, vb: int) -> VbPosition:
        return self.positions[vb]

    def __contains__(self, vb: object) -> bool:
        return vb in self.positions

    def request_fields(self, vb: int) -> tuple[int, int, int, int, int]:
        """(start, end, vb_uuid, snap_start, snap_end) for the next stream request."""
        p = self.positions[vb]
        return p.r_seqno, p.end_seqno, p.resume_uuid, p.r_snap_start, p.r_snap_end

    def clamp_end(self, vb: int, log: Iterable[tuple[int, int]]) -> int:
        """A stream of ``vb`` opened on a copy whose failover log is ``log``: lower the
        end to where that copy's history branched off the one the end was read from, if
        that is below it (module rules). Returns the (possibly new) end seqno."""
        p = self.positions[vb]
        if p.end_log is None or p.end_seqno == SEQNO_MAX:
            return p.end_seqno
        known = set(p.end_log)
        # entries the reference history lacks are branches made since; the oldest of them
        # is where this copy's history stopped being the one the end was read from
        branch = min((seqno for uuid, seqno in log if (uuid, seqno) not in known), default=None)
        if branch is not None and branch < p.end_seqno:
            p.end_seqno = branch
        return p.end_seqno

    def purge_seqno(self, vb: int) -> int:
        """The purge seqno last seen at the resume point (0: none; sent as JSON if set)."""
        return self.positions[vb].r_purge

    def next_generation(self, vb: int) -> tuple[int, int]:
        """A new stream is being requested for ``vb``: (epoch, new generation)."""
        p = self.positions[vb]
        p.gen += 1
        p.tip = None
        return p.epoch, p.gen

    def rollback(self, vb: int, rollback_seqno: int) -> RollbackEvent:
        """Reset ``vb``'s resume point after a ROLLBACK answer; returns the event to deliver."""
        p = self.positions[vb]
        asked_uuid, asked_seqno = p.resume_uuid, p.r_seqno
        log = rolled_back_log(p.r_log, rollback_seqno)
        p.epoch += 1
        p.r_log = log
        p.r_seqno = p.r_snap_start = p.r_snap_end = rollback_seqno
        p.tip = None
        shown = tuple(e for e in log if e[1] != SEQNO_MAX)
        return RollbackEvent(vb, asked_uuid, asked_seqno, rollback_seqno, shown, p.epoch)

    def delivered(self, item: SnapshotBatch | RollbackEvent) -> None:
        """``item`` was handed to the application."""
        p = self.positions.get(item.vbucket)
        if p is None or item.epoch != p.epoch:
            return
        if isinstance(item, SnapshotBatch) and item.gen != p.gen:
            return
        p.tip = item

    def commit(self, item: SnapshotBatch | RollbackEvent) -> bool:
        """Advance the committed position of ``item.vbucket`` to ``item``; True if it moved."""
        p = self.positions.get(item.vbucket)
        if p is None or item.epoch != p.epoch:
            return False
        if isinstance(item, SnapshotBatch):
            if item.gen != p.gen:
                return False
            if p.c_epoch == p.epoch and item.end <= p.c_seqno:
                return False
            seqno = item.end
            log = item.failover_log or p.r_log
            purge = max(p.c_purge, item.purge_seqno)
        else:
            if p.c_epoch == p.epoch:
                return False
            seqno = item.rollback_seqno
            log = p.r_log
            purge = p.r_purge
        p.c_epoch = p.epoch
        p.c_log = log
        p.c_seqno = p.c_snap_start = p.c_snap_end = seqno
        p.r_log = log
        p.r_seqno = p.r_snap_start = p.r_snap_end = seqno
        p.c_purge = p.r_purge = purge
        return True

    def commit_delivered(self) -> list[int]:
        """Commit every vbucket's delivered tip; returns the vbuckets that moved."""
        moved: list[int] = []
        for vb, p in self.positions.items():
            if p.tip is not None and self.commit(p.tip):
                moved.append(vb)
        return moved

    def commit_many(self, items: Iterable[SnapshotBatch | RollbackEvent]) -> list[int]:
        """Commit each of ``items``; returns the vbuckets that moved."""
        return [it.vbucket for it in items if self.commit(it)]

    def offsets(self) -> dict[int, Offset]:
        """Committed offsets of every vbucket (what the offset store saves)."""
        return {vb: p.committed_offset() for vb, p in self.positions.items()}

    def all_done(self) -> bool:
        return all(p.done for p in self.positions.values())
