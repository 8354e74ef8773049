"""Compaction: purge old tombstones and prune history beyond the retention window.

Rules of this module:
- Shaped like the flusher: ``Compactor.plan`` (event-loop thread, cheap) captures what
  to do; ``LmdbStorage.compact(plan)`` (blocking, worker thread, one write transaction
  per vbucket) does it and touches only LMDB and storage-private state;
  ``Compactor.complete(result)`` (event-loop thread) applies the bookkeeping: the
  vbucket's purge seqno rises and purged tombstones leave the in-memory key index.
- A tombstone is purged when it is the newest version of its key and its delete time
  is older than ``tombstone_purge_age``. Its purge raises the vbucket's purge seqno,
  which makes stream requests starting below it roll back to 0 (reference §5.4 step 2).
  With history on, the superseded versions of a purged key go with it (else warm-up
  would resurrect the newest of them).
- History pruning (history window on): a superseded version is dropped when its write
  time (its HLC CAS) is older than ``history_seconds``, then the oldest are dropped
  while the vbucket's superseded bytes exceed ``history_bytes / num_vbuckets`` (the
  byte budget is split per vbucket, as Magma does). ``history_start`` becomes the
  seqno after the newest pruned version: scans from there on see complete history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lmdb

from .item import ItemOp
from .records import ITEM_RECORD, VB_KEY, VBStateRecord, item_key

if TYPE_CHECKING:
    from .bucket import Bucket
    from .storage import LmdbStorage

__all__ = ["CompactionPlan", "CompactionResult", "Compactor", "VBucketCompaction"]

_REC_HEAD = ITEM_RECORD.size
_rec_unpack = ITEM_RECORD.unpack_from
_MUTATION = int(ItemOp.MUTATION)


class CompactionPlan:
    """What one compaction run does. ``purge_before`` None: no tombstone purge;
    ``history_cutoff_cas`` 0: no age pruning; ``history_bytes_per_vb`` 0: no byte limit.
    """

    __slots__ = ("history_bytes_per_vb", "history_cutoff_cas", "now", "purge_before",
                 "vbuckets")

    def __init__(self, now: float, vbuckets: list[int], purge_before: float | None,
                 history_cutoff_cas: int, history_bytes_per_vb: int) -> None:
        self.now = now
        self.vbuckets = vbuckets
        self.purge_before = purge_before
        self.history_cutoff_cas = history_cutoff_cas
        self.history_bytes_per_vb = history_bytes_per_vb


class VBucketCompaction:
    """Outcome for one vbucket: purged tombstones (key, seqno) and the new seqnos."""

    __slots__ = ("history_start", "pruned", "purge_seqno", "purged", "vbid")

    def __init__(self, vbid: int, purged: list[tuple[bytes, int]], purge_seqno: int,
                 pruned: int, history_start: int) -> None:
        self.vbid = vbid
        self.purged = purged
        self.purge_seqno = purge_seqno
        self.pruned = pruned
        self.history_start = history_start


class CompactionResult:
    __slots__ = ("vbuckets",)

    def __init__(self, vbuckets: list[VBucketCompaction]) -> None:
        self.vbuckets = vbuckets

    @property
    def tombstones_purged(self) -> int:
        return sum(len(v.purged) for v in self.vbuckets)

    @property
    def versions_pruned(self) -> int:
        return sum(v.pruned for v in self.vbuckets)


def run_compaction(storage: LmdbStorage, plan: CompactionPlan) -> CompactionResult:
    """The blocking part (caller holds the storage write lock)."""
    from .storage import _wrap

    out = []
    for vb in plan.vbuckets:
        try:
            out.append(_compact_vbucket(storage, vb, plan))
        except lmdb.Error as exc:
            raise _wrap(exc, f"compaction of vb {vb} aborted") from exc
    return CompactionResult(out)


def _compact_vbucket(storage: LmdbStorage, vb: int, plan: CompactionPlan) -> VBucketCompaction:
    history = storage.history_enabled
    dindex = storage._disk_index[vb]
    db = storage.item_db(vb)
    purge_before = plan.purge_before
    purged: list[tuple[bytes, int]] = []
    doomed: list[int] = []
    superseded: list[tuple[int, int, int]] = []  # (seqno, bytes, cas)
    old_versions: dict[bytes, list[int]] = {}
    with storage.env.begin(write=True) as txn:
        for k, v in txn.cursor(db=db):
            op, _dt, cas, kl, dtime, seqno, _r, _f, _e, _l, _n, _u = _rec_unpack(v)
            key = v[_REC_HEAD:_REC_HEAD + kl]
            if dindex.get(key) == seqno:
                if op != _MUTATION and purge_before is not None and dtime < purge_before:
                    doomed.append(seqno)
                    purged.append((key, seqno))
                    doomed.extend(old_versions.pop(key, ()))
            elif history:
                superseded.append((seqno, len(k) + len(v), cas))
                old_versions.setdefault(key, []).append(seqno)
            else:  # left over from a time the history window was on
                doomed.append(seqno)
        raw = txn.get(VB_KEY.pack(vb), db=storage.state_db)
        rec = VBStateRecord.decode(raw) if raw else None
        hist_start = max(storage._history_start[vb], rec.history_start if rec else 0)
        pruned = 0
        if superseded:
            gone = set(doomed)
            live = [s for s in superseded if s[0] not in gone]
            cutoff = plan.history_cutoff_cas
            keep = []
            newest_pruned = 0
            for s in live:
                if cutoff and s[2] < cutoff:
                    doomed.append(s[0])
                    newest_pruned = max(newest_pruned, s[0])
                    pruned += 1
                else:
                    keep.append(s)
            budget = plan.history_bytes_per_vb
            if budget:
                total = sum(s[1] for s in keep)
                for s in keep:  # oldest first
                    if total <= budget:
                        break
                    total -= s[1]
                    doomed.append(s[0])
                    newest_pruned = max(newest_pruned, s[0])
                    pruned += 1
            if newest_pruned:
                hist_start = max(hist_start, newest_pruned + 1)
        purge_seqno = max(storage._purge_seqno[vb], rec.purge_seqno if rec else 0,
                          max((s for _, s in purged), default=0))
        delete = txn.delete
        for seqno in sorted(doomed):
            delete(item_key(vb, seqno), db=db)
        if doomed and rec is not None:
            rec.purge_seqno = purge_seqno
            rec.history_start = hist_start
            txn.put(VB_KEY.pack(vb), rec.encode(), db=storage.state_db)
    # committed: private bookkeeping follows the disk
    for key, seqno in purged:
        if dindex.get(key) == seqno:
            del dindex[key]
    storage._purge_seqno[vb] = purge_seqno
    storage._history_start[vb] = hist_start
    return VBucketCompaction(vb, purged, purge_seqno, pruned, hist_start)


class Compactor:
    """The event-loop side of compaction for one bucket."""

    __slots__ = ("_bucket",)

    def __init__(self, bucket: Bucket) -> None:
        self._bucket = bucket

    def plan(self, now: float | None = None, vbuckets: list[int] | None = None) -> CompactionPlan:
        """Capture the policy for a run over ``vbuckets`` (default: all)."""
        b = self._bucket
        cfg = b.config
        now = b.clock() if now is None else now
        cutoff = int((now - cfg.history_seconds) * 1e9) if cfg.history_seconds > 0 else 0
        per_vb = cfg.history_bytes // cfg.num_vbuckets if cfg.history_bytes else 0
        vbs = list(range(cfg.num_vbuckets)) if vbuckets is None else list(vbuckets)
        return CompactionPlan(now, vbs, now - cfg.tombstone_purge_age, cutoff, per_vb)

    def complete(self, result: CompactionResult) -> None:
        """Raise purge seqnos and forget purged tombstones (event-loop thread)."""
        for vc in result.vbuckets:
            vb = self._bucket._vbuckets[vc.vbid]
            vb._compaction_done(vc)
