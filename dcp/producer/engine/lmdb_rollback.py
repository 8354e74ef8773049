"""The LMDB half of a replica's rollback: one vbucket's write transaction (owned by
storage.py).

Rules of this module:
- ``rollback_vbucket`` is called by ``LmdbStorage.rollback`` only, with the storage
  write lock held, inside a write transaction the caller opened and commits.
- Rolling back to R removes every stored version above R; it is EXACT when what stays
  is the vbucket as it was at R. That holds for a key of the tail (versions above R)
  when either a version at or below R is still stored (the history window kept it: it
  becomes the newest again) or the oldest tail version has revision 1 (the key did not
  exist before it). Without history a flushed tail version deleted its predecessor, so
  a key that existed before R and changed after it cannot be restored.
- R below the purge seqno is never exact: tombstones above R were purged, and the
  versions they replaced went with them.
- When R is not exact the vbucket is reset to empty (seqno 0, every record deleted)
  and the replica re-syncs in full: it never keeps a state that did not exist at R.
- The result is the seqno actually reached (R or 0); the caller writes the state record
  in the same transaction and rebuilds its key indexes after the commit.
"""

from __future__ import annotations

from typing import Any

from .records import ITEM_RECORD, item_key

__all__ = ["rollback_vbucket"]

_REC_HEAD = ITEM_RECORD.size
_rec_unpack = ITEM_RECORD.unpack_from


def _key_rev(raw: bytes) -> tuple[bytes, int]:
    _op, _dt, _cas, kl, _dtime, _seqno, rev, *_ = _rec_unpack(raw)
    return bytes(raw[_REC_HEAD : _REC_HEAD + kl]), rev


def rollback_vbucket(txn: Any, vb: int, item_db: Any, seqno: int, purge_seqno: int) -> int:
    """Delete ``vb``'s versions above ``seqno`` if that restores the vbucket exactly,
    else all of them (module rules). Returns the seqno reached: ``seqno`` or 0."""
    cur = txn.cursor(db=item_db)
    tail: list[bytes] = []  # LMDB keys above seqno
    first_rev: dict[bytes, int] = {}  # key -> revision of its oldest tail version
    if seqno and seqno >= purge_seqno and cur.set_range(item_key(vb, seqno + 1)):
        for k, raw in cur:
            tail.append(bytes(k))
            key, rev = _key_rev(raw)
            first_rev.setdefault(key, rev)
        need = {key for key, rev in first_rev.items() if rev != 1}
        if need and cur.first():
            for k, raw in cur:
                if int.from_bytes(k[2:10], "big") > seqno:
                    break
                key, _rev = _key_rev(raw)
                need.discard(key)
                if not need:
                    break
        if not need:
            for k in tail:
                txn.delete(k, db=item_db)
            return seqno
    elif seqno and seqno >= purge_seqno:
        return seqno  # nothing stored above it
    # not exact (or asked for 0): reset the vbucket
    txn.drop(item_db, delete=False)
    return 0
