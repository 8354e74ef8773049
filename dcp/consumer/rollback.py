"""Rollback: what the client does when the server says its history diverged.

Rules of this module:
- Pure decisions, no I/O. The client asks ``rolled_back_log`` for the state to resume
  from and ``RollbackPolicy`` for whether to resume at all.
- The reset follows ``protocol_spec/README.md`` (section 8): drop every failover-log
  entry whose seqno is above the rollback seqno R, resume at last seqno = R with the
  zero-width snapshot [R, R], and re-request; a second rollback is possible and handled
  the same way.
- An offset from outside (a bare vb_uuid, no log) is represented by the synthetic log
  ``((vb_uuid, SEQNO_MAX),)`` so that a rollback always prunes it (then uuid 0 is sent and
  the server answers with a rollback to 0 if it cannot place us: never a silent skip).
"""

from __future__ import annotations

import enum

from dcp.protocol.opcodes import SEQNO_MAX

__all__ = ["RollbackPolicy", "log_for_offset", "rolled_back_log"]

FailoverLog = tuple[tuple[int, int], ...]


class RollbackPolicy(enum.Enum):
    """What the client does when a stream request is answered with ROLLBACK."""

    #: Deliver a ``RollbackEvent`` through the iterator, reset the vbucket to the
    #: rollback seqno and re-request the stream (the default).
    RESUME = "resume"
    #: Raise ``RollbackError`` (vbucket, vb_uuid, seqno, rollback_seqno) from the iterator.
    FAIL = "fail"


def rolled_back_log(log: FailoverLog, rollback_seqno: int) -> FailoverLog:
    """The failover log after a rollback to ``rollback_seqno``: entries above it dropped."""
    return tuple((u, s) for u, s in log if s <= rollback_seqno)


def log_for_offset(vb_uuid: int, failover_log: FailoverLog) -> FailoverLog:
    """The failover log a resume position uses (synthetic entry for a bare uuid)."""
    if failover_log:
        return failover_log
    if vb_uuid:
        return ((vb_uuid, SEQNO_MAX),)
    return ()
