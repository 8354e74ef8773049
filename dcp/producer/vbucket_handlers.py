"""KV requests about vbucket states: SET_VBUCKET_STATE (0x3d) and GET_VBUCKET (0x3e).

Rules of this module:
- Handlers are synchronous and queue exactly one response, as kv_handlers.py's do. The
  layouts are protocol_spec/README.md's (6.6, "vbucket states"): SET_VBUCKET_STATE has one
  byte of extras (the state) and an optional JSON value (our options: a replication
  source, a takeover); GET_VBUCKET answers the state as a 4-byte big-endian value.
- Bad frames (extras, key, a value that is not a JSON object or not marked JSON, an
  unknown state) get EINVAL; a vbucket the bucket does not have gets NOT_MY_VBUCKET.
- Changing a state is not this module's business: it hands the state and the options
  to ``server.vbucket_states.set`` (the server's owner of the assignment, which changes
  the engine, ends the vbucket's producer streams and reconciles replication) and
  answers the ``StatusError`` that may raise with its status. Reading a state reads the
  engine's ``VBucket.state``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..protocol import codec
from ..protocol.errors import StatusError
from ..protocol.frames import Frame
from ..protocol.opcodes import Opcode, Status, VBucketState

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["VBUCKET_HANDLERS"]

log = logging.getLogger("dcp.producer")


def _known_vbucket(conn: Connection, f: Frame) -> bool:
    n = conn.server.bucket.num_vbuckets
    if f.vbucket < n:
        return True
    conn.error(f.opcode, Status.NOT_MY_VBUCKET, f.opaque, f"no vbucket {f.vbucket} (of {n})")
    return False


def set_vbucket_state(conn: Connection, f: Frame) -> None:
    """SET_VBUCKET_STATE: extras = the state (1 byte), value = optional JSON options."""
    try:
        state, options = codec.parse_set_vbucket_state(f)
    except StatusError as exc:  # InvalidArguments: EINVAL, as kv_engine's validator
        conn.error(f.opcode, exc.status, f.opaque, str(exc))
        return
    if not _known_vbucket(conn, f):
        return
    new = VBucketState(state)
    try:
        conn.server.vbucket_states.set(f.vbucket, new, options)
    except StatusError as exc:
        log.info(
            "set vbucket state id=%d vb=%d state=%s options=%r -> %s",
            conn.id,
            f.vbucket,
            new.name,
            options,
            exc,
        )
        conn.error(f.opcode, exc.status, f.opaque, str(exc))
        return
    log.info(
        "set vbucket state id=%d peer=%s vb=%d state=%s options=%r",
        conn.id,
        conn.peer,
        f.vbucket,
        new.name,
        options,
    )
    conn.respond(codec.response(Opcode.SET_VBUCKET_STATE, opaque=f.opaque))


def get_vbucket(conn: Connection, f: Frame) -> None:
    """GET_VBUCKET: an empty request; the answer's value is the state as a u32."""
    if f.extras or f.key or f.value:
        conn.error(
            f.opcode,
            Status.EINVAL,
            f.opaque,
            f"GET_VBUCKET takes no extras, key or value (got {len(f.extras)}, "
            f"{len(f.key)}, {len(f.value)} bytes)",
        )
        return
    if not _known_vbucket(conn, f):
        return
    state = conn.server.bucket.vbucket(f.vbucket).state
    conn.respond(
        codec.response(
            Opcode.GET_VBUCKET, opaque=f.opaque, value=codec.get_vbucket_value(int(state))
        )
    )


VBUCKET_HANDLERS: dict[int, Callable[[Connection, Frame], None]] = {
    Opcode.SET_VBUCKET_STATE: set_vbucket_state,
    Opcode.GET_VBUCKET: get_vbucket,
}
