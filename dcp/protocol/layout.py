"""Byte layouts of the memcached-binary protocol: every ``struct`` format, defined once.

Rules of this module:
- Each wire structure has exactly one ``struct.Struct`` here; a layout that spans
  several structures (a header followed by a message's extras, as the hot paths read
  them in one ``unpack_from``) is built from the named parts with ``joined``, never
  spelled out again. Other modules import these objects (hot loops may bind their
  ``unpack_from``/``pack`` to locals) and define no format strings of their own.
- Named constants stand for the magic numbers of the wire (sizes, magic bytes) so that
  code which must agree on them (the server's backfill size charges, the decoders'
  offsets) reads them from one place.
- ``vbucket_for_key`` is the one key-to-vbucket hash (clients route with it, the server
  checks with it).
- No I/O; stdlib only; nothing here depends on other ``dcp`` modules but ``opcodes``
  and ``errors``.
"""

from __future__ import annotations

import struct
import zlib

from .errors import LocalProtocolError
from .opcodes import Magic

__all__ = [
    "ALT_HEADER",
    "ALT_MAGIC",
    "DELETION_V1_EXTRAS",
    "DELETION_V2_EXTRAS",
    "EXPIRATION_EXTRAS",
    "FAILOVER_ENTRY",
    "HDR_DELETION_V1",
    "HDR_DELETION_V2",
    "HDR_EXPIRATION",
    "HDR_ITEM_CHECK",
    "HDR_MARKER_V1",
    "HDR_MUTATION",
    "HDR_MUTATION_SEQNO",
    "HDR_STORE",
    "HEADER",
    "HEADER_SIZE",
    "KNOWN_MAGIC",
    "MARKER_V1",
    "MARKER_V2_0",
    "MUTATION_EXTRAS",
    "MUTATION_FRAME_OVERHEAD",
    "MUTATION_SEQNO",
    "OPEN_EXTRAS",
    "RESPONSE_MAGIC",
    "STORE_EXTRAS",
    "STREAM_REQ_EXTRAS",
    "U8",
    "U16",
    "U32",
    "U64",
    "VB_SEQNO",
    "joined",
    "vbucket_for_key",
]


def joined(*parts: struct.Struct) -> struct.Struct:
    """One big-endian ``Struct`` laying ``parts`` end to end (no padding: ``>`` formats)."""
    fmt = "".join(p.format.lstrip(">!") for p in parts)
    return struct.Struct(">" + fmt)


# --------------------------------------------------------------------------- scalars

U8 = struct.Struct(">B")
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")

# --------------------------------------------------------------------------- header

#: The 24-byte header: magic, opcode, key length, extras length, datatype, vbucket (or
#: status in a response), body length, opaque, cas.
HEADER = struct.Struct(">BBHBBHIIQ")
#: Alt framing (magic 0x08/0x18): byte 2 is the framing-extras length, byte 3 the key length.
ALT_HEADER = struct.Struct(">BBBBBBHIIQ")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == ALT_HEADER.size == 24

KNOWN_MAGIC = frozenset(int(m) for m in Magic)
ALT_MAGIC = frozenset((int(Magic.ALT_REQUEST), int(Magic.ALT_RESPONSE)))
RESPONSE_MAGIC = frozenset(
    (int(Magic.RESPONSE), int(Magic.ALT_RESPONSE), int(Magic.SERVER_RESPONSE))
)

# --------------------------------------------------------------------------- extras

OPEN_EXTRAS = struct.Struct(">II")  # seqno (reserved), flags
STREAM_REQ_EXTRAS = struct.Struct(">IIQQQQQ")  # flags, reserved, start, end, uuid, ss, se
FAILOVER_ENTRY = struct.Struct(">QQ")  # vb_uuid, seqno
MARKER_V1 = struct.Struct(">QQI")  # start, end, flags
MARKER_V2_0 = struct.Struct(">QQIQQ")  # start, end, flags, max visible, high completed
MUTATION_EXTRAS = struct.Struct(">QQIIIHB")  # by, rev, flags, exp, lock, nmeta, nru
DELETION_V1_EXTRAS = struct.Struct(">QQH")  # by, rev, nmeta
DELETION_V2_EXTRAS = struct.Struct(">QQIB")  # by, rev, delete_time, unused
EXPIRATION_EXTRAS = struct.Struct(">QQI")  # by, rev, delete_time
STORE_EXTRAS = struct.Struct(">II")  # flags, expiry
MUTATION_SEQNO = struct.Struct(">QQ")  # vb_uuid, seqno
VB_SEQNO = struct.Struct(">HQ")  # vbucket, high seqno

# --------------------------------------------------------------------------- header + extras

#: Header + mutation extras: the hot paths pack or unpack both in one call.
HDR_MUTATION = joined(HEADER, MUTATION_EXTRAS)
HDR_DELETION_V1 = joined(HEADER, DELETION_V1_EXTRAS)
HDR_DELETION_V2 = joined(HEADER, DELETION_V2_EXTRAS)
HDR_EXPIRATION = joined(HEADER, EXPIRATION_EXTRAS)
HDR_MARKER_V1 = joined(HEADER, MARKER_V1)
#: Header + the by_seqno that opens the extras of every DCP item (mutation, deletion,
#: expiration), reading only what the item_frames decoder checks (decode_frames.py):
#: magic, opcode, key length, extras length, body length, opaque, by_seqno. Datatype,
#: vbucket and cas are skipped as pad bytes: three objects fewer per item.
HDR_ITEM_CHECK = struct.Struct(">BBHB3xII8xQ")
assert HDR_ITEM_CHECK.size == HEADER_SIZE + U64.size
#: A SET/ADD/REPLACE request header + its flags/expiry extras.
HDR_STORE = joined(HEADER, STORE_EXTRAS)
#: A write response header + its MutationSeqno extras (vb_uuid, seqno).
HDR_MUTATION_SEQNO = joined(HEADER, MUTATION_SEQNO)

#: Wire bytes of a DCP_MUTATION besides its key and value: the 24-byte header and the
#: 31 bytes of mutation extras. ``MUTATION_FRAME_OVERHEAD + len(key) + len(value)`` is
#: what one item costs on the wire, which is what flow control counts; the server's
#: backfill charges an item this many bytes, so its budget and the client's window agree.
MUTATION_FRAME_OVERHEAD = HEADER_SIZE + MUTATION_EXTRAS.size
assert MUTATION_FRAME_OVERHEAD == 55 == HDR_MUTATION.size


def vbucket_for_key(key: bytes, num_vbuckets: int = 1024) -> int:
    """The vbucket Couchbase clients pick for ``key``: bits 16..30 of its CRC-32.

    ``num_vbuckets`` must be a power of two (the hash is masked, not taken modulo).

    Raises:
        LocalProtocolError: ``num_vbuckets`` is not a power of two.
    """
    if num_vbuckets <= 0 or num_vbuckets & (num_vbuckets - 1):
        raise LocalProtocolError(f"num_vbuckets must be a power of two, not {num_vbuckets}")
    return ((zlib.crc32(key) >> 16) & 0x7FFF) & (num_vbuckets - 1)
