"""The LMDB half of compaction: one vbucket's write transaction (owned by storage.py).

Rules of this module:
- ``compact_vbucket`` is called by ``LmdbStorage.compact`` only, with the storage write
  lock held and inside a write transaction the caller opened and commits. It reads and
  writes LMDB through that transaction and nothing else: the storage's bookkeeping (disk
  key index, purge seqno, history start) comes in as arguments and the changes come
  back in a ``VBucketCompaction``, which the caller applies once the commit succeeded.
- A tombstone is purged when it is the newest version of its key (per the disk index)
  and its delete time is older than ``plan.purge_before``. With history on, the
  superseded versions of a purged key go with it (else warm-up would resurrect the
  newest of them). Without history, superseded versions are left-overs from a time the
  history window was on and all go.
- History pruning (history on): a superseded version goes when its write time (its HLC
  CAS) is below ``plan.history_cutoff_cas``, then the oldest go while the superseded
  bytes exceed ``plan.history_bytes_per_vb``. ``history_start`` becomes the seqno after
  the newest pruned version. The vbucket's state record is rewritten with the raised
  purge seqno and history start only when something was deleted.
- The plan and result classes live here because they are the interface between the
  engine's policy (compaction.py, event-loop thread) and this transaction (worker thread).
"""

from __future__ import annotations

from typing import Any

from .item import ItemOp
from .records import ITEM_RECORD, VB_KEY, VBStateRecord, item_key

__all__ = ["CompactionPlan", "CompactionResult", "VBucketCompaction", "compact_vbucket"]

_REC_HEAD = ITEM_RECORD.size
_rec_unpack = ITEM_RECORD.unpack_from
_MUTATION = int(ItemOp.MUTATION)


class CompactionPlan:
    """What one compaction run does. ``purge_before`` None: no tombstone purge;
    ``history_cutoff_cas`` 0: no age pruning; ``history_bytes_per_vb`` 0: no byte limit.
    """

    __slots__ = ("history_bytes_per_vb", "history_cutoff_cas", "now", "purge_before", "vbuckets")

    def __init__(
        self,
        now: float,
        vbuckets: list[int],
        purge_before: float | None,
        history_cutoff_cas: int,
        history_bytes_per_vb: int,
    ) -> None:
        self.now = now
        self.vbuckets = vbuckets
        self.purge_before = purge_before
        self.history_cutoff_cas = history_cutoff_cas
        self.history_bytes_per_vb = history_bytes_per_vb


class VBucketCompaction:
    """Outcome for one vbucket: purged tombstones (key, seqno) and the new seqnos."""

    __slots__ = ("history_start", "pruned", "purge_seqno", "purged", "vbid")

    def __init__(
        self,
        vbid: int,
        purged: list[tuple[bytes, int]],
        purge_seqno: int,
        pruned: int,
        history_start: int,
    ) -> None:
        self.vbid = vbid
        self.purged = purged
        self.purge_seqno = purge_seqno
        self.pruned = pruned
        self.history_start = history_start


class CompactionResult:
    """Every vbucket's outcome of one run, in the plan's order."""

    __slots__ = ("vbuckets",)

    def __init__(self, vbuckets: list[VBucketCompaction]) -> None:
        self.vbuckets = vbuckets

    @property
    def tombstones_purged(self) -> int:
        return sum(len(v.purged) for v in self.vbuckets)

    @property
    def versions_pruned(self) -> int:
        return sum(v.pruned for v in self.vbuckets)


def compact_vbucket(
    txn: Any,
    vb: int,
    *,
    item_db: Any,
    state_db: Any,
    disk_index: dict[bytes, int],
    purge_seqno: int,
    history_start: int,
    history: bool,
    plan: CompactionPlan,
) -> VBucketCompaction:
    """Delete what ``plan`` purges or prunes from ``vb`` inside ``txn`` (module rules).

    ``disk_index``, ``purge_seqno`` and ``history_start`` are the storage's current
    bookkeeping for ``vb``; this function only reads them.

    Raises:
        lmdb.Error: the caller aborts the transaction and reports it.
    """
    purge_before = plan.purge_before
    purged: list[tuple[bytes, int]] = []
    doomed: list[int] = []
    superseded: list[tuple[int, int, int]] = []  # (seqno, bytes, cas), oldest first
    old_versions: dict[bytes, list[int]] = {}
    for k, v in txn.cursor(db=item_db):
        op, _dt, cas, kl, dtime, seqno, _r, _f, _e, _l, _n, _u = _rec_unpack(v)
        key = v[_REC_HEAD : _REC_HEAD + kl]
        if disk_index.get(key) == seqno:
            if op != _MUTATION and purge_before is not None and dtime < purge_before:
                doomed.append(seqno)
                purged.append((key, seqno))
                doomed.extend(old_versions.pop(key, ()))
        elif history:
            superseded.append((seqno, len(k) + len(v), cas))
            old_versions.setdefault(key, []).append(seqno)
        else:  # left over from a time the history window was on
            doomed.append(seqno)
    raw = txn.get(VB_KEY.pack(vb), db=state_db)
    rec = VBStateRecord.decode(raw) if raw else None
    hist_start = max(history_start, rec.history_start if rec else 0)
    pruned = 0
    if superseded:
        newest_pruned, pruned = _prune_history(superseded, set(doomed), plan, doomed)
        if newest_pruned:
            hist_start = max(hist_start, newest_pruned + 1)
    new_purge = max(
        purge_seqno, rec.purge_seqno if rec else 0, max((s for _, s in purged), default=0)
    )
    delete = txn.delete
    for seqno in sorted(doomed):
        delete(item_key(vb, seqno), db=item_db)
    if doomed and rec is not None:
        rec.purge_seqno = new_purge
        rec.history_start = hist_start
        txn.put(VB_KEY.pack(vb), rec.encode(), db=state_db)
    return VBucketCompaction(vb, purged, new_purge, pruned, hist_start)


def _prune_history(
    superseded: list[tuple[int, int, int]], gone: set[int], plan: CompactionPlan, doomed: list[int]
) -> tuple[int, int]:
    """Append the superseded versions to prune to ``doomed`` (those not already ``gone``):
    first by age, then oldest first down to the byte budget. Returns (newest pruned
    seqno or 0, versions pruned)."""
    cutoff = plan.history_cutoff_cas
    keep = []
    newest_pruned = 0
    pruned = 0
    for s in superseded:
        if s[0] in gone:
            continue
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
    return newest_pruned, pruned
