"""Durable writes: the checks before one is applied, and its answer, held in the
connection's response queue (``Pending``) until the write's durability level holds.

Rules of this module:
- Before anything is written (kv_handlers.py calls these in its write handlers): an
  undefined level or the reserved timeout 0xFFFF is DURABILITY_INVALID_LEVEL
  (``requested_durability``); a majority level on an active vbucket whose chain (or the
  forward chain it is moving to) names too few copies is DURABILITY_IMPOSSIBLE
  (``durability_possible``).
- A durable write is applied at once, like any write; only its answer waits (no
  prepare/commit: readers that must not see what a failure could take back use
  stable-only streams). ``Pending`` is that answer in the connection's ordered queue
  (connection.py); ``settle`` decides, each time the writer looks at it, whether it
  leaves now and as what:
  - the vbucket left active here since the write (its term changed) or is not active:
    SYNC_WRITE_AMBIGUOUS at once (the write may or may not survive on the new active);
  - the level holds (``DurabilityMonitor.satisfied``): the write's own answer;
  - the deadline passed: SYNC_WRITE_AMBIGUOUS;
  - else it waits, and so does everything queued behind it (answers stay in request
    order), never past its deadline.
  A client that did not negotiate XERROR gets ETMPFAIL instead of SYNC_WRITE_AMBIGUOUS.
- Each outcome is counted in ``metrics.sync_writes`` (by level: ok, ambiguous); the
  deadline ones also in ``durable_timeouts`` (logged once, then only counted).
- The ambiguous answers are built only when needed: most writes never use them.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import trio

from ..protocol import codec
from ..protocol.frames import Frame, parse_frame_infos
from ..protocol.opcodes import DurabilityLevel, FrameInfoId, Status

if TYPE_CHECKING:
    from .connection import Connection
    from .server import DcpServer

__all__ = [
    "NEEDS_LOCAL_PERSISTENCE",
    "Pending",
    "answer_write",
    "durability_possible",
    "error_frame",
    "requested_durability",
    "settle",
]

log = logging.getLogger("dcp.conn")

#: levels a write waits for this node's own persistence on (the flusher hurries)
NEEDS_LOCAL_PERSISTENCE = frozenset(
    (
        int(DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE),
        int(DurabilityLevel.PERSIST_TO_MAJORITY),
        int(DurabilityLevel.PERSIST_TO_ACTIVE),
    )
)

_LEVELS = frozenset(int(level) for level in DurabilityLevel)
_NONE = int(DurabilityLevel.NONE)


def error_frame(opcode: int, status: int, opaque: int, message: str = "") -> bytes:
    """An error response whose value carries a JSON error context (as memcached's
    XERROR does) so operators and dissectors see why."""
    value = codec.json_value({"error": {"context": message}}) if message else b""
    return codec.response(opcode, status, opaque=opaque, value=value, datatype=1 if value else 0)


def _durability(f: Frame) -> tuple[int, int]:
    """(level, timeout in ms; 0 = the server default) of the frame's durability info.
    ``codec.parse_durability`` validates the frame infos and the payload size."""
    level = codec.parse_durability(f)
    if level == DurabilityLevel.NONE:
        return level, 0
    for fid, data in parse_frame_infos(f.framing_extras):
        if fid == FrameInfoId.DURABILITY:
            return level, codec.U16.unpack_from(data, 1)[0] if len(data) == 3 else 0
    return level, 0


def answer_write(
    conn: Connection, f: Frame, vbid: int, seqno: int, frame: bytes, durability: tuple[int, int]
) -> None:
    """Queue the answer ``frame`` of a write applied at ``seqno``: at once when its level
    is NONE or already holds, else as a ``Pending`` (the flusher hurried when the level
    needs this node's persistence)."""
    level, timeout_ms = durability
    server = conn.server
    if level == _NONE:
        conn.respond(frame)
        return
    if server.durability.satisfied(vbid, seqno, level):
        server.metrics.sync_write(level, "ok")
        conn.respond(frame)  # behind any answer still waiting: the queue keeps the order
        return
    timeout = timeout_ms / 1000 if timeout_ms else server.config.durability_timeout
    conn.respond_when_durable(vbid, seqno, level, frame, f.opcode, f.opaque, timeout)
    if level in NEEDS_LOCAL_PERSISTENCE:
        server.persistence.want_flush()


def requested_durability(conn: Connection, f: Frame) -> tuple[int, int] | None:
    """The frame's (level, timeout ms), or None when it was refused (answered here):
    nothing may be written then."""
    level, timeout_ms = _durability(f)
    if level not in _LEVELS:
        conn.error(
            f.opcode,
            Status.DURABILITY_INVALID_LEVEL,
            f.opaque,
            f"durability level {level} is not defined",
        )
        return None
    if timeout_ms == 0xFFFF:
        conn.error(
            f.opcode,
            Status.DURABILITY_INVALID_LEVEL,
            f.opaque,
            "durability timeout 0xffff is reserved",
        )
        return None
    return level, timeout_ms


def durability_possible(conn: Connection, f: Frame, level: int) -> bool:
    """Whether the vbucket's chain has the copies ``level`` needs (checked after the
    other refusals, on an active vbucket only: elsewhere the engine's NOT_MY_VBUCKET is
    the answer that tells the client where to go)."""
    if level == _NONE:
        return True
    dur = conn.server.durability
    vb = f.vbucket
    if dur.possible(vb, level) or not dur.is_active(vb):
        return True
    conn.server.metrics.sync_write(level, "impossible")
    forward = dur.forward_chain(vb)
    moving = f" (moving to {list(forward)})" if forward is not None else ""
    conn.error(
        f.opcode,
        Status.DURABILITY_IMPOSSIBLE,
        f.opaque,
        f"durability level {level} needs a majority of vb {vb}'s copies; its chain "
        f"{list(dur.chain(vb))}{moving} names too few",
    )
    return False


class Pending:
    """The answer ``frame`` of a write of ``vbid`` at ``seqno`` that may leave only once
    ``level`` holds, made during ``term`` of the vbucket; ambiguous at ``deadline``
    (trio time)."""

    __slots__ = (
        "deadline",
        "frame",
        "level",
        "opaque",
        "opcode",
        "seqno",
        "term",
        "timeout",
        "vbid",
        "xerror",
    )

    def __init__(
        self,
        vbid: int,
        seqno: int,
        level: int,
        term: int,
        frame: bytes,
        *,
        opcode: int,
        opaque: int,
        timeout: float,
        xerror: bool,
    ) -> None:
        self.vbid = vbid
        self.seqno = seqno
        self.level = level
        self.term = term
        self.frame = frame
        self.opcode = opcode
        self.opaque = opaque
        self.timeout = timeout
        self.deadline = trio.current_time() + timeout if timeout < math.inf else math.inf
        self.xerror = xerror

    def ambiguous(self, why: str) -> bytes:
        status = Status.SYNC_WRITE_AMBIGUOUS if self.xerror else Status.ETMPFAIL
        return error_frame(self.opcode, status, self.opaque, why)


def settle(server: DcpServer, entry: Pending, peer: str) -> bytes | None:
    """What ``entry`` is answered with now, or None while it must still wait (see the
    module rules)."""
    dur = server.durability
    vb = entry.vbid
    if dur.term(vb) != entry.term or not dur.is_active(vb):
        server.metrics.sync_write(entry.level, "ambiguous")
        return entry.ambiguous(
            f"vbucket {vb} stopped being active here while the durable write waited: it "
            "may or may not survive"
        )
    if dur.satisfied(vb, entry.seqno, entry.level):
        server.metrics.sync_write(entry.level, "ok")
        return entry.frame
    if trio.current_time() < entry.deadline:
        return None
    metrics = server.metrics
    if not metrics.durable_timeouts:
        log.warning(
            "durable write timed out peer=%s vb=%d seqno=%d level=%d (persisted %d, "
            "majority %d): answered ambiguous; counted in durable_write_timeouts",
            peer,
            vb,
            entry.seqno,
            entry.level,
            server.persistence.persisted_seqno(vb),
            dur.majority_seqno(vb),
        )
    metrics.durable_timeouts += 1
    metrics.sync_write(entry.level, "ambiguous")
    what = (
        "not persisted"
        if entry.level == DurabilityLevel.PERSIST_TO_ACTIVE
        else "durability level not reached"
    )
    return entry.ambiguous(f"durability timeout: {what} within {entry.timeout:g} s")
