"""On-disk record layouts of the LMDB store (keys, items, vbucket state).

Rules of this module:
- Layouts are ``struct`` formats, big-endian, versioned by ``FORMAT_VERSION`` in the meta
  DB. Change a layout only together with that number.
- An item record is stored close to the wire: a 16-byte prefix (op, datatype, cas,
  keylen, delete time) followed by exactly the DCP mutation body (31-byte extras with
  seqno, rev seqno, flags, expiry; then key; then value), then a 4-byte CRC-32C trailer.
  A backfill of a mutation reuses ``record[16:-4]`` as the body, so it only has to pack
  the 24-byte header.
- The trailer is the CRC-32C of everything before it, stored little-endian: then the
  CRC-32C of the *whole* record is a constant (``CRC_RESIDUE``) for every intact
  record, so a reader checks a record with one C call over the bytes it already holds,
  without slicing (copying) the trailer off first. Every reader that serves a record
  (``decode_item`` callers in storage/backfill, ``dcpctl inspect check``) checks it;
  warm-up, which reads only the fixed head of every record, does not (docs/engine.md).
- Format 1 (before checksums) differs only by the missing trailer; ``LmdbStorage``
  migrates such a store at open (``add_checksum``).
- Records carry the key, so warm-up rebuilds key -> seqno from one scan instead of
  keeping a random-key index on disk.
"""

from __future__ import annotations

import struct

import google_crc32c

from ...protocol.layout import MUTATION_EXTRAS, joined
from .errors import ChecksumError
from .item import Item, ItemOp

__all__ = [
    "CRC_RESIDUE",
    "CRC_SIZE",
    "FORMAT_VERSION",
    "ITEM_KEY",
    "ITEM_RECORD",
    "PREFIX",
    "PREFIX_SEQNO",
    "VB_KEY",
    "VBStateRecord",
    "add_checksum",
    "checksum_error",
    "crc32c",
    "decode_item",
    "encode_item",
    "item_key",
    "record_intact",
]

FORMAT_VERSION = 2
#: the last format without a checksum trailer (migrated at open)
FORMAT_UNCHECKED = 1

#: byseq key: (vbucket, seqno), 10 bytes, big-endian so LMDB order == seqno order.
ITEM_KEY = struct.Struct(">HQ")
item_key = ITEM_KEY.pack
#: vbstate key.
VB_KEY = struct.Struct(">H")
#: op, datatype, cas, keylen, delete_time.
PREFIX = struct.Struct(">BBQHI")
#: prefix + DCP mutation extras (seqno, rev, flags, expiry, lock time, nmeta, nru).
ITEM_RECORD = struct.Struct(">BBQHIQQIIIHB")
# the record's tail is the wire's mutation extras (module rules): spelled here so that the
# disk format is versioned here, checked against dcp/protocol/layout.py
assert ITEM_RECORD.format == joined(PREFIX, MUTATION_EXTRAS).format
#: the prefix and the by-seqno (the first extras field): what a backfill reads first.
PREFIX_SEQNO = struct.Struct(PREFIX.format + "Q")
RECORD_HEAD = ITEM_RECORD.size  # 47
_BODY_AT = PREFIX.size  # 16

_prefix_pack = PREFIX.pack
_record_pack = ITEM_RECORD.pack
_record_unpack = ITEM_RECORD.unpack_from
_MUTATION = int(ItemOp.MUTATION)
#: bytes of the checksum trailer
CRC_SIZE = 4
#: CRC-32C of a bytes object (C, hardware-accelerated where the CPU has it)
crc32c = google_crc32c.value
#: CRC-32C of any message followed by its own CRC-32C in little-endian order
CRC_RESIDUE = 0x48674BC7


def encode_item(item: Item) -> bytes:
    """The byseq value of ``item`` (with its checksum trailer)."""
    if item.body:
        rec = (
            _prefix_pack(item.op, item.datatype, item.cas, len(item.key), item.delete_time)
            + item.body
        )
    else:
        key = item.key
        rec = (
            _record_pack(
                item.op,
                item.datatype,
                item.cas,
                len(key),
                item.delete_time,
                item.seqno,
                item.rev_seqno,
                item.flags,
                item.expiry,
                0,
                0,
                0,
            )
            + key
            + item.value
        )
    return rec + crc32c(rec).to_bytes(4, "little")


def record_intact(raw: bytes) -> bool:
    """True when ``raw`` is a whole record whose checksum trailer matches its bytes."""
    return len(raw) >= RECORD_HEAD + CRC_SIZE and crc32c(raw) == CRC_RESIDUE


def checksum_error(vbucket: int, seqno: int, raw: bytes) -> ChecksumError:
    """The error for a damaged record stored at ``seqno`` (the LMDB key's, which the
    checksum does not cover but LMDB's own structure does)."""
    kl = int.from_bytes(raw[10:12], "big") if len(raw) >= 12 else 0
    return ChecksumError(vbucket, seqno, raw[RECORD_HEAD : RECORD_HEAD + kl])


def add_checksum(raw: bytes) -> bytes:
    """A format-1 record (no trailer) as a current one (the open-time migration)."""
    return raw + crc32c(raw).to_bytes(4, "little")


def decode_item(vbucket: int, raw: bytes) -> Item:
    """The ``Item`` stored in a byseq value (mutations get their body back for free).

    Does not verify the checksum: callers that serve the item call ``record_intact``
    first (see the module rules).
    """
    op, dt, cas, kl, dtime, seqno, rev, flags, exp, _lk, _nm, _nru = _record_unpack(raw)
    ke = RECORD_HEAD + kl
    end = len(raw) - CRC_SIZE
    return Item(
        vbucket,
        seqno,
        rev,
        cas,
        flags,
        exp,
        dt,
        raw[RECORD_HEAD:ke],
        raw[ke:end],
        op,
        dtime,
        raw[_BODY_AT:end] if op == _MUTATION else b"",
    )


_STATE_HEAD = struct.Struct(">BBQQQQQQH")  # version, state, high, ss, se, purge, cas, hist, n
_ENTRY = struct.Struct(">QQ")


class VBStateRecord:
    """The persisted state of one vbucket, written in the same txn as its items.

    ``history_start`` is the lowest seqno from which every version is still on disk
    (meaningful only with the history window on).
    """

    __slots__ = (
        "failover",
        "high_seqno",
        "history_start",
        "max_cas",
        "purge_seqno",
        "snap_end",
        "snap_start",
        "state",
    )

    def __init__(
        self,
        state: int,
        failover: list[tuple[int, int]],
        high_seqno: int = 0,
        snap_start: int = 0,
        snap_end: int = 0,
        purge_seqno: int = 0,
        max_cas: int = 0,
        history_start: int = 0,
    ) -> None:
        self.state = state
        self.failover = failover
        self.high_seqno = high_seqno
        self.snap_start = snap_start
        self.snap_end = snap_end
        self.purge_seqno = purge_seqno
        self.max_cas = max_cas
        self.history_start = history_start

    def encode(self) -> bytes:
        head = _STATE_HEAD.pack(
            1,
            self.state,
            self.high_seqno,
            self.snap_start,
            self.snap_end,
            self.purge_seqno,
            self.max_cas,
            self.history_start,
            len(self.failover),
        )
        return head + b"".join(_ENTRY.pack(u, s) for u, s in self.failover)

    @classmethod
    def decode(cls, raw: bytes) -> VBStateRecord:
        ver, state, high, ss, se, purge, cas, hist, n = _STATE_HEAD.unpack_from(raw)
        if ver != 1:
            raise ValueError(f"unknown vbucket state record version {ver}")
        off = _STATE_HEAD.size
        entries = [_ENTRY.unpack_from(raw, off + 16 * i) for i in range(n)]
        return cls(state, entries, high, ss, se, purge, cas, hist)

    def copy(self) -> VBStateRecord:
        return VBStateRecord(
            self.state,
            list(self.failover),
            self.high_seqno,
            self.snap_start,
            self.snap_end,
            self.purge_seqno,
            self.max_cas,
            self.history_start,
        )

    def __repr__(self) -> str:
        return (
            f"VBStateRecord(state={self.state}, high={self.high_seqno}, snap="
            f"{self.snap_start}..{self.snap_end}, purge={self.purge_seqno}, "
            f"failover={self.failover})"
        )
