"""DCP_SEQNO_ACKNOWLEDGED on the producer: a replica tells its active which seqno of a
vbucket it holds (in whole snapshots) and which it has persisted.

Rules of this module:
- The ack needs an open DCP connection that said which node it speaks for (control
  ``consumer_name``), else EINVAL; a malformed one is EINVAL too (``codec.
  parse_seqno_acknowledged`` raises, the reader answers). It is never answered
  otherwise: an ack for a vbucket without a stream on this connection, with another
  stream's opaque or on a TAKEOVER stream (a replica acks on plain streams only,
  replication/acks.py), is dropped silently, as Couchbase does (it may simply be late).
- The durability monitor (durability.py) is told what the stream actually sent
  (``last_sent_seqno``), so a replica cannot claim more than it was given; what the
  monitor clamps or ignores is logged at WARNING, at most ``_LOG_BURST`` lines per
  ``_LOG_INTERVAL`` seconds server-wide, then counted: a buggy or hostile replica acks
  on every snapshot and must not flood the log.
- Each ack is recorded with the stream it came on, which is marked ``acked``: when
  that stream is released (it ended, or its connection closed) the monitor forgets the
  acks it made and no others (active_stream.py ``release``), even if the same node
  already streams the vbucket again on a newer connection.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..protocol import codec
from ..protocol.frames import Frame
from ..protocol.opcodes import Status

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["seqno_acknowledged"]

log = logging.getLogger("dcp.producer")

_LOG_BURST = 5
_LOG_INTERVAL = 10.0


class _AckLog:
    """Rate-limited warnings about acks the monitor clamped or ignored: a buggy or
    hostile replica acks on every snapshot and must not flood the log."""

    def __init__(self) -> None:
        self.window = -_LOG_INTERVAL
        self.logged = 0
        self.suppressed = 0

    def warn(self, conn: Connection, vb: int, why: str) -> None:
        now = time.monotonic()
        if now - self.window >= _LOG_INTERVAL:
            if self.suppressed:
                log.warning("%d more seqno acks clamped or ignored", self.suppressed)
            self.window, self.logged, self.suppressed = now, 0, 0
        if self.logged >= _LOG_BURST:
            self.suppressed += 1
            return
        self.logged += 1
        log.warning(
            "seqno ack from id=%d peer=%s consumer=%s vb=%d: %s",
            conn.id,
            conn.peer,
            conn.consumer_name,
            vb,
            why,
        )


_ack_log = _AckLog()


def seqno_acknowledged(conn: Connection, f: Frame) -> None:
    """A replica holds (and has persisted) a vbucket's seqno; no answer on success."""
    if conn.dcp_name is None or conn.consumer_name is None:
        conn.error(
            f.opcode,
            Status.EINVAL,
            f.opaque,
            "DCP_SEQNO_ACKNOWLEDGED needs DCP_OPEN and the control consumer_name first",
        )
        return
    seqno, persisted = codec.parse_seqno_acknowledged(f)
    stream = conn.streams.get(f.vbucket)
    if stream is None or stream.opaque != f.opaque or stream.is_dead or stream.takeover is not None:
        return
    stream.acked = True
    why = conn.server.durability.acknowledge(
        f.vbucket,
        conn.consumer_name,
        seqno,
        persisted,
        sent=stream.last_sent_seqno,
        source=stream,
    )
    if why:
        _ack_log.warn(conn, f.vbucket, why)
