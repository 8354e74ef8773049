"""The replication session's item builders: the DCP decoder builds engine ``Item``s
directly, so a replicated snapshot needs no conversion before ``apply_snapshot``.

Rules of this module: pure constructors, no state; fields are copied as the source sent
them (buffers become ``bytes``: an item outlives the receive buffer it was decoded from).
"""

from __future__ import annotations

from ...protocol.session import ClientSession
from ..engine.item import Item, ItemOp

__all__ = ["make_session"]

_MUT, _DEL, _EXP = int(ItemOp.MUTATION), int(ItemOp.DELETION), int(ItemOp.EXPIRATION)


def _b(x: bytes | bytearray | memoryview) -> bytes:
    return x if type(x) is bytes else bytes(x)


def _mutation(
    vb: int,
    seqno: int,
    rev: int,
    cas: int,
    flags: int,
    expiry: int,
    _lock: int,
    datatype: int,
    key: bytes,
    value: bytes,
) -> Item:
    return Item(vb, seqno, rev, cas, flags, expiry, datatype, _b(key), _b(value), _MUT, 0, b"")


def _deletion(
    vb: int,
    seqno: int,
    rev: int,
    cas: int,
    datatype: int,
    key: bytes,
    value: bytes,
    dtime: int | None,
) -> Item:
    return Item(vb, seqno, rev, cas, 0, 0, datatype, _b(key), _b(value), _DEL, dtime or 0, b"")


def _expiration(vb: int, seqno: int, rev: int, cas: int, key: bytes, dtime: int) -> Item:
    return Item(vb, seqno, rev, cas, 0, 0, 0, _b(key), b"", _EXP, dtime, b"")


def make_session(window: int) -> ClientSession:
    """A session whose decoder builds engine ``Item``s (no conversion afterwards)."""
    return ClientSession(
        window=window, mutation=_mutation, deletion=_deletion, expiration=_expiration
    )
