"""Executable specification of every frame we speak, written with ``construct``.

Rules of this module:
- construct and the standard library only: no trio, sockets or clock. This is the
  reference that ``codec.py``/``frames.py`` (the struct hot path) are tested against, and the
  source of the golden vectors in ``protocol_spec/vectors/`` (``python -m tools.vectors``).
- Tests and tools only: nothing at run time imports this module (``dcp/protocol/__init__.py``
  does not), so construct is in the ``dev`` extra, not in the dependencies.
- Layouts are data. ``REQUESTS`` and ``RESPONSES`` map an opcode to the extras shapes it
  accepts (by extras length) and the layout of its value; ``Frame`` only dispatches on them.
- Parsing checks *layout*, never semantics: magic, header lengths against the body, the
  extras length of every known opcode, key presence in requests, exact value sizes
  (failover log = n x 16 bytes ...). Seqno rules, flags and statuses are the engine's business
  and are described in ``protocol_spec/README.md``. Every failure is a ``ConstructError``.
- Building computes every length field from the parts. Where one opcode has several extras
  shapes (deletion V1/V2, snapshot marker V1/V2, ...) the shape is picked by the field names
  given; fields built with ``Default`` (reserved bytes, nmeta, nru) may be left out.
- Client requests are magic 0x80 and 0x08 (alt, with frame infos), responses 0x81 and 0x18.
  Magic 0x82/0x83 frames (server-initiated, not DCP) are split by lengths but not typed.
- ``Frame.compile()`` works (``python -m tools.bench.micro.codec`` measures it), but
  compiled parsing skips construct's stream checks: parse untrusted bytes with
  ``parse_frame``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from construct import (
    Adapter,
    BitStruct,
    Bytes,
    Computed,
    Construct,
    Container,
    Default,
    ExplicitError,
    FixedSized,
    FocusedSeq,
    GreedyBytes,
    GreedyRange,
    If,
    IfThenElse,
    Int8ub,
    Int16ub,
    Int32ub,
    Int64ub,
    ListContainer,
    Nibble,
    OneOf,
    Pass,
    Rebuild,
    Struct,
    Switch,
    Terminated,
    len_,
    this,
)

from .opcodes import FrameInfoId, Magic, Opcode, Status

__all__ = [
    "REQUESTS", "RESPONSES", "BufferAckExtras", "DcpOpenExtras", "DeletionV1Extras",
    "DeletionV2Extras", "DurabilityPayload", "ExpirationExtras", "FailoverEntry", "FailoverLog",
    "Frame", "FrameInfo", "FrameInfos", "GetAllVbSeqnosCollectionExtras", "GetAllVbSeqnosExtras",
    "GetResponseExtras", "Header", "HelloFeatures", "LayoutError", "MutationExtras",
    "MutationSeqnoExtras", "RollbackValue", "SeqnoAdvancedExtras", "SnapshotMarkerV1Extras",
    "SnapshotMarkerV2Extras", "SnapshotMarkerV2_0Value", "SnapshotMarkerV2_2Value", "StoreExtras",
    "StreamEndExtras", "StreamIdPayload", "StreamRequestExtras", "VbSeqno", "VbSeqnoList",
    "build_frame", "parse_frame", "to_plain",
]

U8, U16, U32, U64 = Int8ub, Int16ub, Int32ub, Int64ub


class LayoutError(ExplicitError):
    """Bytes (or fields) that do not fit the layout this spec gives them."""


class _Require(Construct):
    """Consumes nothing; fails with ``message(context)`` unless ``predicate(context)``."""

    def __init__(self, predicate: Callable[[Any], bool], message: Callable[[Any], str]) -> None:
        super().__init__()
        self.predicate, self.message = predicate, message
        self.flagbuildnone = True

    def _parse(self, stream, context, path):
        if not self.predicate(context):
            raise LayoutError(self.message(context), path=path)

    def _build(self, obj, stream, context, path):
        self._parse(stream, context, path)

    def _sizeof(self, context, path):
        return 0


def _reject(message: Callable[[Any], str]) -> Construct:
    """Always fails: the opcode is known but this shape of it is not."""
    return _Require(lambda c: False, message)


class _Derived(Rebuild):
    """A length computed from the other fields when building (``Rebuild`` with a function).

    Parsing compiles as usual; building falls back to this instance under ``compile()``,
    because construct can only compile ``this`` expressions.
    """

    def _emitbuild(self, code):
        raise NotImplementedError


def _exact(subcon: Construct) -> Construct:
    """``subcon`` must consume its whole (fixed-size) substream."""
    return FocusedSeq("value", "value" / subcon, Terminated)


# --------------------------------------------------------------------------- extras layouts

DcpOpenExtras = Struct("seqno" / Default(U32, 0), "flags" / U32)  # 8 B, seqno reserved (0)
StreamRequestExtras = Struct(  # 48 B
    "flags" / U32, "reserved" / Default(U32, 0), "start_seqno" / U64, "end_seqno" / U64,
    "vb_uuid" / U64, "snap_start_seqno" / U64, "snap_end_seqno" / U64,
)
StreamEndExtras = Struct("status" / U32)  # 4 B, a StreamEndStatus
SnapshotMarkerV1Extras = Struct("start_seqno" / U64, "end_seqno" / U64, "flags" / U32)  # 20 B
SnapshotMarkerV2Extras = Struct("version" / U8)  # 1 B: 0 = v2.0, 2 = v2.2; fields in the value
MutationExtras = Struct(  # 31 B
    "by_seqno" / U64, "rev_seqno" / U64, "flags" / U32, "expiration" / U32, "lock_time" / U32,
    "nmeta" / Default(U16, 0), "nru" / Default(U8, 0),
)
DeletionV1Extras = Struct("by_seqno" / U64, "rev_seqno" / U64, "nmeta" / Default(U16, 0))  # 18
DeletionV2Extras = Struct(  # 21 B
    "by_seqno" / U64, "rev_seqno" / U64, "delete_time" / U32, "unused" / Default(U8, 0)
)
ExpirationExtras = Struct("by_seqno" / U64, "rev_seqno" / U64, "delete_time" / U32)  # 20 B
BufferAckExtras = Struct("bytes_to_ack" / U32)  # 4 B
SeqnoAdvancedExtras = Struct("seqno" / U64)  # 8 B
GetAllVbSeqnosExtras = Struct("vbucket_state" / U32)  # 4 B; 0 = every live vbucket
GetAllVbSeqnosCollectionExtras = Struct("vbucket_state" / U32, "collection_id" / U32)  # 8 B
StoreExtras = Struct("flags" / U32, "expiration" / U32)  # 8 B: SET, ADD, REPLACE requests
GetResponseExtras = Struct("flags" / U32)  # 4 B: GET success response
MutationSeqnoExtras = Struct("vb_uuid" / U64, "seqno" / U64)  # 16 B: write response (HELLO 0x04)

# --------------------------------------------------------------------------- value layouts

SnapshotMarkerV2_0Value = Struct(  # 36 B
    "start_seqno" / U64, "end_seqno" / U64, "flags" / U32, "max_visible_seqno" / U64,
    "high_completed_seqno" / U64,
)
SnapshotMarkerV2_2Value = Struct(  # 52 B; accepted, never sent by us
    *SnapshotMarkerV2_0Value.subcons, "purge_seqno" / U64, "high_prepared_seqno" / U64
)
FailoverEntry = Struct("vb_uuid" / U64, "seqno" / U64)
FailoverLog = _exact(GreedyRange(FailoverEntry))  # newest entry first
RollbackValue = _exact(Struct("rollback_seqno" / U64))
VbSeqno = Struct("vbucket" / U16, "seqno" / U64)
VbSeqnoList = _exact(GreedyRange(VbSeqno))  # sorted by vbucket
HelloFeatures = _exact(GreedyRange(U16))
_NoValue = _exact(Bytes(0))
_Raw = GreedyBytes

# --------------------------------------------------------------------------- frame infos

DurabilityPayload = {1: Struct("level" / U8), 3: Struct("level" / U8, "timeout_ms" / U16)}
StreamIdPayload = {2: Struct("stream_id" / U16)}
_FRAME_INFO_PAYLOADS = {FrameInfoId.DURABILITY: DurabilityPayload,
                        FrameInfoId.DCP_STREAM_ID: StreamIdPayload}

_FrameInfoWire = Struct(
    "nibbles" / BitStruct("id" / Nibble, "length" / Nibble),
    "id_escape" / If(this.nibbles.id == 15, U8),  # id = 15 + this byte
    "length_escape" / If(this.nibbles.length == 15, U8),  # length = 15 + this byte
    "payload" / Bytes(lambda c: c.nibbles.length + (c.length_escape or 0)),
)


def _fits(layout: Construct, obj: Any) -> bool:
    """Whether ``obj`` (a dict of fields) is a value for the Struct ``layout``."""
    if layout is Pass:
        return not obj
    if not isinstance(obj, dict):
        return False
    names = {sc.name for sc in layout.subcons if sc.name}
    needed = {sc.name for sc in layout.subcons if sc.name and not sc.flagbuildnone}
    given = {k for k in obj if not k.startswith("_")}
    return needed <= given <= names


def _payload_shapes(fid: int, context) -> dict[int, Construct] | None:
    """Typed payloads exist for request frame infos only (response ids mean other things)."""
    while context is not None and "magic" not in context:
        context = context.get("_")
    if context is not None and context["magic"] not in (Magic.REQUEST, Magic.ALT_REQUEST):
        return None
    return _FRAME_INFO_PAYLOADS.get(fid)


class _FrameInfoAdapter(Adapter):
    """``{"id": 2, "stream_id": 7}``, ``{"id": 1, "level": 3}``, or ``{"id": n, "payload": b}``.

    Ids 1 and 2 are typed in requests; in responses, and for other ids, the payload is raw.
    """

    def _decode(self, obj, context, path):
        fid = obj.nibbles.id + (obj.id_escape or 0)
        shapes = _payload_shapes(fid, context)
        if shapes is None:
            return Container(id=fid, payload=obj.payload)
        layout = shapes.get(len(obj.payload))
        if layout is None:
            raise LayoutError(f"frame info {fid} of {len(obj.payload)} bytes", path=path)
        return Container(id=fid, **{k: v for k, v in layout.parse(obj.payload).items()
                                    if not k.startswith("_")})

    def _encode(self, obj, context, path):
        fid = obj["id"]
        shapes = _payload_shapes(fid, context)
        if shapes is None:
            payload = obj["payload"]
        else:
            fields = {k: v for k, v in obj.items() if k != "id"}
            layout = next((sc for sc in shapes.values() if _fits(sc, fields)), None)
            if layout is None:
                raise LayoutError(f"fields {sorted(fields)} fit no frame info {fid}", path=path)
            payload = layout.build(fields)
        n = len(payload)
        if fid > 15 + 0xFF or n > 15 + 0xFF:
            raise LayoutError(f"frame info id {fid} / length {n} too large", path=path)
        return dict(
            nibbles=dict(id=min(fid, 15), length=min(n, 15)),
            id_escape=fid - 15 if fid >= 15 else None,
            length_escape=n - 15 if n >= 15 else None,
            payload=payload,
        )


FrameInfo = _FrameInfoAdapter(_FrameInfoWire)
FrameInfos = _exact(GreedyRange(FrameInfo))

# --------------------------------------------------------------------------- opcode tables

_ANY, _NONE, _NEEDED = (0, 0xFFFF), (0, 0), (1, 0xFFFF)
_NO_EXTRAS = {0: Pass}

#: Client requests (magic 0x80/0x08): opcode -> (extras shapes by length, key length
#: range, value layout). Opcodes not listed are split by lengths only.
REQUESTS: dict[int, tuple[dict[int, Construct], tuple[int, int], Construct]] = {
    Opcode.GET: (_NO_EXTRAS, _NEEDED, _NoValue),
    Opcode.SET: ({8: StoreExtras}, _NEEDED, _Raw),
    Opcode.ADD: ({8: StoreExtras}, _NEEDED, _Raw),
    Opcode.REPLACE: ({8: StoreExtras}, _NEEDED, _Raw),
    Opcode.DELETE: (_NO_EXTRAS, _NEEDED, _NoValue),
    Opcode.NOOP: (_NO_EXTRAS, _NONE, _NoValue),
    Opcode.VERSION: (_NO_EXTRAS, _NONE, _NoValue),
    Opcode.STAT: (_NO_EXTRAS, _ANY, _NoValue),  # key = stat group, empty = default group
    Opcode.HELLO: (_NO_EXTRAS, _ANY, HelloFeatures),  # key = user agent
    Opcode.GET_ALL_VB_SEQNOS: (
        {0: Pass, 4: GetAllVbSeqnosExtras, 8: GetAllVbSeqnosCollectionExtras}, _NONE, _NoValue
    ),
    Opcode.DCP_OPEN: ({8: DcpOpenExtras}, (1, 200), _Raw),  # key = name; value: opt. JSON
    Opcode.DCP_CLOSE_STREAM: (_NO_EXTRAS, _NONE, _NoValue),
    Opcode.DCP_STREAM_REQ: ({48: StreamRequestExtras}, _NONE, _Raw),  # value: opt. JSON
    Opcode.DCP_GET_FAILOVER_LOG: (_NO_EXTRAS, _NONE, _NoValue),
    Opcode.DCP_STREAM_END: ({4: StreamEndExtras}, _NONE, _NoValue),
    Opcode.DCP_SNAPSHOT_MARKER: (
        {20: SnapshotMarkerV1Extras, 1: SnapshotMarkerV2Extras},
        _NONE,
        Switch(this.extras_length, {20: _NoValue, 1: Switch(this.extras.version, {
            0: _exact(SnapshotMarkerV2_0Value), 2: _exact(SnapshotMarkerV2_2Value)},
            default=_reject(lambda c: f"snapshot marker version {c.extras.version}"))}),
    ),
    Opcode.DCP_MUTATION: ({31: MutationExtras}, _NEEDED, _Raw),
    Opcode.DCP_DELETION: ({18: DeletionV1Extras, 21: DeletionV2Extras}, _NEEDED, _Raw),
    Opcode.DCP_EXPIRATION: ({20: ExpirationExtras}, _NEEDED, _Raw),
    Opcode.DCP_NOOP: (_NO_EXTRAS, _NONE, _NoValue),
    Opcode.DCP_BUFFER_ACK: ({4: BufferAckExtras}, _NONE, _NoValue),
    Opcode.DCP_CONTROL: (_NO_EXTRAS, _NEEDED, _Raw),  # key = setting, value = its value
    Opcode.DCP_SEQNO_ADVANCED: ({8: SeqnoAdvancedExtras}, _NONE, _NoValue),
}

_WRITE_RESPONSE = ({0: Pass, 16: MutationSeqnoExtras}, {})
#: Responses (magic 0x81/0x18): opcode -> (extras shapes by length, value layout by status).
#: Any other status (and any listed opcode's error reply) carries raw bytes, e.g. error text.
RESPONSES: dict[int, tuple[dict[int, Construct], dict[int, Construct]]] = {
    Opcode.GET: ({0: Pass, 4: GetResponseExtras}, {}),
    Opcode.SET: _WRITE_RESPONSE,
    Opcode.ADD: _WRITE_RESPONSE,
    Opcode.REPLACE: _WRITE_RESPONSE,
    Opcode.DELETE: _WRITE_RESPONSE,
    Opcode.HELLO: (_NO_EXTRAS, {Status.SUCCESS: HelloFeatures}),
    Opcode.GET_ALL_VB_SEQNOS: (_NO_EXTRAS, {Status.SUCCESS: VbSeqnoList}),
    Opcode.DCP_STREAM_REQ: (
        _NO_EXTRAS, {Status.SUCCESS: FailoverLog, Status.ROLLBACK: RollbackValue}
    ),
    Opcode.DCP_GET_FAILOVER_LOG: (_NO_EXTRAS, {Status.SUCCESS: FailoverLog}),
    **{op: (_NO_EXTRAS, {}) for op in (
        Opcode.NOOP, Opcode.VERSION, Opcode.STAT, Opcode.DCP_OPEN, Opcode.DCP_CLOSE_STREAM,
        Opcode.DCP_STREAM_END, Opcode.DCP_SNAPSHOT_MARKER, Opcode.DCP_MUTATION,
        Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION, Opcode.DCP_NOOP, Opcode.DCP_BUFFER_ACK,
        Opcode.DCP_CONTROL, Opcode.DCP_SEQNO_ADVANCED)},
}

# --------------------------------------------------------------------------- the frame

_m = this.magic
IS_ALT = (_m == int(Magic.ALT_REQUEST)) | (_m == int(Magic.ALT_RESPONSE))
IS_CLIENT_REQUEST = (_m == int(Magic.REQUEST)) | (_m == int(Magic.ALT_REQUEST))
IS_CLIENT_RESPONSE = (_m == int(Magic.RESPONSE)) | (_m == int(Magic.ALT_RESPONSE))
IS_RESPONSE = IS_CLIENT_RESPONSE | (_m == int(Magic.SERVER_RESPONSE))
VALUE_LENGTH = (this.body_length - this.framing_extras_length - this.extras_length
                - this.key_length)
_MAGICS = frozenset(int(m) for m in Magic)


def _wrong_extras(c) -> str:
    return f"opcode 0x{c.opcode:02x}: extras length {c.extras_length} is not allowed"


def _int_keys(cases: dict) -> dict[int, Construct]:
    """Switch cases keyed by plain ints (``compile()`` emits the keys with ``repr``)."""
    return {int(k): v for k, v in cases.items()}


def _extras_switch(table: dict) -> Construct:
    cases = {int(op): Switch(this.extras_length, row[0], default=_reject(_wrong_extras))
             for op, row in table.items()}
    return Switch(this.opcode, cases, default=Bytes(this.extras_length))


_EXTRAS = IfThenElse(
    IS_CLIENT_REQUEST,
    _extras_switch(REQUESTS),
    IfThenElse(IS_CLIENT_RESPONSE, _extras_switch(RESPONSES), Bytes(this.extras_length)),
)
_VALUE = IfThenElse(
    IS_CLIENT_REQUEST,
    Switch(this.opcode, {int(op): row[2] for op, row in REQUESTS.items()}, default=_Raw),
    IfThenElse(
        IS_CLIENT_RESPONSE,
        Switch(this.opcode, {int(op): Switch(this.status, _int_keys(row[1]), default=_Raw)
                             for op, row in RESPONSES.items() if row[1]}, default=_Raw),
        _Raw,
    ),
)


def _extras_shapes(c) -> dict[int, Construct] | None:
    if c.magic in (Magic.REQUEST, Magic.ALT_REQUEST) and c.opcode in REQUESTS:
        return REQUESTS[c.opcode][0]
    if c.magic in (Magic.RESPONSE, Magic.ALT_RESPONSE) and c.opcode in RESPONSES:
        return RESPONSES[c.opcode][0]
    return None


def _extras_size(c) -> int:
    """Build side: the extras length implied by the extras fields given."""
    shapes = _extras_shapes(c)
    if shapes is None:
        return len(c.extras or b"")
    for length, layout in shapes.items():
        if _fits(layout, c.extras):
            return length
    raise LayoutError(f"opcode 0x{c.opcode:02x}: extras {c.extras!r} fit no extras layout")


def _built_size(subcon: Construct, obj: Any, c) -> int:
    stream = io.BytesIO()
    subcon._build(obj, stream, c, "(sizing)")
    return len(stream.getvalue())


def _key_range(c) -> tuple[int, int]:
    row = REQUESTS.get(c.opcode) if c.magic in (Magic.REQUEST, Magic.ALT_REQUEST) else None
    return row[1] if row else _ANY


Frame = Struct(
    "magic" / OneOf(U8, _MAGICS),
    "opcode" / U8,
    "framing_extras_length" / IfThenElse(
        IS_ALT, _Derived(U8, lambda c: _built_size(FrameInfos, c.framing_extras, c)), Computed(0)
    ),
    "key_length" / IfThenElse(IS_ALT, Rebuild(U8, len_(this.key)), Rebuild(U16, len_(this.key))),
    "extras_length" / _Derived(U8, _extras_size),
    "datatype" / Default(U8, 0),
    "vbucket" / If(~IS_RESPONSE, Default(U16, 0)),
    "status" / If(IS_RESPONSE, Default(U16, 0)),
    "body_length" / _Derived(U32, lambda c: c.framing_extras_length + c.extras_length
                             + len(c.key) + _built_size(_VALUE, c.value, c)),
    "opaque" / Default(U32, 0),
    "cas" / Default(U64, 0),
    _Require(lambda c: c.framing_extras_length + c.extras_length + c.key_length <= c.body_length,
             lambda c: f"framing extras {c.framing_extras_length} + extras {c.extras_length} + "
                       f"key {c.key_length} exceed the body length {c.body_length}"),
    "framing_extras" / If(IS_ALT, FixedSized(this.framing_extras_length, FrameInfos)),
    "extras" / _EXTRAS,
    "key" / Bytes(this.key_length),
    _Require(lambda c: _key_range(c)[0] <= c.key_length <= _key_range(c)[1],
             lambda c: f"opcode 0x{c.opcode:02x}: key of {c.key_length} bytes is not allowed "
                       f"(allowed {_key_range(c)[0]}..{_key_range(c)[1]})"),
    "value" / FixedSized(VALUE_LENGTH, _VALUE),
)
"""One frame: the 24-byte header, then framing extras, extras, key and value."""

#: The bare 24-byte header, lengths given explicitly (what a reader sees before the body).
Header = Struct(
    "magic" / OneOf(U8, _MAGICS),
    "opcode" / U8,
    "framing_extras_length" / IfThenElse(IS_ALT, U8, Computed(0)),
    "key_length" / IfThenElse(IS_ALT, U8, U16),
    "extras_length" / U8,
    "datatype" / U8,
    "vbucket" / If(~IS_RESPONSE, U16),
    "status" / If(IS_RESPONSE, U16),
    "body_length" / U32,
    "opaque" / U32,
    "cas" / U64,
)

_WholeFrame = FocusedSeq("frame", "frame" / Frame, Terminated)


def parse_frame(data: bytes) -> Container:
    """Parse exactly one frame; trailing bytes are an error (``ConstructError``)."""
    return _WholeFrame.parse(data)


def build_frame(fields: dict, using: Construct | None = None) -> bytes:
    """Build one frame from its fields; lengths are computed, absent parts are empty.

    ``using`` may be ``Frame.compile()`` (the compiled builder needs every part present).
    """
    f = dict(fields)
    f.setdefault("key", b"")
    f.setdefault("value", b"")
    f.setdefault("extras", None)
    alt = f["magic"] in (Magic.ALT_REQUEST, Magic.ALT_RESPONSE)
    f.setdefault("framing_extras", [] if alt else None)
    return (using or Frame).build(f)


def to_plain(obj: Any) -> Any:
    """Containers to dicts and lists, without construct's ``_io`` keys or absent (None) parts."""
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items() if not k.startswith("_") and v is not None}
    if isinstance(obj, ListContainer | list):
        return [to_plain(v) for v in obj]
    return obj
