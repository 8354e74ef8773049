"""The layouts of the ``construct`` spec (``spec.py``), as data: extras, values, frame
infos, and the opcode tables that say which of them each request and response has.

Rules of this module:
- Tests and tools only, like ``spec.py`` (which assembles the frame from these tables and
  re-exports every public name here): construct and the standard library, no trio,
  sockets or clock.
- Layouts are data. ``REQUESTS`` and ``RESPONSES`` map an opcode to the extras shapes it
  accepts (by extras length) and the layout of its value; nothing here dispatches on
  the header except the frame-info adapter (typed payloads in requests only).
- The small constructs the frame needs too (``Require``, ``reject``, ``Derived``,
  ``exact``, ``fits``) live here, beside the layouts that use them first.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from construct import (
    Adapter,
    BitStruct,
    Bytes,
    Construct,
    Container,
    Default,
    ExplicitError,
    FocusedSeq,
    GreedyBytes,
    GreedyRange,
    If,
    Int8ub,
    Int16ub,
    Int32ub,
    Int64ub,
    Nibble,
    Pass,
    Rebuild,
    Select,
    Struct,
    Switch,
    Terminated,
    this,
)

from .opcodes import FrameInfoId, Magic, Opcode, Status

__all__ = [
    "ANY_LENGTH",
    "NO_VALUE",
    "RAW",
    "REQUESTS",
    "RESPONSES",
    "U8",
    "U16",
    "U32",
    "U64",
    "BufferAckExtras",
    "DcpOpenExtras",
    "DeletionV1Extras",
    "DeletionV2Extras",
    "Derived",
    "DurabilityPayload",
    "ExpirationExtras",
    "FailoverEntry",
    "FailoverLog",
    "FrameInfo",
    "FrameInfos",
    "GetAllVbSeqnosCollectionExtras",
    "GetAllVbSeqnosExtras",
    "GetResponseExtras",
    "HelloFeatures",
    "LayoutError",
    "MutationExtras",
    "MutationSeqnoExtras",
    "Require",
    "RollbackValue",
    "SeqnoAcknowledgedExtras",
    "SeqnoAcknowledgedValue",
    "SeqnoAdvancedExtras",
    "SnapshotMarkerV1Extras",
    "SnapshotMarkerV2Extras",
    "SnapshotMarkerV2_0Value",
    "SnapshotMarkerV2_2Value",
    "StoreExtras",
    "StreamEndExtras",
    "StreamIdPayload",
    "StreamRequestExtras",
    "VBucketStateExtras",
    "VBucketStateValue",
    "VbSeqno",
    "VbSeqnoList",
    "built_size",
    "exact",
    "fits",
    "reject",
]

U8, U16, U32, U64 = Int8ub, Int16ub, Int32ub, Int64ub


class LayoutError(ExplicitError):
    """Bytes (or fields) that do not fit the layout this spec gives them."""


class Require(Construct):
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


def reject(message: Callable[[Any], str]) -> Construct:
    """Always fails: the opcode is known but this shape of it is not."""
    return Require(lambda c: False, message)


class Derived(Rebuild):
    """A length computed from the other fields when building (``Rebuild`` with a function).

    Parsing compiles as usual; building falls back to this instance under ``compile()``,
    because construct can only compile ``this`` expressions.
    """

    def _emitbuild(self, code):
        raise NotImplementedError


def built_size(subcon: Construct, obj: Any, context: Any) -> int:
    """How many bytes ``subcon`` builds ``obj`` to inside ``context`` (the enclosing frame's
    fields): construct's own build entry, which ``Require`` above overrides too, because
    the public ``build`` would start a fresh context without the frame's fields."""
    stream = io.BytesIO()
    subcon._build(obj, stream, context, "(sizing)")
    return len(stream.getvalue())


def exact(subcon: Construct) -> Construct:
    """``subcon`` must consume its whole (fixed-size) substream."""
    return FocusedSeq("value", "value" / subcon, Terminated)


# --------------------------------------------------------------------------- extras layouts

DcpOpenExtras = Struct("seqno" / Default(U32, 0), "flags" / U32)  # 8 B, seqno reserved (0)
StreamRequestExtras = Struct(  # 48 B
    "flags" / U32,
    "reserved" / Default(U32, 0),
    "start_seqno" / U64,
    "end_seqno" / U64,
    "vb_uuid" / U64,
    "snap_start_seqno" / U64,
    "snap_end_seqno" / U64,
)
StreamEndExtras = Struct("status" / U32)  # 4 B, a StreamEndStatus
SnapshotMarkerV1Extras = Struct("start_seqno" / U64, "end_seqno" / U64, "flags" / U32)  # 20 B
SnapshotMarkerV2Extras = Struct("version" / U8)  # 1 B: 0 = v2.0, 2 = v2.2; fields in the value
MutationExtras = Struct(  # 31 B
    "by_seqno" / U64,
    "rev_seqno" / U64,
    "flags" / U32,
    "expiration" / U32,
    "lock_time" / U32,
    "nmeta" / Default(U16, 0),
    "nru" / Default(U8, 0),
)
DeletionV1Extras = Struct("by_seqno" / U64, "rev_seqno" / U64, "nmeta" / Default(U16, 0))  # 18
DeletionV2Extras = Struct(  # 21 B
    "by_seqno" / U64, "rev_seqno" / U64, "delete_time" / U32, "unused" / Default(U8, 0)
)
ExpirationExtras = Struct("by_seqno" / U64, "rev_seqno" / U64, "delete_time" / U32)  # 20 B
BufferAckExtras = Struct("bytes_to_ack" / U32)  # 4 B
SeqnoAdvancedExtras = Struct("seqno" / U64)  # 8 B
SeqnoAcknowledgedExtras = Struct("seqno" / U64)  # 8 B: the seqno a replica holds (0x61)
GetAllVbSeqnosExtras = Struct("vbucket_state" / U32)  # 4 B; 0 = every live vbucket
GetAllVbSeqnosCollectionExtras = Struct("vbucket_state" / U32, "collection_id" / U32)  # 8 B
StoreExtras = Struct("flags" / U32, "expiration" / U32)  # 8 B: SET, ADD, REPLACE requests
GetResponseExtras = Struct("flags" / U32)  # 4 B: GET success response
MutationSeqnoExtras = Struct("vb_uuid" / U64, "seqno" / U64)  # 16 B: write response (HELLO 0x04)
VBucketStateExtras = Struct("state" / U8)  # 1 B: SET_VBUCKET_STATE, DCP_SET_VBUCKET_STATE

# --------------------------------------------------------------------------- value layouts

SnapshotMarkerV2_0Value = Struct(  # 36 B
    "start_seqno" / U64,
    "end_seqno" / U64,
    "flags" / U32,
    "max_visible_seqno" / U64,
    "high_completed_seqno" / U64,
)
SnapshotMarkerV2_2Value = Struct(  # 52 B; accepted, never sent by us
    *SnapshotMarkerV2_0Value.subcons, "purge_seqno" / U64, "high_prepared_seqno" / U64
)
FailoverEntry = Struct("vb_uuid" / U64, "seqno" / U64)
FailoverLog = exact(GreedyRange(FailoverEntry))  # newest entry first
RollbackValue = exact(Struct("rollback_seqno" / U64))
VbSeqno = Struct("vbucket" / U16, "seqno" / U64)
VbSeqnoList = exact(GreedyRange(VbSeqno))  # sorted by vbucket
HelloFeatures = exact(GreedyRange(U16))
VBucketStateValue = exact(Struct("state" / U32))  # GET_VBUCKET success: the state as a u32
NO_VALUE = exact(Bytes(0))
RAW = GreedyBytes
#: DCP_SEQNO_ACKNOWLEDGED: empty, or our extension's u64 persisted seqno (exactly 8 bytes)
SeqnoAcknowledgedValue = Select(exact(Struct("persisted_seqno" / U64)), NO_VALUE)

# --------------------------------------------------------------------------- frame infos

DurabilityPayload = {1: Struct("level" / U8), 3: Struct("level" / U8, "timeout_ms" / U16)}
StreamIdPayload = {2: Struct("stream_id" / U16)}
_FRAME_INFO_PAYLOADS: dict[int, dict[int, Construct]] = {
    FrameInfoId.DURABILITY: DurabilityPayload,
    FrameInfoId.DCP_STREAM_ID: StreamIdPayload,
}

_FrameInfoWire = Struct(
    "nibbles" / BitStruct("id" / Nibble, "length" / Nibble),
    "id_escape" / If(this.nibbles.id == 15, U8),  # id = 15 + this byte
    "length_escape" / If(this.nibbles.length == 15, U8),  # length = 15 + this byte
    "payload" / Bytes(lambda c: c.nibbles.length + (c.length_escape or 0)),
)


def fits(layout: Construct, obj: Any) -> bool:
    """Whether ``obj`` (a dict of fields) is a value for the Struct ``layout``."""
    if layout is Pass:
        return not obj
    if not isinstance(obj, dict):
        return False
    names = {sc.name for sc in layout.subcons if sc.name}
    needed = {sc.name for sc in layout.subcons if sc.name and not sc.flagbuildnone}
    given = {k for k in obj if not k.startswith("_")}
    return needed <= given <= names


def _payload_shapes(fid: int, context: Any) -> dict[int, Construct] | None:
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
        return Container(
            id=fid, **{k: v for k, v in layout.parse(obj.payload).items() if not k.startswith("_")}
        )

    def _encode(self, obj, context, path):
        fid = obj["id"]
        shapes = _payload_shapes(fid, context)
        if shapes is None:
            payload = obj["payload"]
        else:
            fields = {k: v for k, v in obj.items() if k != "id"}
            layout = next((sc for sc in shapes.values() if fits(sc, fields)), None)
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
FrameInfos = exact(GreedyRange(FrameInfo))

# --------------------------------------------------------------------------- opcode tables

ANY_LENGTH, _NONE, _NEEDED = (0, 0xFFFF), (0, 0), (1, 0xFFFF)
_NO_EXTRAS = {0: Pass}

#: Client requests (magic 0x80/0x08): opcode -> (extras shapes by length, key length
#: range, value layout). Opcodes not listed are split by lengths only.
REQUESTS: dict[int, tuple[dict[int, Construct], tuple[int, int], Construct]] = {
    Opcode.GET: (_NO_EXTRAS, _NEEDED, NO_VALUE),
    Opcode.SET: ({8: StoreExtras}, _NEEDED, RAW),
    Opcode.ADD: ({8: StoreExtras}, _NEEDED, RAW),
    Opcode.REPLACE: ({8: StoreExtras}, _NEEDED, RAW),
    Opcode.DELETE: (_NO_EXTRAS, _NEEDED, NO_VALUE),
    Opcode.NOOP: (_NO_EXTRAS, _NONE, NO_VALUE),
    Opcode.VERSION: (_NO_EXTRAS, _NONE, NO_VALUE),
    Opcode.STAT: (_NO_EXTRAS, ANY_LENGTH, NO_VALUE),  # key = stat group, empty = default group
    Opcode.HELLO: (_NO_EXTRAS, ANY_LENGTH, HelloFeatures),  # key = user agent
    Opcode.SASL_LIST_MECHS: (_NO_EXTRAS, _NONE, NO_VALUE),
    Opcode.SASL_AUTH: (_NO_EXTRAS, _NEEDED, RAW),  # key = mechanism, value = its message
    Opcode.SASL_STEP: (_NO_EXTRAS, _NEEDED, RAW),
    Opcode.GET_ALL_VB_SEQNOS: (
        {0: Pass, 4: GetAllVbSeqnosExtras, 8: GetAllVbSeqnosCollectionExtras},
        _NONE,
        NO_VALUE,
    ),
    # value: optional JSON options (datatype JSON), protocol_spec/README.md
    Opcode.SET_VBUCKET_STATE: ({1: VBucketStateExtras}, _NONE, RAW),
    Opcode.GET_VBUCKET: (_NO_EXTRAS, _NONE, NO_VALUE),
    Opcode.GET_CLUSTER_CONFIG: (_NO_EXTRAS, _NONE, NO_VALUE),
    Opcode.DCP_OPEN: ({8: DcpOpenExtras}, (1, 200), RAW),  # key = name; value: opt. JSON
    Opcode.DCP_CLOSE_STREAM: (_NO_EXTRAS, _NONE, NO_VALUE),
    Opcode.DCP_STREAM_REQ: ({48: StreamRequestExtras}, _NONE, RAW),  # value: opt. JSON
    Opcode.DCP_GET_FAILOVER_LOG: (_NO_EXTRAS, _NONE, NO_VALUE),
    Opcode.DCP_STREAM_END: ({4: StreamEndExtras}, _NONE, NO_VALUE),
    Opcode.DCP_SNAPSHOT_MARKER: (
        {20: SnapshotMarkerV1Extras, 1: SnapshotMarkerV2Extras},
        _NONE,
        Switch(
            this.extras_length,
            {
                20: NO_VALUE,
                1: Switch(
                    this.extras.version,
                    {0: exact(SnapshotMarkerV2_0Value), 2: exact(SnapshotMarkerV2_2Value)},
                    default=reject(lambda c: f"snapshot marker version {c.extras.version}"),
                ),
            },
        ),
    ),
    Opcode.DCP_MUTATION: ({31: MutationExtras}, _NEEDED, RAW),
    Opcode.DCP_DELETION: ({18: DeletionV1Extras, 21: DeletionV2Extras}, _NEEDED, RAW),
    Opcode.DCP_EXPIRATION: ({20: ExpirationExtras}, _NEEDED, RAW),
    Opcode.DCP_NOOP: (_NO_EXTRAS, _NONE, NO_VALUE),
    Opcode.DCP_BUFFER_ACK: ({4: BufferAckExtras}, _NONE, NO_VALUE),
    Opcode.DCP_CONTROL: (_NO_EXTRAS, _NEEDED, RAW),  # key = setting, value = its value
    Opcode.DCP_SEQNO_ADVANCED: ({8: SeqnoAdvancedExtras}, _NONE, NO_VALUE),
    Opcode.DCP_SEQNO_ACKNOWLEDGED: ({8: SeqnoAcknowledgedExtras}, _NONE, SeqnoAcknowledgedValue),
    Opcode.DCP_SET_VBUCKET_STATE: ({1: VBucketStateExtras}, _NONE, NO_VALUE),  # takeover
}

_WRITE_RESPONSE: tuple[dict[int, Construct], dict[int, Construct]] = (
    {0: Pass, 16: MutationSeqnoExtras},
    {},
)
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
    Opcode.GET_VBUCKET: (_NO_EXTRAS, {Status.SUCCESS: VBucketStateValue}),
    Opcode.DCP_STREAM_REQ: (
        _NO_EXTRAS,
        {Status.SUCCESS: FailoverLog, Status.ROLLBACK: RollbackValue},
    ),
    Opcode.DCP_GET_FAILOVER_LOG: (_NO_EXTRAS, {Status.SUCCESS: FailoverLog}),
    **{
        op: (_NO_EXTRAS, {})
        for op in (
            Opcode.NOOP,
            Opcode.VERSION,
            Opcode.STAT,
            Opcode.SASL_LIST_MECHS,  # values: mechanisms, challenges, server-final: raw
            Opcode.SASL_AUTH,
            Opcode.SASL_STEP,
            Opcode.DCP_OPEN,
            Opcode.DCP_CLOSE_STREAM,
            Opcode.DCP_STREAM_END,
            Opcode.DCP_SNAPSHOT_MARKER,
            Opcode.DCP_MUTATION,
            Opcode.DCP_DELETION,
            Opcode.DCP_EXPIRATION,
            Opcode.DCP_NOOP,
            Opcode.DCP_BUFFER_ACK,
            Opcode.DCP_CONTROL,
            Opcode.DCP_SEQNO_ADVANCED,
            Opcode.DCP_SEQNO_ACKNOWLEDGED,  # only ever an error (EINVAL): no reply on success
            Opcode.SET_VBUCKET_STATE,
            Opcode.DCP_SET_VBUCKET_STATE,
            Opcode.GET_CLUSTER_CONFIG,  # value: the bucket config JSON
        )
    },
}
