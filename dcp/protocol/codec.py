"""Builders and parsers for every frame we speak, on precompiled ``struct``.

Rules of this module:
- This is the code that runs; ``spec.py`` (construct) is the reference. A property test
  proves the two produce and accept identical bytes.
- Builders return ``bytes`` ready to send; they validate what the caller gives them and
  raise ``LocalProtocolError``. Parsers take a ``Frame`` from the network and raise
  ``RemoteProtocolError`` on a wrong extras length or value size: they never trust it.
- The per-item hot path (mutation, deletion, expiration, snapshot marker, buffer ack)
  lives in ``item_codec.py`` and is re-exported here: ``codec.X`` names every builder
  and parser. This module holds the generic ``request``/``response`` and the cold ones
  (handshake, DCP control, KV, frame infos), whose out-of-range fields the
  ``_refuses_out_of_range`` wrapper turns into ``LocalProtocolError``.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass

from .errors import InvalidArguments, LocalProtocolError, RemoteProtocolError
from .frames import Frame, encode_frame, encode_frame_infos, need_extras, parse_frame_infos
from .item_codec import (
    buffer_ack,
    dcp_header,
    deletion,
    deletion_body,
    expiration,
    expiration_body,
    mutation,
    mutation_body,
    parse_buffer_ack,
    parse_deletion,
    parse_expiration,
    parse_mutation,
    parse_seqno_advanced,
    parse_snapshot_marker,
    parse_stream_end,
    snapshot_marker,
)
from .layout import (
    DELETION_V1_EXTRAS,
    DELETION_V2_EXTRAS,
    EXPIRATION_EXTRAS,
    FAILOVER_ENTRY,
    HDR_MUTATION,
    HEADER,
    MARKER_V1,
    MARKER_V2_0,
    MUTATION_EXTRAS,
    MUTATION_SEQNO,
    OPEN_EXTRAS,
    STORE_EXTRAS,
    STREAM_REQ_EXTRAS,
    U16,
    U32,
    U64,
    VB_SEQNO,
    vbucket_for_key,
)
from .opcodes import (
    SEQNO_MAX,
    DurabilityLevel,
    FrameInfoId,
    Magic,
    Opcode,
    Status,
)

__all__ = [
    "DELETION_V1_EXTRAS",
    "DELETION_V2_EXTRAS",
    "EXPIRATION_EXTRAS",
    "HDR_MUTATION",
    "HEADER",
    "MARKER_V1",
    "MARKER_V2_0",
    "MUTATION_EXTRAS",
    "STREAM_REQ_EXTRAS",
    "StreamRequest",
    "all_vb_seqnos_value",
    "buffer_ack",
    "dcp_control",
    "dcp_header",
    "dcp_open",
    "deletion",
    "deletion_body",
    "durability_frame_info",
    "expiration",
    "expiration_body",
    "failover_log_value",
    "hello",
    "json_value",
    "mutation",
    "mutation_body",
    "mutation_seqno_extras",
    "parse_all_vb_seqnos",
    "parse_buffer_ack",
    "parse_deletion",
    "parse_durability",
    "parse_expiration",
    "parse_failover_log",
    "parse_hello_features",
    "parse_mutation",
    "parse_mutation_seqno",
    "parse_open",
    "parse_seqno_advanced",
    "parse_snapshot_marker",
    "parse_store_extras",
    "parse_stream_end",
    "parse_stream_id",
    "parse_stream_request",
    "request",
    "response",
    "sasl_auth",
    "sasl_list_mechs",
    "sasl_step",
    "seqno_advanced",
    "snapshot_marker",
    "store_extras",
    "stream_end",
    "stream_id_frame_info",
    "stream_request",
    "vbucket_for_key",
]

# The layouts live in ``layout.py``; codec's names for them stay importable from here.


# --------------------------------------------------------------------------- generic


def request(
    opcode: int,
    *,
    vbucket: int = 0,
    opaque: int = 0,
    cas: int = 0,
    datatype: int = 0,
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
    framing_extras: bytes = b"",
) -> bytes:
    """A client (or DCP producer) request; alt magic 0x08 when framing extras are given."""
    magic = Magic.ALT_REQUEST if framing_extras else Magic.REQUEST
    return encode_frame(
        magic,
        opcode,
        vbucket=vbucket,
        opaque=opaque,
        cas=cas,
        datatype=datatype,
        framing_extras=framing_extras,
        extras=extras,
        key=key,
        value=value,
    )


def response(
    opcode: int,
    status: int = Status.SUCCESS,
    *,
    opaque: int = 0,
    cas: int = 0,
    datatype: int = 0,
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
) -> bytes:
    return encode_frame(
        Magic.RESPONSE,
        opcode,
        vbucket=status,
        opaque=opaque,
        cas=cas,
        datatype=datatype,
        extras=extras,
        key=key,
        value=value,
    )


def _refuses_out_of_range(builder):
    """Turn ``struct.error``/``ValueError`` of an out-of-range field into ``LocalProtocolError``.

    For the cold builders only; the hot ones catch ``struct.error`` inline (no extra call).
    """

    @functools.wraps(builder)
    def wrapper(*args, **kwargs):
        try:
            return builder(*args, **kwargs)
        except (struct.error, ValueError) as exc:
            raise LocalProtocolError.out_of_range(builder.__name__, exc) from exc

    return wrapper


# --------------------------------------------------------------------------- DCP control


@_refuses_out_of_range
def dcp_open(name: str | bytes, flags: int, opaque: int = 0, value: bytes = b"") -> bytes:
    key = name.encode() if isinstance(name, str) else name
    if not key or len(key) > 200:
        raise LocalProtocolError("DCP connection name must be 1..200 bytes")
    return request(
        Opcode.DCP_OPEN, opaque=opaque, extras=OPEN_EXTRAS.pack(0, flags), key=key, value=value
    )


def parse_open(frame: Frame) -> tuple[bytes, int]:
    """(connection name, flags) of a DCP_OPEN request."""
    need_extras(frame, 8, "DCP_OPEN")
    if not frame.key or len(frame.key) > 200:
        raise RemoteProtocolError("DCP_OPEN: connection name must be 1..200 bytes")
    _seqno, flags = OPEN_EXTRAS.unpack(frame.extras)
    return bytes(frame.key), flags


def dcp_control(key: str, value: str, opaque: int = 0) -> bytes:
    if not key:
        raise LocalProtocolError("DCP_CONTROL needs a setting name (key)")
    return request(Opcode.DCP_CONTROL, opaque=opaque, key=key.encode(), value=value.encode())


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamRequest:
    """Fields of a DCP_STREAM_REQ (extras plus optional JSON value)."""

    vbucket: int
    opaque: int
    flags: int = 0
    start_seqno: int = 0
    end_seqno: int = SEQNO_MAX
    vb_uuid: int = 0
    snap_start_seqno: int = 0
    snap_end_seqno: int = 0
    value: bytes = b""

    def encode(self) -> bytes:
        return stream_request(
            self.vbucket,
            self.opaque,
            flags=self.flags,
            start=self.start_seqno,
            end=self.end_seqno,
            vb_uuid=self.vb_uuid,
            snap_start=self.snap_start_seqno,
            snap_end=self.snap_end_seqno,
            value=self.value,
        )


def stream_request(
    vbucket: int,
    opaque: int,
    *,
    flags: int = 0,
    start: int = 0,
    end: int = SEQNO_MAX,
    vb_uuid: int = 0,
    snap_start: int = 0,
    snap_end: int = 0,
    value: bytes = b"",
) -> bytes:
    try:
        ext = STREAM_REQ_EXTRAS.pack(flags, 0, start, end, vb_uuid, snap_start, snap_end)
    except struct.error as exc:
        raise LocalProtocolError(f"stream request field out of range: {exc}") from exc
    return request(Opcode.DCP_STREAM_REQ, vbucket=vbucket, opaque=opaque, extras=ext, value=value)


def parse_stream_request(frame: Frame) -> StreamRequest:
    need_extras(frame, 48, "DCP_STREAM_REQ")
    if frame.key:
        raise RemoteProtocolError("DCP_STREAM_REQ must not have a key")
    flags, _res, start, end, uuid, ss, se = STREAM_REQ_EXTRAS.unpack(frame.extras)
    return StreamRequest(
        vbucket=frame.vbucket,
        opaque=frame.opaque,
        flags=flags,
        start_seqno=start,
        end_seqno=end,
        vb_uuid=uuid,
        snap_start_seqno=ss,
        snap_end_seqno=se,
        value=bytes(frame.value),
    )


@_refuses_out_of_range
def failover_log_value(entries: list[tuple[int, int]]) -> bytes:
    """Value of a stream-request OK / get-failover-log response: (uuid, seqno) newest first."""
    return b"".join(FAILOVER_ENTRY.pack(u, s) for u, s in entries)


def parse_failover_log(value: bytes) -> list[tuple[int, int]]:
    if len(value) % 16:
        raise RemoteProtocolError(f"failover log of {len(value)} bytes is not a multiple of 16")
    return [FAILOVER_ENTRY.unpack_from(value, i) for i in range(0, len(value), 16)]


@_refuses_out_of_range
def stream_end(vbucket: int, opaque: int, status: int) -> bytes:
    return dcp_header(Opcode.DCP_STREAM_END, 0, 4, 0, vbucket, 4, opaque, 0) + U32.pack(status)


@_refuses_out_of_range
def seqno_advanced(vbucket: int, opaque: int, seqno: int) -> bytes:
    return dcp_header(Opcode.DCP_SEQNO_ADVANCED, 0, 8, 0, vbucket, 8, opaque, 0) + U64.pack(seqno)


@_refuses_out_of_range
def seqno_acknowledged(
    vbucket: int, opaque: int, seqno: int, persisted: int | None = None
) -> bytes:
    """DCP_SEQNO_ACKNOWLEDGED (0x61), consumer (a replica) -> producer (its active), with
    the opaque of the stream it acknowledges: extras ``u64 seqno`` (the highest seqno held
    in whole snapshots, Couchbase's 8-byte layout); our extension adds the highest
    persisted seqno as an 8-byte value. No response on success."""
    value = b"" if persisted is None else U64.pack(persisted)
    return (
        dcp_header(Opcode.DCP_SEQNO_ACKNOWLEDGED, 0, 8, 0, vbucket, 8 + len(value), opaque, 0)
        + U64.pack(seqno)
        + value
    )


def parse_seqno_acknowledged(frame: Frame) -> tuple[int, int | None]:
    """``(seqno held, seqno persisted or None)`` of a DCP_SEQNO_ACKNOWLEDGED.

    Raises:
        RemoteProtocolError: extras not 8 bytes, a key, or a value not 0 or 8 bytes.
    """
    need_extras(frame, 8, "DCP_SEQNO_ACKNOWLEDGED")
    if frame.key:
        raise RemoteProtocolError("DCP_SEQNO_ACKNOWLEDGED carries no key")
    value = frame.value
    if len(value) not in (0, 8):
        raise RemoteProtocolError(
            f"DCP_SEQNO_ACKNOWLEDGED value of {len(value)} bytes (0 or 8: persisted seqno)"
        )
    seqno = U64.unpack_from(frame.extras)[0]
    return seqno, (U64.unpack_from(value)[0] if value else None)


@_refuses_out_of_range
def dcp_set_vbucket_state(vbucket: int, opaque: int, state: int) -> bytes:
    """DCP_SET_VBUCKET_STATE (0x5b), producer -> consumer inside a takeover stream:
    1 byte of extras (the new state), no key, no value."""
    return dcp_header(Opcode.DCP_SET_VBUCKET_STATE, 0, 1, 0, vbucket, 1, opaque, 0) + bytes(
        (state,)
    )


def parse_dcp_set_vbucket_state(frame: Frame) -> int:
    """The state (1..4) of a DCP_SET_VBUCKET_STATE frame.

    Raises:
        RemoteProtocolError: extras not 1 byte, a key or value, or an unknown state.
    """
    if len(frame.extras) != 1 or frame.key or frame.value:
        raise RemoteProtocolError("DCP_SET_VBUCKET_STATE needs 1 byte of extras only")
    state = frame.extras[0]
    if not 1 <= state <= 4:
        raise RemoteProtocolError(f"DCP_SET_VBUCKET_STATE: unknown state {state}")
    return state


def set_vbucket_state(vbucket: int, state: int, opaque: int = 0, options: object = None) -> bytes:
    """SET_VBUCKET_STATE (0x3d): 1 byte of extras (the state); ``options``, when given,
    is sent as the JSON value (datatype JSON), as ns_server sends its topology."""
    value = json_value(options) if options is not None else b""
    return request(
        Opcode.SET_VBUCKET_STATE,
        vbucket=vbucket,
        extras=bytes((state,)),
        value=value,
        datatype=0x01 if value else 0,
        opaque=opaque,
    )


def parse_set_vbucket_state(frame: Frame) -> tuple[int, dict]:
    """(state, JSON options or {}) of a SET_VBUCKET_STATE request.

    Raises:
        InvalidArguments: extras not 1 byte, a key, an unknown state, a value that is not
            a JSON object or not marked JSON (EINVAL, as kv_engine's validator).
    """
    if len(frame.extras) != 1 or frame.key:
        raise InvalidArguments(Status.EINVAL, "SET_VBUCKET_STATE needs 1 byte of extras, no key")
    state = frame.extras[0]
    if not 1 <= state <= 4:
        raise InvalidArguments(Status.EINVAL, f"unknown vbucket state {state}")
    if not frame.value:
        return state, {}
    if not frame.datatype & 0x01:
        raise InvalidArguments(Status.EINVAL, "SET_VBUCKET_STATE value must have datatype JSON")
    try:
        options = json.loads(bytes(frame.value))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArguments(Status.EINVAL, f"SET_VBUCKET_STATE value: {exc}") from exc
    if not isinstance(options, dict):
        raise InvalidArguments(Status.EINVAL, "SET_VBUCKET_STATE value must be a JSON object")
    return state, options


def get_vbucket_value(state: int) -> bytes:
    """The GET_VBUCKET (0x3e) response value: the state as a big-endian u32."""
    return U32.pack(state)


@_refuses_out_of_range
def all_vb_seqnos_value(pairs: list[tuple[int, int]]) -> bytes:
    return b"".join(VB_SEQNO.pack(vb, s) for vb, s in pairs)


def parse_all_vb_seqnos(value: bytes) -> list[tuple[int, int]]:
    if len(value) % 10:
        raise RemoteProtocolError(f"vbucket seqno list of {len(value)} bytes is not 10*n")
    return [VB_SEQNO.unpack_from(value, i) for i in range(0, len(value), 10)]


# --------------------------------------------------------------------------- KV


@_refuses_out_of_range
def store_extras(flags: int = 0, expiry: int = 0) -> bytes:
    return STORE_EXTRAS.pack(flags, expiry)


def parse_store_extras(frame: Frame) -> tuple[int, int]:
    need_extras(frame, 8, f"opcode 0x{frame.opcode:02x}")
    return STORE_EXTRAS.unpack(frame.extras)


@_refuses_out_of_range
def durability_frame_info(level: int, timeout_ms: int | None = None) -> bytes:
    data = bytes([level]) if timeout_ms is None else bytes([level]) + U16.pack(timeout_ms)
    return encode_frame_infos([(FrameInfoId.DURABILITY, data)])


def parse_durability(frame: Frame) -> int:
    """Durability level requested by a frame's frame infos (0 = none).

    Raises:
        RemoteProtocolError: malformed frame infos or durability payload.
    """
    if not frame.framing_extras:
        return DurabilityLevel.NONE
    for fid, data in parse_frame_infos(frame.framing_extras):
        if fid == FrameInfoId.DURABILITY:
            if len(data) not in (1, 3):
                raise RemoteProtocolError(f"durability frame info of {len(data)} bytes")
            return data[0]
    return DurabilityLevel.NONE


@_refuses_out_of_range
def stream_id_frame_info(sid: int) -> bytes:
    return encode_frame_infos([(FrameInfoId.DCP_STREAM_ID, U16.pack(sid))])


def parse_stream_id(frame: Frame) -> int | None:
    for fid, data in parse_frame_infos(frame.framing_extras):
        if fid == FrameInfoId.DCP_STREAM_ID:
            if len(data) != 2:
                raise RemoteProtocolError(f"stream-id frame info of {len(data)} bytes")
            return U16.unpack(data)[0]
    return None


@_refuses_out_of_range
def mutation_seqno_extras(vb_uuid: int, seqno: int) -> bytes:
    return MUTATION_SEQNO.pack(vb_uuid, seqno)


def parse_mutation_seqno(frame: Frame) -> tuple[int, int] | None:
    """(vb_uuid, seqno) from a write response when MutationSeqno was negotiated."""
    if len(frame.extras) == 16:
        return MUTATION_SEQNO.unpack(frame.extras)
    if frame.extras:
        raise RemoteProtocolError(f"write response extras of {len(frame.extras)} bytes")
    return None


@_refuses_out_of_range
def hello(agent: str, features: list[int], opaque: int = 0) -> bytes:
    return request(
        Opcode.HELLO,
        opaque=opaque,
        key=agent.encode(),
        value=b"".join(U16.pack(f) for f in features),
    )


def parse_hello_features(value: bytes) -> list[int]:
    if len(value) % 2:
        raise RemoteProtocolError("HELLO value must be a list of 16-bit feature codes")
    return [U16.unpack_from(value, i)[0] for i in range(0, len(value), 2)]


def sasl_list_mechs(opaque: int = 0) -> bytes:
    """SASL_LIST_MECHS: header only; the answer is the mechanisms, space-separated."""
    return request(Opcode.SASL_LIST_MECHS, opaque=opaque)


def _sasl(opcode: int, mechanism: str, data: bytes, opaque: int) -> bytes:
    if not mechanism:
        raise LocalProtocolError("SASL needs a mechanism name (key)")
    return request(opcode, opaque=opaque, key=mechanism.encode(), value=data)


def sasl_auth(mechanism: str, data: bytes, opaque: int = 0) -> bytes:
    """SASL_AUTH: key = mechanism, value = the client's first message (dcp/protocol/sasl.py)."""
    return _sasl(Opcode.SASL_AUTH, mechanism, data, opaque)


def sasl_step(mechanism: str, data: bytes, opaque: int = 0) -> bytes:
    """SASL_STEP: key = mechanism, value = the client's next message."""
    return _sasl(Opcode.SASL_STEP, mechanism, data, opaque)


def json_value(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
