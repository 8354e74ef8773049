"""The stream-request decision: accept, roll back, or refuse — one pure function.

Rules of this module:
- ``decide_stream_request`` follows protocol_spec/README.md §8 exactly and in order:
  pre-checks, then the rollback decision (kv_engine ``FailoverTable::needsRollback``),
  then the post-checks (``adjustSeqnosForStreamRequest``). Every numbered step below is
  the step of the same number there; tests are table-driven over them.
- Pure: it reads only its arguments. No vbucket, no clock, no I/O. Rollback is a
  query, not a side effect: the server acts on the returned decision.
- Outcomes are an enum (``DecisionKind``) with the mcbp ``Status`` to answer.
- Checks that need connection state (noop enabled for xattrs, collection filters,
  stream ids, an existing live stream: pre-checks 3 and 5, and the memory check after
  the post-checks) belong to the server and are not made here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ...protocol.opcodes import Status, StreamRequestFlag, VBucketState

__all__ = ["DecisionKind", "StreamDecision", "decide_stream_request", "needs_rollback"]

_F = StreamRequestFlag


class DecisionKind(Enum):
    ACCEPT = "accept"
    ROLLBACK = "rollback"
    ERROR = "error"


@dataclass(slots=True, frozen=True, kw_only=True)
class StreamDecision:
    """The answer to a stream request.

    For ACCEPT, ``start``/``end``/``snap_start``/``snap_end`` are the (adjusted) values the
    stream runs with and ``vb_uuid`` is the request's uuid (or the newest uuid when the
    client sent 0). For ROLLBACK, ``rollback_seqno`` is the seqno to send with status
    ROLLBACK. For ERROR, ``status`` is the status to answer.
    """

    kind: DecisionKind
    status: Status
    rollback_seqno: int = 0
    start: int = 0
    end: int = 0
    snap_start: int = 0
    snap_end: int = 0
    vb_uuid: int = 0
    reason: str = ""


def _error(status: Status, reason: str) -> StreamDecision:
    return StreamDecision(kind=DecisionKind.ERROR, status=status, reason=reason)


def needs_rollback(
    failover_log: list[tuple[int, int]],
    *,
    start: int,
    high_seqno: int,
    vb_uuid: int,
    snap_start: int,
    snap_end: int,
    purge_seqno: int,
    strict_vb_uuid: bool = False,
    client_purge_seqno: int = 0,
) -> tuple[int, str] | None:
    """§5.4 rollback steps 1-7: None, or (rollback seqno, reason).

    ``failover_log`` is newest first (wire order).
    """
    s, ss, se = start, snap_start, snap_end
    # 1. Start 0 never rolls back unless the client insists on a uuid match.
    if s == 0 and (not strict_vb_uuid or vb_uuid == 0):
        return None
    # 2. The client may have missed deletes that compaction purged.
    if s < purge_seqno and s != 0 and client_purge_seqno != purge_seqno:
        return 0, f"start {s} is below the purge seqno {purge_seqno}"
    # 3. Find the client's branch, scanning oldest -> newest.
    upper = None
    n = len(failover_log)
    for i in range(n - 1, -1, -1):
        if failover_log[i][0] == vb_uuid:
            upper = failover_log[i - 1][1] if i > 0 else high_seqno
            break
    if upper is None:
        return 0, f"vbucket uuid {vb_uuid} is not in the failover log"
    # 4. A client that holds nothing of its snapshot is only at S.
    if s == ss:
        se = s
    # 5. Everything the client may hold lies on our history.
    if se <= upper:
        return None
    # 6. A client that holds the whole snapshot is at S.
    if s == se:
        ss = s
    # 7. Roll back to where the histories agree.
    if upper < ss:
        return upper, f"snapshot {ss}..{se} is past the branch point {upper}"
    return ss, f"snapshot {ss}..{se} crosses the branch point {upper}"


def decide_stream_request(
    *,
    failover_log: list[tuple[int, int]],
    high_seqno: int,
    purge_seqno: int,
    persisted_seqno: int,
    vb_state: VBucketState,
    start: int,
    end: int,
    vb_uuid: int,
    snap_start: int,
    snap_end: int,
    flags: int,
    client_purge_seqno: int = 0,
) -> StreamDecision:
    """Decide a DCP_STREAM_REQ against a vbucket's state (protocol_spec/README.md §8).

    Args:
        failover_log: (uuid, seqno) newest first.
        high_seqno: H, the vbucket's high seqno.
        purge_seqno: P, the highest purged tombstone's seqno.
        persisted_seqno: the seqno DiskOnly streams end at.
        vb_state: the vbucket's state.
        start, end, vb_uuid, snap_start, snap_end, flags: the request's fields.
        client_purge_seqno: Pc, from the request's JSON value (default 0).

    Returns:
        A ``StreamDecision``: ACCEPT (SUCCESS), ROLLBACK (ROLLBACK + seqno) or ERROR
        (NOT_MY_VBUCKET or ERANGE).
    """
    # Pre-check 1: vbucket must be active or replica (active only with ActiveVbOnly).
    if flags & _F.ACTIVE_VB_ONLY:
        if vb_state != VBucketState.ACTIVE:
            return _error(Status.NOT_MY_VBUCKET, f"vbucket is {vb_state.name}, not active")
    elif vb_state not in (VBucketState.ACTIVE, VBucketState.REPLICA):
        return _error(Status.NOT_MY_VBUCKET, f"vbucket is {vb_state.name}")
    if not failover_log:
        return _error(Status.NOT_MY_VBUCKET, "vbucket has no failover log")
    # Pre-check 2: FromLatest starts at the high seqno.
    if flags & _F.FROM_LATEST:
        start = snap_start = snap_end = high_seqno
        if vb_uuid == 0:
            vb_uuid = failover_log[0][0]
    # Pre-check 4: range sanity.
    if start > end:
        return _error(Status.ERANGE, f"start {start} > end {end}")
    if not snap_start <= start <= snap_end:
        return _error(Status.ERANGE, f"start {start} outside snapshot {snap_start}..{snap_end}")
    # Rollback decision (IgnorePurgedTombstones makes P = 0).
    purge = 0 if flags & _F.IGNORE_PURGED_TOMBSTONES else purge_seqno
    rb = needs_rollback(
        failover_log,
        start=start,
        high_seqno=high_seqno,
        vb_uuid=vb_uuid,
        snap_start=snap_start,
        snap_end=snap_end,
        purge_seqno=purge,
        strict_vb_uuid=bool(flags & _F.STRICT_VB_UUID),
        client_purge_seqno=client_purge_seqno,
    )
    if rb is not None:
        return StreamDecision(
            kind=DecisionKind.ROLLBACK,
            status=Status.ROLLBACK,
            rollback_seqno=rb[0],
            vb_uuid=vb_uuid,
            reason=rb[1],
        )
    # Post-checks.
    if flags & _F.TO_LATEST:
        end = high_seqno
    if flags & _F.DISK_ONLY:
        end = persisted_seqno
    if start > end:
        return _error(Status.ERANGE, f"start {start} > end {end} after adjustment")
    if start > high_seqno:
        return _error(Status.ERANGE, f"start {start} > high seqno {high_seqno}")
    if start == snap_start and snap_end > high_seqno:
        snap_end = high_seqno
    return StreamDecision(
        kind=DecisionKind.ACCEPT,
        status=Status.SUCCESS,
        start=start,
        end=end,
        snap_start=snap_start,
        snap_end=snap_end,
        vb_uuid=vb_uuid or failover_log[0][0],
        reason="ok",
    )
