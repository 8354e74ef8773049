"""What a replica vbucket checks before it applies a snapshot received from its source.

Rules of this module:
- A replica applies whole snapshots only (``VBucket.apply_snapshot``), each exactly as
  the source sent it; this module decides whether a snapshot may be applied at all.
  It is pure: no vbucket is changed here, and a refused snapshot changes nothing.
- Accepted: ``start <= end``; every item of this vbucket; seqnos strictly increasing,
  above the replica's high seqno and within ``[start, end]``; the end not below the
  high seqno. Anything else is ``ReplicationError`` naming the first offence: the
  source (or the connection) is broken, and applying part of it would corrupt the copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ReplicationError
from .item import Item, ItemOp

__all__ = ["check_snapshot"]

_OPS = frozenset(int(op) for op in ItemOp)


def check_snapshot(vbid: int, high_seqno: int, start: int, end: int, items: Sequence[Item]) -> None:
    """Raise ``ReplicationError`` unless the snapshot may be applied (module rules)."""
    if start > end:
        raise ReplicationError(f"vb {vbid}: snapshot [{start}, {end}] ends before it starts")
    if end < high_seqno:
        raise ReplicationError(
            f"vb {vbid}: snapshot [{start}, {end}] ends below the high seqno {high_seqno}"
        )
    last = high_seqno
    for it in items:
        seqno = it.seqno
        if it.vbucket != vbid:
            raise ReplicationError(f"vb {vbid}: item seqno {seqno} is for vb {it.vbucket}")
        if seqno <= last:
            raise ReplicationError(f"vb {vbid}: seqno {seqno} does not advance (previous {last})")
        if not start <= seqno <= end:
            raise ReplicationError(
                f"vb {vbid}: seqno {seqno} outside its snapshot [{start}, {end}]"
            )
        if it.op not in _OPS or not it.key:
            raise ReplicationError(f"vb {vbid}: seqno {seqno} is not a change of a key")
        last = seqno
