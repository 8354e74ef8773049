"""The per-item hot path of the codec: DCP mutations, deletions, expirations, snapshot
markers and buffer acks, built and parsed on precompiled ``struct``.

Rules of this module:
- Module-level ``struct.Struct`` objects and plain tuples, no objects: these run once per
  item. ``mutation_body`` lets the server encode an item's extras + key + value once, so
  each stream only packs the 24-byte header (``dcp_header``).
- Builders catch ``struct.error`` inline (no wrapper call) and raise
  ``LocalProtocolError``; parsers take a ``Frame`` from the network and raise
  ``RemoteProtocolError`` on a wrong extras length: they never trust it.
- ``codec.py`` re-exports every name here (``codec.mutation`` ...), beside the cold
  builders and parsers (handshake, DCP control, KV); ``spec.py`` is the reference both
  are tested against.
"""

from __future__ import annotations

import struct

from .errors import LocalProtocolError, RemoteProtocolError
from .frames import Frame, need_extras
from .layout import (
    DELETION_V1_EXTRAS,
    DELETION_V2_EXTRAS,
    EXPIRATION_EXTRAS,
    HDR_MUTATION,
    HEADER,
    MARKER_V1,
    MARKER_V2_0,
    MUTATION_EXTRAS,
    U32,
    U64,
)
from .opcodes import Opcode

__all__ = [
    "buffer_ack",
    "dcp_header",
    "deletion",
    "deletion_body",
    "expiration",
    "expiration_body",
    "mutation",
    "mutation_body",
    "parse_buffer_ack",
    "parse_deletion",
    "parse_expiration",
    "parse_mutation",
    "parse_seqno_advanced",
    "parse_snapshot_marker",
    "parse_stream_end",
    "snapshot_marker",
]

_hdr_pack = HEADER.pack
_mut_pack = MUTATION_EXTRAS.pack


def dcp_header(
    opcode: int,
    keylen: int,
    extlen: int,
    datatype: int,
    vbucket: int,
    bodylen: int,
    opaque: int,
    cas: int,
) -> bytes:
    """The 24-byte request header of a producer message (magic 0x80)."""
    try:
        return _hdr_pack(0x80, opcode, keylen, extlen, datatype, vbucket, bodylen, opaque, cas)
    except struct.error as exc:
        raise LocalProtocolError.out_of_range("dcp_header", exc) from exc


def mutation_body(
    by_seqno: int,
    rev_seqno: int,
    flags: int,
    expiry: int,
    key: bytes,
    value: bytes,
    lock_time: int = 0,
) -> bytes:
    """Extras (31 B) + key + value of a DCP_MUTATION: encode once, send to many streams."""
    try:
        return _mut_pack(by_seqno, rev_seqno, flags, expiry, lock_time, 0, 0) + key + value
    except struct.error as exc:
        raise LocalProtocolError.out_of_range("mutation_body", exc) from exc


def deletion_body(
    by_seqno: int, rev_seqno: int, key: bytes, value: bytes = b"", delete_time: int | None = None
) -> bytes:
    """Extras + key + value of a DCP_DELETION: V1 (18 B) or, with a delete time, V2 (21 B)."""
    try:
        if delete_time is None:
            return DELETION_V1_EXTRAS.pack(by_seqno, rev_seqno, 0) + key + value
        return DELETION_V2_EXTRAS.pack(by_seqno, rev_seqno, delete_time, 0) + key + value
    except struct.error as exc:
        raise LocalProtocolError.out_of_range("deletion_body", exc) from exc


def expiration_body(by_seqno: int, rev_seqno: int, delete_time: int, key: bytes) -> bytes:
    try:
        return EXPIRATION_EXTRAS.pack(by_seqno, rev_seqno, delete_time) + key
    except struct.error as exc:
        raise LocalProtocolError.out_of_range("expiration_body", exc) from exc


def mutation(
    vbucket: int,
    opaque: int,
    by_seqno: int,
    rev_seqno: int,
    key: bytes,
    value: bytes,
    *,
    cas: int = 0,
    datatype: int = 0,
    flags: int = 0,
    expiry: int = 0,
    lock_time: int = 0,
) -> bytes:
    kl = len(key)
    try:
        head = HDR_MUTATION.pack(
            0x80,
            Opcode.DCP_MUTATION,
            kl,
            31,
            datatype,
            vbucket,
            31 + kl + len(value),
            opaque,
            cas,
            by_seqno,
            rev_seqno,
            flags,
            expiry,
            lock_time,
            0,
            0,
        )
    except struct.error as exc:
        raise LocalProtocolError.out_of_range("mutation", exc) from exc
    return head + key + value


def deletion(
    vbucket: int,
    opaque: int,
    by_seqno: int,
    rev_seqno: int,
    key: bytes,
    *,
    cas: int = 0,
    datatype: int = 0,
    value: bytes = b"",
    delete_time: int | None = None,
) -> bytes:
    body = deletion_body(by_seqno, rev_seqno, key, value, delete_time)
    el = 18 if delete_time is None else 21
    return (
        dcp_header(Opcode.DCP_DELETION, len(key), el, datatype, vbucket, len(body), opaque, cas)
        + body
    )


def expiration(
    vbucket: int,
    opaque: int,
    by_seqno: int,
    rev_seqno: int,
    key: bytes,
    *,
    cas: int = 0,
    delete_time: int = 0,
) -> bytes:
    body = expiration_body(by_seqno, rev_seqno, delete_time, key)
    return (
        dcp_header(Opcode.DCP_EXPIRATION, len(key), 20, 0, vbucket, len(body), opaque, cas) + body
    )


def snapshot_marker(
    vbucket: int,
    opaque: int,
    start: int,
    end: int,
    flags: int,
    *,
    max_visible_seqno: int | None = None,
    high_completed_seqno: int | None = None,
) -> bytes:
    """V1 (20 B extras) unless a max-visible/high-completed seqno is given, then V2.0."""
    if start > end:
        raise LocalProtocolError(f"snapshot start {start} > end {end}")
    try:
        if max_visible_seqno is None and high_completed_seqno is None:
            ext = MARKER_V1.pack(start, end, flags)
            return dcp_header(Opcode.DCP_SNAPSHOT_MARKER, 0, 20, 0, vbucket, 20, opaque, 0) + ext
        val = MARKER_V2_0.pack(
            start,
            end,
            flags,
            max_visible_seqno if max_visible_seqno is not None else end,
            high_completed_seqno or 0,
        )
    except struct.error as exc:
        raise LocalProtocolError.out_of_range("snapshot_marker", exc) from exc
    return dcp_header(Opcode.DCP_SNAPSHOT_MARKER, 0, 1, 0, vbucket, 37, opaque, 0) + b"\x00" + val


def buffer_ack(nbytes: int, opaque: int = 0) -> bytes:
    if not 0 <= nbytes <= 0xFFFFFFFF:
        raise LocalProtocolError(f"buffer ack of {nbytes} bytes does not fit uint32")
    return dcp_header(Opcode.DCP_BUFFER_ACK, 0, 4, 0, 0, 4, opaque, 0) + U32.pack(nbytes)


def parse_mutation(frame: Frame) -> tuple[int, int, int, int, int]:
    """(by_seqno, rev_seqno, flags, expiry, lock_time) of a DCP_MUTATION."""
    if len(frame.extras) != 31:
        raise RemoteProtocolError(f"DCP_MUTATION: extras length {len(frame.extras)}, expected 31")
    by, rev, flags, exp, lock, _nmeta, _nru = MUTATION_EXTRAS.unpack(frame.extras)
    return by, rev, flags, exp, lock


def parse_deletion(frame: Frame) -> tuple[int, int, int | None]:
    """(by_seqno, rev_seqno, delete_time or None) of a V1 or V2 DCP_DELETION."""
    n = len(frame.extras)
    if n == 18:
        by, rev, _nmeta = DELETION_V1_EXTRAS.unpack(frame.extras)
        return by, rev, None
    if n == 21:
        by, rev, dt, _ = DELETION_V2_EXTRAS.unpack(frame.extras)
        return by, rev, dt
    raise RemoteProtocolError(f"DCP_DELETION: extras length {n}, expected 18 or 21")


def parse_expiration(frame: Frame) -> tuple[int, int, int]:
    need_extras(frame, 20, "DCP_EXPIRATION")
    return EXPIRATION_EXTRAS.unpack(frame.extras)


def parse_snapshot_marker(frame: Frame) -> tuple[int, int, int, int | None, int | None]:
    """(start, end, flags, max_visible_seqno, high_completed_seqno); V2 fields None for V1."""
    n = len(frame.extras)
    if n == 20:
        s, e, f = MARKER_V1.unpack(frame.extras)
        return s, e, f, None, None
    if n == 1:
        ver = frame.extras[0]
        if ver == 0 and len(frame.value) == 36:
            s, e, f, mvs, hcs = MARKER_V2_0.unpack(frame.value)
            return s, e, f, mvs, hcs
        if ver == 2 and len(frame.value) == 52:
            s, e, f, mvs, hcs = MARKER_V2_0.unpack_from(frame.value, 0)
            return s, e, f, mvs, hcs
        raise RemoteProtocolError(
            f"DCP_SNAPSHOT_MARKER: version {ver} with a {len(frame.value)}-byte value"
        )
    raise RemoteProtocolError(f"DCP_SNAPSHOT_MARKER: extras length {n}, expected 20 or 1")


def parse_buffer_ack(frame: Frame) -> int:
    need_extras(frame, 4, "DCP_BUFFER_ACK")
    return U32.unpack(frame.extras)[0]


def parse_stream_end(frame: Frame) -> int:
    need_extras(frame, 4, "DCP_STREAM_END")
    return U32.unpack(frame.extras)[0]


def parse_seqno_advanced(frame: Frame) -> int:
    need_extras(frame, 8, "DCP_SEQNO_ADVANCED")
    return U64.unpack(frame.extras)[0]
