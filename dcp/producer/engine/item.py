"""Items: one change of one key in one vbucket, and the small results of KV operations.

Rules of this module:
- An ``Item`` is created once, when the change gets its seqno, and never modified after
  that (read-only by convention; slotted, positional constructor for speed: an item is
  built on every write).
- A mutation's wire form is encoded once: a queued mutation's whole DCP frame goes into
  its checkpoint's wire log (``checkpoint.py``) and the item itself carries
  ``body == b""``; a mutation read back from disk (backfill) carries its stored DCP body
  (31-byte extras + key + value), so sending it only packs a 24-byte header.
  ``Item.mutation`` still builds a body (tests, tools). Deletions and expirations carry
  ``body == b""``: the server encodes them (they depend on negotiated features).
- ``ItemOp`` values are the DCP opcodes of the message that carries the item.
"""

from __future__ import annotations

from enum import IntEnum

from ...protocol.codec import mutation_body

__all__ = ["ITEM_OVERHEAD", "GetResult", "Item", "ItemOp", "MutationResult", "item_size"]


class ItemOp(IntEnum):
    """What an item does to its key (same numbers as the DCP opcodes)."""

    MUTATION = 0x57
    DELETION = 0x58
    EXPIRATION = 0x59


#: Bytes charged per queued item on top of key, value and body: the object, its ints,
#: the list slot and the checkpoint's key-index entry (measured ~280-380 B per
#: 100-byte mutation in all).
ITEM_OVERHEAD = 200

_MUTATION = ItemOp.MUTATION


class Item:
    """One change. ``delete_time`` is the epoch second of a deletion/expiration (0 else)."""

    __slots__ = (
        "body",
        "cas",
        "datatype",
        "delete_time",
        "expiry",
        "flags",
        "key",
        "op",
        "rev_seqno",
        "seqno",
        "value",
        "vbucket",
    )

    def __init__(
        self,
        vbucket: int,
        seqno: int,
        rev_seqno: int,
        cas: int,
        flags: int,
        expiry: int,
        datatype: int,
        key: bytes,
        value: bytes,
        op: int,
        delete_time: int,
        body: bytes,
    ) -> None:
        self.vbucket = vbucket
        self.seqno = seqno
        self.rev_seqno = rev_seqno
        self.cas = cas
        self.flags = flags
        self.expiry = expiry
        self.datatype = datatype
        self.key = key
        self.value = value
        self.op = op
        self.delete_time = delete_time
        self.body = body

    @classmethod
    def mutation(
        cls,
        vbucket: int,
        seqno: int,
        rev_seqno: int,
        cas: int,
        flags: int,
        expiry: int,
        datatype: int,
        key: bytes,
        value: bytes,
    ) -> Item:
        """A mutation with its wire body encoded (the one place bodies are made)."""
        return cls(
            vbucket,
            seqno,
            rev_seqno,
            cas,
            flags,
            expiry,
            datatype,
            key,
            value,
            _MUTATION,
            0,
            mutation_body(seqno, rev_seqno, flags, expiry, key, value),
        )

    @property
    def is_deleted(self) -> bool:
        """True for deletions and expirations (the key is a tombstone after this item)."""
        return self.op != _MUTATION

    def __repr__(self) -> str:
        op = ItemOp(self.op).name
        return (
            f"Item(vb={self.vbucket}, seqno={self.seqno}, {op}, key={self.key!r}, "
            f"rev={self.rev_seqno}, cas={self.cas}, value={len(self.value)}B)"
        )


def item_size(item: Item) -> int:
    """Bytes an item is charged in checkpoint memory accounting."""
    return len(item.key) + len(item.value) + len(item.body) + ITEM_OVERHEAD


class MutationResult:
    """What a write returns: the new seqno and CAS, and the vbucket uuid they belong to."""

    __slots__ = ("cas", "seqno", "vb_uuid")

    def __init__(self, seqno: int, cas: int, vb_uuid: int) -> None:
        self.seqno = seqno
        self.cas = cas
        self.vb_uuid = vb_uuid

    def __repr__(self) -> str:
        return f"MutationResult(seqno={self.seqno}, cas={self.cas}, vb_uuid={self.vb_uuid})"


class GetResult:
    """What a get returns (the document as a KV client sees it)."""

    __slots__ = ("cas", "datatype", "expiry", "flags", "value")

    def __init__(self, value: bytes, flags: int, cas: int, datatype: int, expiry: int) -> None:
        self.value = value
        self.flags = flags
        self.cas = cas
        self.datatype = datatype
        self.expiry = expiry

    def __repr__(self) -> str:
        return f"GetResult(value={self.value[:32]!r}, flags={self.flags}, cas={self.cas})"
