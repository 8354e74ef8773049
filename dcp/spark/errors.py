"""Errors of the Spark connector. Each message says what happened, where, and what to do.

Rules of this module:
- Every error a user can meet is a ``DcpSparkError`` with the facts as attributes
  (vbucket, uuid, seqnos) and a message that stands on its own in a Spark stack trace.
- ``OptionError`` is a ``ValueError``: raised while the query is set up, never later.
"""

from __future__ import annotations

__all__ = [
    "DcpSparkError",
    "MergedSnapshotError",
    "OffsetError",
    "OptionError",
    "RangeUnavailableError",
    "RollbackDetectedError",
    "TlsError",
]


class DcpSparkError(Exception):
    """Base class of the connector's errors."""


class OptionError(DcpSparkError, ValueError):
    """A reader option is missing, unknown or malformed."""


class OffsetError(DcpSparkError, ValueError):
    """An offset (from ``startingOffsets``, the offsets file or Spark's log) is malformed
    or inconsistent (for example ``end < start``)."""


class RollbackDetectedError(DcpSparkError):
    """A position the query already consumed is no longer on the server's history.

    Attributes: vbucket, vb_uuid, seqno (the position), rollback_seqno (where the server's
    history and ours agree again), where ("planning" or "reading").
    """

    def __init__(
        self,
        vbucket: int,
        vb_uuid: int,
        seqno: int,
        rollback_seqno: int,
        where: str = "planning",
        detail: str = "",
        *,
        ahead: bool = False,
    ) -> None:
        self.vbucket = vbucket
        self.vb_uuid = vb_uuid
        self.seqno = seqno
        self.rollback_seqno = rollback_seqno
        self.where = where
        self.ahead = ahead
        if ahead:
            msg = (
                f"vbucket {vbucket}: the query's position (vbucket uuid {vb_uuid}, seqno "
                f"{seqno}) is ahead of the server, whose high seqno on that branch is "
                f"{rollback_seqno}: the starting offsets name changes the server has not "
                f"written (offsets of another server or data directory?), or the server "
                f"lost changes without recording a failover."
            )
            if detail:
                msg += f" {detail}"
            msg += (
                " Fix the starting offsets, or set option onRollback=rewind (alias "
                "failOnDataLoss=false) to continue from seqno "
                f"{rollback_seqno} after an explicit op='rollback' row."
            )
            super().__init__(msg)
            return
        msg = (
            f"DCP rollback detected while {where}: vbucket {vbucket} position "
            f"(vbucket uuid {vb_uuid}, seqno {seqno}) is no longer on the server's history; "
            f"the server would roll back to seqno {rollback_seqno}, so changes above "
            f"{rollback_seqno} that this query may have consumed were lost by the server "
            f"(failover or unclean restart)."
        )
        if detail:
            msg += f" {detail}"
        msg += (
            " Set option onRollback=rewind (alias failOnDataLoss=false) to continue with an "
            "explicit op='rollback' row, or start a new query (new checkpoint)."
        )
        super().__init__(msg)


class TlsError(DcpSparkError):
    """TLS itself failed: the server's certificate is not trusted or does not name the
    host, the port does not speak TLS, or our client certificate was refused. Never
    retried: waiting cannot make a certificate trusted."""


class RangeUnavailableError(DcpSparkError):
    """The server can no longer serve a planned range at all (vbucket missing, stream
    refused for good, retries exhausted)."""


class MergedSnapshotError(DcpSparkError):
    """The server can no longer serve ``(start, end]`` of a vbucket exactly: the snapshot
    that held ``end`` was merged with later changes (deduplication, compaction) since the
    batch was planned, so the batch's original content no longer exists.

    Attributes: vbucket, start, end, snapshot_start, snapshot_end, flags.
    """

    def __init__(
        self, vbucket: int, start: int, end: int, snapshot_start: int, snapshot_end: int, flags: int
    ) -> None:
        self.vbucket = vbucket
        self.start = start
        self.end = end
        self.snapshot_start = snapshot_start
        self.snapshot_end = snapshot_end
        self.flags = flags
        kind = "disk" if flags & 0x02 else "memory"
        super().__init__(
            f"vbucket {vbucket}: the range (seqno {start}, {end}] of this micro-batch can no "
            f"longer be served exactly: the server now has it inside the {kind} snapshot "
            f"[{snapshot_start}, {snapshot_end}], which runs past seqno {end} and holds "
            f"later revisions of existing documents, which may have replaced (deduplicated) "
            f"versions inside the range since the batch was planned. Reading up to seqno "
            f"{end} could give a state that never existed. Fixes: run the server with a "
            f"change history (--history-seconds / --history-bytes) longer than the time "
            f"between planning and replaying a batch, or set "
            f"option onMergedSnapshot=reread to take the merged snapshot whole (rows up to "
            f"seqno {snapshot_end}, which the next batch may repeat)."
        )
