"""Compaction, the engine half: the policy of a run and its effect on the vbuckets.

Rules of this module:
- Shaped like the flusher, in three steps:

      Compactor.plan()          (event-loop thread, cheap) capture the policy: which
          |                      vbuckets, tombstones deleted before when, history cutoffs
          v
      LmdbStorage.compact(plan) (worker thread, blocking; lmdb_compaction.py) one write
          |                      transaction per vbucket; the storage's own bookkeeping
          v                      follows each commit
      Compactor.complete(result) (event-loop thread) each vbucket raises its purge seqno
                                 and history start and forgets its purged tombstones

- A purged tombstone raises the vbucket's purge seqno, which makes stream requests
  starting below it roll back to 0 (stream_decision.py). A pruned superseded version
  raises ``history_start``: scans from there on see complete history.
- The history byte budget is split per vbucket (``history_bytes / num_vbuckets``), as
  Magma does; the age cutoff is a CAS (HLC nanoseconds), compared with each version's.
- This module changes vbuckets only through their public ``apply_compaction``; it
  touches neither LMDB nor the storage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .lmdb_compaction import CompactionPlan, CompactionResult, VBucketCompaction

if TYPE_CHECKING:
    from .config import EngineConfig
    from .vbucket import VBucket

__all__ = ["CompactionPlan", "CompactionResult", "Compactor", "VBucketCompaction"]


class Compactor:
    """The event-loop side of compaction for one bucket."""

    __slots__ = ("_clock", "_config", "_vbuckets")

    def __init__(
        self, vbuckets: Sequence[VBucket], config: EngineConfig, clock: Callable[[], float]
    ) -> None:
        """``vbuckets``: the bucket's vbuckets, indexed by vbid (the bucket's own list)."""
        self._vbuckets = vbuckets
        self._config = config
        self._clock = clock

    def plan(self, now: float | None = None, vbuckets: list[int] | None = None) -> CompactionPlan:
        """Capture the policy for a run over ``vbuckets`` (default: all)."""
        cfg = self._config
        now = self._clock() if now is None else now
        cutoff = int((now - cfg.history_seconds) * 1e9) if cfg.history_seconds > 0 else 0
        per_vb = cfg.history_bytes // cfg.num_vbuckets if cfg.history_bytes else 0
        vbs = list(range(cfg.num_vbuckets)) if vbuckets is None else list(vbuckets)
        return CompactionPlan(now, vbs, now - cfg.tombstone_purge_age, cutoff, per_vb)

    def complete(self, result: CompactionResult) -> int:
        """Raise purge seqnos and forget purged tombstones (event-loop thread); returns
        the number of tombstones purged."""
        vbs = self._vbuckets
        for vc in result.vbuckets:
            vbs[vc.vbid].apply_compaction(vc)
        return result.tombstones_purged
