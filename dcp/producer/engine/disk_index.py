"""What the storage knows about its disk besides LMDB itself (owned by storage.py).

Rules of this module:
- Per vbucket: ``keys`` maps each key to the seqno of its newest stored version (the
  flush needs it to delete the versions it supersedes, compaction to tell a key's newest
  version from superseded ones), and the purge seqno and history start compaction
  raised (a flush that was collected before a compaction carries older ones in its
  state record: ``merged`` keeps them from going down).
- Only ``LmdbStorage`` changes it, from the thread of its blocking call, and only after
  the transaction the change describes committed. Warm-up rebuilds ``keys`` from the
  records (``LmdbStorage.scan_for_warmup``) and the seqnos from the state records.
- The lists are public attributes so that the flush's hot loop binds them to locals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lmdb_compaction import VBucketCompaction
    from .records import VBStateRecord

__all__ = ["DiskIndex"]


class DiskIndex:
    """Per vbucket: key -> newest stored seqno, purge seqno, history start."""

    __slots__ = ("history_start", "keys", "purge_seqno")

    def __init__(self, num_vbuckets: int) -> None:
        self.keys: list[dict[bytes, int]] = [{} for _ in range(num_vbuckets)]
        self.purge_seqno = [0] * num_vbuckets
        self.history_start = [0] * num_vbuckets

    def load_state(self, vb: int, rec: VBStateRecord) -> None:
        """Take the seqnos of a persisted state record (warm-up)."""
        self.purge_seqno[vb] = rec.purge_seqno
        self.history_start[vb] = rec.history_start

    def merged(self, vb: int, rec: VBStateRecord) -> VBStateRecord:
        """``rec`` with the purge seqno / history start compaction may have raised (a
        copy when they differ: the caller's record is not changed)."""
        purge, hist = self.purge_seqno[vb], self.history_start[vb]
        if rec.purge_seqno >= purge and rec.history_start >= hist:
            return rec
        rec = rec.copy()
        rec.purge_seqno = max(rec.purge_seqno, purge)
        rec.history_start = max(rec.history_start, hist)
        return rec

    def compacted(self, vc: VBucketCompaction) -> None:
        """A compaction of ``vc.vbid`` committed: its purged tombstones are gone from
        the disk (unless a newer version was flushed since) and its seqnos rose."""
        keys = self.keys[vc.vbid]
        for key, seqno in vc.purged:
            if keys.get(key) == seqno:
                del keys[key]
        self.purge_seqno[vc.vbid] = vc.purge_seqno
        self.history_start[vc.vbid] = vc.history_start
