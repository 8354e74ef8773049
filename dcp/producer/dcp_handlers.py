"""DCP requests from a client: OPEN, CONTROL, STREAM_REQ, CLOSE_STREAM, GET_FAILOVER_LOG,
BUFFER_ACK, SEQNO_ACKNOWLEDGED, and the client's refusals of what the server sent.

Rules of this module:
- Every DCP request except DCP_OPEN needs an open producer connection first (EINVAL).
- Noop and flow-control state is the connection's ``ServerSession``
  (``dcp.protocol.server_session``): the control keys it owns and buffer acks are
  applied there; noop answers never reach this module (the session matches them).
- The stream-request decision is the engine's pure ``decide_stream_request``; this
  module only turns it into a response and an ``ActiveStream``. The stream's cursor is
  registered before the OK response is queued (so memory it needs is pinned), but it
  writes nothing until that response has left (``Connection.announce_stream``).
- A TAKEOVER stream (flag 0x01) needs an active vbucket (else NOT_MY_VBUCKET) and gets a
  ``Takeover`` (takeover.py) that hands the vbucket over once the stream is caught up;
  the consumer's SUCCESS to its DCP_SET_VBUCKET_STATE (``StateAcked``) is routed to it by
  the stream's opaque. A refusal of any DCP message closes the connection.
- A stable-only connection (control ``stable_only``) may stream active vbuckets only,
  else NOT_MY_VBUCKET: the stable seqno is known on the active alone.
- ``consumer_name`` is set once per connection (the same name again is fine, another is
  EINVAL): the acks recorded under it are forgotten when the connection goes.
- DCP_SEQNO_ACKNOWLEDGED (a replica's ack) is seqno_ack.py's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..protocol import codec
from ..protocol.errors import RemoteProtocolError, StatusError
from ..protocol.events import Rejected, StateAcked
from ..protocol.frames import Frame
from ..protocol.opcodes import (
    DcpOpenFlag,
    Opcode,
    Status,
    StreamEndStatus,
    StreamRequestFlag,
    VBucketState,
)
from ..protocol.server_session import SESSION_CONTROLS
from . import stream_log
from .active_stream import ActiveStream, StreamOptions
from .engine import DecisionKind, decide_stream_request
from .seqno_ack import seqno_acknowledged
from .takeover import Takeover

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["DCP_HANDLERS", "handle_response"]

log = logging.getLogger("dcp.producer")

_TRUE = {"true": True, "false": False}


def _require_open(conn: Connection, f: Frame) -> bool:
    if conn.dcp_name is None:
        conn.error(f.opcode, Status.EINVAL, f.opaque, "send DCP_OPEN (producer) first")
        return False
    return True


def dcp_open(conn: Connection, f: Frame) -> None:
    name, flags = codec.parse_open(f)
    if conn.dcp_name is not None:
        conn.error(f.opcode, Status.EINVAL, f.opaque, "connection is already a DCP connection")
        return
    if flags & DcpOpenFlag.NOTIFIER:
        conn.error(f.opcode, Status.EINVAL, f.opaque, "notifier connections no longer exist")
        return
    if not flags & DcpOpenFlag.PRODUCER:
        conn.error(
            f.opcode,
            Status.NOT_SUPPORTED,
            f.opaque,
            "consumer DCP connections are not supported; set the producer flag 0x1",
        )
        return
    if flags & DcpOpenFlag.NO_VALUE and flags & DcpOpenFlag.NO_VALUE_WITH_UNDERLYING_DATATYPE:
        conn.error(f.opcode, Status.EINVAL, f.opaque, "open flags 0x8 and 0x40 are exclusive")
        return
    conn.dcp_name = name.decode("utf-8", "replace")
    conn.dcp_flags = flags
    conn.options = StreamOptions(
        no_value=bool(
            flags & (DcpOpenFlag.NO_VALUE | DcpOpenFlag.NO_VALUE_WITH_UNDERLYING_DATATYPE)
        ),
        include_delete_times=bool(flags & DcpOpenFlag.INCLUDE_DELETE_TIMES),
        keep_datatype=bool(flags & DcpOpenFlag.NO_VALUE_WITH_UNDERLYING_DATATYPE),
    )
    conn.cursor_dropping = "replication" not in conn.dcp_name
    conn.server.register_dcp_name(conn)
    log.debug("dcp open id=%d name=%s flags=0x%x", conn.id, conn.dcp_name, flags)
    conn.respond(codec.response(Opcode.DCP_OPEN, opaque=f.opaque))


def control(conn: Connection, f: Frame) -> None:
    if not _require_open(conn, f):
        return
    key = bytes(f.key).decode("utf-8", "replace")
    raw = bytes(f.value).decode("utf-8", "replace").strip()
    val = raw.lower()

    def bad(why: str, status: int = Status.EINVAL) -> None:
        conn.error(f.opcode, status, f.opaque, f"{key}={raw!r}: {why}")

    if key in SESSION_CONTROLS:  # noops and the flow-control window
        why = conn.session.control(key, raw)
        if why:
            return bad(why)
        if key == "connection_buffer_size":
            conn.wake()  # a new window may let the writer send
    elif key in ("supports_cursor_dropping", "supports_cursor_dropping_vulcan"):
        if val not in _TRUE:
            return bad("expected true or false")
        conn.cursor_dropping = _TRUE[val]
    elif key == "send_stream_end_on_client_close_stream":
        if val != "true":
            return bad("can only be turned on")
        conn.stream_end_on_close = True
    elif key == "enable_expiry_opcode":
        if val != "true":
            return bad("can only be turned on")
        conn.options.expiry_opcode = True
    elif key == "send_seqno_advanced":
        if val not in _TRUE:
            return bad("expected true or false")
        conn.options.seqno_advanced = _TRUE[val]
    elif key == "stable_only":
        if val not in _TRUE:
            return bad("expected true or false")
        conn.options.stable_only = _TRUE[val]
    elif key == "consumer_name":
        # the node name a replica acknowledges under (DCP_SEQNO_ACKNOWLEDGED); the gate
        # asks for 'replicate' first when users are configured (gate.py)
        if not raw or len(raw) > 200:
            return bad("expected a node name of 1-200 characters")
        if conn.consumer_name is not None and conn.consumer_name != raw:
            # one connection speaks for one node: switching would leave the first
            # node's acks recorded under a name this connection no longer answers for
            return bad(f"this connection already acknowledges as {conn.consumer_name!r}")
        conn.consumer_name = raw
    elif key == "change_streams":
        if val != "true":
            return bad("can only be turned on")
        if not conn.server.history_enabled:
            return bad(
                "the server keeps no history (history_seconds/history_bytes are 0)",
                Status.NOT_SUPPORTED,
            )
        conn.change_streams = True
    elif key == "set_priority":
        if val not in ("high", "medium", "low"):
            return bad("expected high, medium or low")
    elif key == "stream_buffer_size":
        return bad("per-stream flow control is not supported", Status.NOT_SUPPORTED)
    else:
        return bad("unknown control key")
    conn.respond(codec.response(Opcode.DCP_CONTROL, opaque=f.opaque))


def _client_purge_seqno(value: bytes) -> int:
    if not value:
        return 0
    try:
        obj = json.loads(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(f"DCP_STREAM_REQ value is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise RemoteProtocolError("DCP_STREAM_REQ value must be a JSON object")
    raw = obj.get("purge_seqno", "0")
    try:
        return int(raw)
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"purge_seqno {raw!r} is not a decimal string") from exc


def stream_req(conn: Connection, f: Frame) -> None:
    if not _require_open(conn, f):
        return
    req = codec.parse_stream_request(f)
    server = conn.server
    bucket = server.bucket
    vbid = req.vbucket
    if vbid >= bucket.num_vbuckets:
        conn.error(f.opcode, Status.NOT_MY_VBUCKET, f.opaque, f"no vbucket {vbid}")
        return
    existing = conn.streams.get(vbid)
    if existing is not None and not existing.is_dead:
        conn.error(f.opcode, Status.KEY_EEXISTS, f.opaque, f"a stream for vb {vbid} is open")
        return
    vb = bucket.vbucket(vbid)
    takeover = bool(req.flags & StreamRequestFlag.TAKEOVER)
    if takeover and vb.state is not VBucketState.ACTIVE:
        conn.error(
            f.opcode,
            Status.NOT_MY_VBUCKET,
            f.opaque,
            f"takeover of vb {vbid}: it is {vb.state.name}, not active",
        )
        return
    if conn.options.stable_only and vb.state is not VBucketState.ACTIVE:
        # only the active knows a stable seqno (0 elsewhere): such a stream would wait
        # forever; NOT_MY_VBUCKET sends the client to the map's active instead
        conn.error(
            f.opcode,
            Status.NOT_MY_VBUCKET,
            f.opaque,
            f"stable-only stream of vb {vbid}: it is {vb.state.name} here, not active",
        )
        return
    decision = decide_stream_request(
        failover_log=list(vb.failover_log.entries),
        high_seqno=vb.high_seqno,
        purge_seqno=vb.purge_seqno,
        persisted_seqno=vb.persisted_seqno,
        vb_state=vb.state,
        start=req.start_seqno,
        end=req.end_seqno,
        vb_uuid=req.vb_uuid,
        snap_start=req.snap_start_seqno,
        snap_end=req.snap_end_seqno,
        flags=req.flags,
        client_purge_seqno=_client_purge_seqno(req.value),
    )
    if decision.kind is DecisionKind.ROLLBACK:
        stream_log.count("rollback")
        log.debug(
            "stream request name=%s vb=%d start=%d uuid=%d snap=[%d,%d] -> rollback to %d (%s)",
            conn.dcp_name,
            vbid,
            req.start_seqno,
            req.vb_uuid,
            req.snap_start_seqno,
            req.snap_end_seqno,
            decision.rollback_seqno,
            decision.reason,
        )
        server.metrics.rollbacks += 1
        conn.respond(
            codec.response(
                Opcode.DCP_STREAM_REQ,
                Status.ROLLBACK,
                opaque=f.opaque,
                value=codec.U64.pack(decision.rollback_seqno),
            )
        )
        return
    if decision.kind is not DecisionKind.ACCEPT:
        stream_log.count("refused")
        log.debug(
            "stream request name=%s vb=%d start=%d end=%d -> %s (%s)",
            conn.dcp_name,
            vbid,
            req.start_seqno,
            req.end_seqno,
            Status(decision.status).name,
            decision.reason,
        )
        conn.error(f.opcode, decision.status, f.opaque, decision.reason)
        return
    stream = ActiveStream(
        name=f"{conn.dcp_name}:{vbid}:{f.opaque}",
        vbucket=vb,
        opaque=f.opaque,
        start_seqno=decision.start,
        end_seqno=decision.end,
        options=conn.options,
        history=conn.change_streams,
        on_backfill=server.backfills.start,
    )
    if takeover:
        stream.takeover = Takeover(
            stream, server.stream_registry, _recorder(server), bucket.flusher.state_persisted
        )
    conn.respond(
        codec.response(
            Opcode.DCP_STREAM_REQ,
            opaque=f.opaque,
            value=codec.failover_log_value(list(vb.failover_log.entries)),
        )
    )
    conn.streams[vbid] = stream
    server.stream_registry.add(conn, stream)
    stream_log.count("accepted")
    log.debug(
        "stream request name=%s vb=%d start=%d end=%d uuid=%d flags=0x%x -> accepted",
        conn.dcp_name,
        vbid,
        decision.start,
        decision.end,
        decision.vb_uuid,
        req.flags,
    )
    stream.activate()
    if decision.end < vb.high_seqno or (decision.end == vb.high_seqno and decision.end):
        # A finite stream ends on a boundary that later writes can no longer dedup into.
        # Closed only now that the stream's cursor pins it: closing it first could free a
        # fully persisted checkpoint and turn a memory stream into a needless backfill.
        vb.checkpoints.create_checkpoint()
    conn.announce_stream(stream)


def _recorder(server: Any) -> Callable[[int, VBucketState], None] | None:
    """How a takeover records the states it gives its vbucket with the node's assignment
    (``server.vbucket_states.set``), so a later reconcile keeps them (takeover.py)."""
    states = getattr(server, "vbucket_states", None)
    if states is None:
        return None

    def record(vb: int, state: VBucketState) -> None:
        try:
            states.set(vb, state, {})
        except StatusError as exc:
            log.error("takeover vb=%d: could not record state %s: %s", vb, state.name, exc)

    return record


def close_stream(conn: Connection, f: Frame) -> None:
    if not _require_open(conn, f):
        return
    stream = conn.streams.get(f.vbucket)
    if stream is None or stream.is_dead or stream.end_status is not None:
        conn.error(f.opcode, Status.KEY_ENOENT, f.opaque, f"no stream for vb {f.vbucket}")
        return
    conn.respond(codec.response(Opcode.DCP_CLOSE_STREAM, opaque=f.opaque))
    if conn.stream_end_on_close:
        stream.set_end(StreamEndStatus.CLOSED)
        conn.mark_ready(stream)
    else:
        stream.release()
        conn.stream_finished(stream)


def get_failover_log(conn: Connection, f: Frame) -> None:
    bucket = conn.server.bucket
    if f.vbucket >= bucket.num_vbuckets:
        conn.error(f.opcode, Status.NOT_MY_VBUCKET, f.opaque, f"no vbucket {f.vbucket}")
        return
    entries = list(bucket.vbucket(f.vbucket).failover_log.entries)
    conn.respond(
        codec.response(
            Opcode.DCP_GET_FAILOVER_LOG, opaque=f.opaque, value=codec.failover_log_value(entries)
        )
    )


def buffer_ack(conn: Connection, f: Frame) -> None:
    if not _require_open(conn, f):
        return
    conn.session.buffer_ack(f)
    conn.wake()


def handle_response(conn: Connection, r: Rejected | StateAcked) -> None:
    """The client answered a DCP message the session reports. A refusal (``Rejected``):
    kv_engine closes such a connection, and so do we (a takeover under way is undone by
    its stream's release, takeover.py). A SUCCESS to a takeover's state message
    (``StateAcked``) goes to the takeover stream with that opaque."""
    if isinstance(r, StateAcked):
        for stream in conn.streams.values():
            if stream.opaque == r.opaque and stream.takeover is not None:
                if stream.takeover.acked():
                    return
                break
        log.warning(
            "client id=%d name=%s acknowledged a vbucket state with opaque %d that no "
            "takeover stream waits for; ignored",
            conn.id,
            conn.dcp_name,
            r.opaque,
        )
        return
    log.warning(
        "client id=%d name=%s answered opcode 0x%02x with status 0x%02x; closing",
        conn.id,
        conn.dcp_name,
        r.opcode,
        r.status,
    )
    conn.close(f"client rejected opcode 0x{r.opcode:02x}")


DCP_HANDLERS: dict[int, Callable[[Connection, Frame], None]] = {
    Opcode.DCP_OPEN: dcp_open,
    Opcode.DCP_CONTROL: control,
    Opcode.DCP_STREAM_REQ: stream_req,
    Opcode.DCP_CLOSE_STREAM: close_stream,
    Opcode.DCP_GET_FAILOVER_LOG: get_failover_log,
    Opcode.DCP_BUFFER_ACK: buffer_ack,
    Opcode.DCP_SEQNO_ACKNOWLEDGED: seqno_acknowledged,
}
