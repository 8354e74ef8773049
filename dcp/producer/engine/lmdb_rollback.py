"""The LMDB half of a replica's rollback: one vbucket's write transaction (owned by
storage.py).

Rules of this module:
- ``rollback_vbucket`` is called by ``LmdbStorage.rollback`` only, with the storage
  write lock held, inside a write transaction the caller opened and commits.
- Rolling back to R removes every stored version above R; it is EXACT when what stays
  is the vbucket as it was at R. For each key of the tail (versions above R) that holds
  when the newest version stored at or below R is the tail's predecessor: its revision
  is one less than the oldest tail version's (revisions grow by one per version), or
  there is none and the oldest tail version has revision 1 (the key did not exist
  before it). Any gap means a version in between never reached the disk (checkpoints
  deduplicate before the flush) or was deleted (without history a flushed version
  deletes its predecessor): what stays would not be the vbucket at R.
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
        before: dict[bytes, int] = {}  # tail key -> revision of its newest version <= R
        if cur.first():
            for k, raw in cur:
                if int.from_bytes(k[2:10], "big") > seqno:
                    break
                key, rev = _key_rev(raw)
                if key in first_rev:
                    before[key] = rev  # ascending seqnos: the last one seen is the newest
        if all(before.get(key, 0) == rev - 1 for key, rev in first_rev.items()):
            for k in tail:
                txn.delete(k, db=item_db)
            return seqno
    elif seqno and seqno >= purge_seqno:
        return seqno  # nothing stored above it
    # not exact (or asked for 0): reset the vbucket
    txn.drop(item_db, delete=False)
    return 0
