"""Executable specification of every frame we speak, written with ``construct``.

Rules of this module:
- construct and the standard library only: no trio, sockets or clock. This is the
  reference that ``codec.py``/``frames.py`` (the struct hot path) are tested against, and the
  source of the golden vectors in ``protocol_spec/vectors/`` (``python -m tools.vectors``).
- Tests and tools only: nothing at run time imports this module (``dcp/protocol/__init__.py``
  does not), so construct is in the ``dev`` extra, not in the dependencies.
- Layouts are data, in ``spec_layouts.py`` (re-exported here): ``REQUESTS`` and
  ``RESPONSES`` map an opcode to the extras shapes it accepts (by extras length) and the
  layout of its value; ``Frame`` (this module) only dispatches on them.
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

from typing import Any

from construct import (
    Bytes,
    Computed,
    Construct,
    Container,
    Default,
    FixedSized,
    FocusedSeq,
    If,
    IfThenElse,
    ListContainer,
    OneOf,
    Rebuild,
    Struct,
    Switch,
    Terminated,
    len_,
    this,
)

from .opcodes import Magic
from .spec_layouts import (
    ANY_LENGTH,
    RAW,
    REQUESTS,
    RESPONSES,
    U8,
    U16,
    U32,
    U64,
    BufferAckExtras,
    DcpOpenExtras,
    DeletionV1Extras,
    DeletionV2Extras,
    Derived,
    DurabilityPayload,
    ExpirationExtras,
    FailoverEntry,
    FailoverLog,
    FrameInfo,
    FrameInfos,
    GetAllVbSeqnosCollectionExtras,
    GetAllVbSeqnosExtras,
    GetResponseExtras,
    HelloFeatures,
    LayoutError,
    MutationExtras,
    MutationSeqnoExtras,
    Require,
    RollbackValue,
    SeqnoAcknowledgedExtras,
    SeqnoAcknowledgedValue,
    SeqnoAdvancedExtras,
    SnapshotMarkerV1Extras,
    SnapshotMarkerV2_0Value,
    SnapshotMarkerV2_2Value,
    SnapshotMarkerV2Extras,
    StoreExtras,
    StreamEndExtras,
    StreamIdPayload,
    StreamRequestExtras,
    VbSeqno,
    VbSeqnoList,
    VBucketStateExtras,
    VBucketStateValue,
    built_size,
    fits,
    reject,
)

__all__ = [
    "REQUESTS",
    "RESPONSES",
    "BufferAckExtras",
    "DcpOpenExtras",
    "DeletionV1Extras",
    "DeletionV2Extras",
    "DurabilityPayload",
    "ExpirationExtras",
    "FailoverEntry",
    "FailoverLog",
    "Frame",
    "FrameInfo",
    "FrameInfos",
    "GetAllVbSeqnosCollectionExtras",
    "GetAllVbSeqnosExtras",
    "GetResponseExtras",
    "Header",
    "HelloFeatures",
    "LayoutError",
    "MutationExtras",
    "MutationSeqnoExtras",
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
    "build_frame",
    "parse_frame",
    "to_plain",
]

# --------------------------------------------------------------------------- the frame

_m = this.magic
IS_ALT = (_m == int(Magic.ALT_REQUEST)) | (_m == int(Magic.ALT_RESPONSE))
IS_CLIENT_REQUEST = (_m == int(Magic.REQUEST)) | (_m == int(Magic.ALT_REQUEST))
IS_CLIENT_RESPONSE = (_m == int(Magic.RESPONSE)) | (_m == int(Magic.ALT_RESPONSE))
IS_RESPONSE = IS_CLIENT_RESPONSE | (_m == int(Magic.SERVER_RESPONSE))
VALUE_LENGTH = this.body_length - this.framing_extras_length - this.extras_length - this.key_length
_MAGICS = frozenset(int(m) for m in Magic)


def _wrong_extras(c) -> str:
    return f"opcode 0x{c.opcode:02x}: extras length {c.extras_length} is not allowed"


def _int_keys(cases: dict) -> dict[int, Construct]:
    """Switch cases keyed by plain ints (``compile()`` emits the keys with ``repr``)."""
    return {int(k): v for k, v in cases.items()}


def _extras_switch(table: dict) -> Construct:
    cases = {
        int(op): Switch(this.extras_length, row[0], default=reject(_wrong_extras))
        for op, row in table.items()
    }
    return Switch(this.opcode, cases, default=Bytes(this.extras_length))


_EXTRAS = IfThenElse(
    IS_CLIENT_REQUEST,
    _extras_switch(REQUESTS),
    IfThenElse(IS_CLIENT_RESPONSE, _extras_switch(RESPONSES), Bytes(this.extras_length)),
)
_VALUE = IfThenElse(
    IS_CLIENT_REQUEST,
    Switch(this.opcode, {int(op): row[2] for op, row in REQUESTS.items()}, default=RAW),
    IfThenElse(
        IS_CLIENT_RESPONSE,
        Switch(
            this.opcode,
            {
                int(op): Switch(this.status, _int_keys(row[1]), default=RAW)
                for op, row in RESPONSES.items()
                if row[1]
            },
            default=RAW,
        ),
        RAW,
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
        if fits(layout, c.extras):
            return length
    raise LayoutError(f"opcode 0x{c.opcode:02x}: extras {c.extras!r} fit no extras layout")


def _key_range(c) -> tuple[int, int]:
    row = REQUESTS.get(c.opcode) if c.magic in (Magic.REQUEST, Magic.ALT_REQUEST) else None
    return row[1] if row else ANY_LENGTH


Frame = Struct(
    "magic" / OneOf(U8, _MAGICS),
    "opcode" / U8,
    "framing_extras_length"
    / IfThenElse(
        IS_ALT, Derived(U8, lambda c: built_size(FrameInfos, c.framing_extras, c)), Computed(0)
    ),
    "key_length" / IfThenElse(IS_ALT, Rebuild(U8, len_(this.key)), Rebuild(U16, len_(this.key))),
    "extras_length" / Derived(U8, _extras_size),
    "datatype" / Default(U8, 0),
    "vbucket" / If(~IS_RESPONSE, Default(U16, 0)),
    "status" / If(IS_RESPONSE, Default(U16, 0)),
    "body_length"
    / Derived(
        U32,
        lambda c: (
            c.framing_extras_length + c.extras_length + len(c.key) + built_size(_VALUE, c.value, c)
        ),
    ),
    "opaque" / Default(U32, 0),
    "cas" / Default(U64, 0),
    Require(
        lambda c: c.framing_extras_length + c.extras_length + c.key_length <= c.body_length,
        lambda c: (
            f"framing extras {c.framing_extras_length} + extras {c.extras_length} + "
            f"key {c.key_length} exceed the body length {c.body_length}"
        ),
    ),
    "framing_extras" / If(IS_ALT, FixedSized(this.framing_extras_length, FrameInfos)),
    "extras" / _EXTRAS,
    "key" / Bytes(this.key_length),
    Require(
        lambda c: _key_range(c)[0] <= c.key_length <= _key_range(c)[1],
        lambda c: (
            f"opcode 0x{c.opcode:02x}: key of {c.key_length} bytes is not allowed "
            f"(allowed {_key_range(c)[0]}..{_key_range(c)[1]})"
        ),
    ),
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
