"""Warm-up: rebuild a bucket's vbuckets from LMDB when it opens.

Rules of this module (reference §5.3, DESIGN "Durability and consistency contract"):
- Every vbucket state, failover log, purge seqno and persisted snapshot comes from the
  ``vbstate`` DB; the key index (key -> newest version's metadata) and the expiry heap
  are rebuilt from one scan of the vbucket's items (records carry their key).
- After an UNCLEAN shutdown (no clean-shutdown marker), every ACTIVE vbucket gets a new
  failover entry at its last persisted consistent point: the last snapshot end if the
  persisted high seqno equals it, else the snapshot start. So a consumer that saw
  unpersisted items is told to roll back. A clean shutdown adds no entry.
- A vbucket with no persisted state is new: ``(random uuid, 0)`` in the configured
  initial state.
- Warm-up ends by persisting the states it created or changed and clearing the
  clean-shutdown marker in one transaction, so a crash from now on is unclean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...protocol.opcodes import VBucketState
from .failover import FailoverTable
from .records import VBStateRecord
from .vbucket import VBucket

if TYPE_CHECKING:
    from .bucket import Bucket

__all__ = ["failover_seqno_after_crash", "warm_up"]


def failover_seqno_after_crash(rec: VBStateRecord) -> int:
    """The seqno of the failover entry added after an unclean shutdown (§5.3)."""
    return rec.snap_end if rec.high_seqno == rec.snap_end else rec.snap_start


def warm_up(bucket: Bucket) -> list[VBucket]:
    """Build every vbucket of ``bucket`` from its storage (blocking; at open only)."""
    storage = bucket.storage
    cfg = bucket.config
    states = storage.load_states()
    unclean = not storage.fresh and not storage.clean_shutdown
    bucket.warmup_unclean = unclean
    to_write: dict[int, VBStateRecord] = {}
    vbuckets = []
    for vbid in range(cfg.num_vbuckets):
        rec = states.get(vbid)
        common = dict(config=cfg, memory=bucket._memory, storage=storage, clock=bucket.clock,
                      uuid_source=bucket.uuid_source, notify=bucket._queued)
        if rec is None:
            vb = VBucket(vbid, state=cfg.initial_state,
                         failover_log=FailoverTable.new(bucket.uuid_source,
                                                        cfg.max_failover_entries), **common)
            to_write[vbid] = vb.state_record(0, 0, 0)
            vbuckets.append(vb)
            continue
        table = FailoverTable(rec.failover, cfg.max_failover_entries)
        disk_high = storage.disk_high_seqno(vbid)
        high = max(rec.high_seqno, disk_high)
        if unclean and rec.state == VBucketState.ACTIVE:
            table.create_entry(failover_seqno_after_crash(rec), bucket.uuid_source)
        vb = VBucket(vbid, state=VBucketState(rec.state), failover_log=table, high_seqno=high,
                     snap_start=rec.snap_start, snap_end=rec.snap_end,
                     purge_seqno=rec.purge_seqno, max_cas=rec.max_cas,
                     history_start=rec.history_start, **common)
        vb.load_index(storage.scan_for_warmup(vbid))
        if table.entries != rec.failover:
            to_write[vbid] = vb.state_record(high, rec.snap_start, rec.snap_end)
        vbuckets.append(vb)
    storage.write_states(to_write, clean_shutdown=False)
    return vbuckets
