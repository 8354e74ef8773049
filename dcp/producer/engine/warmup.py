"""Warm-up: what a bucket's vbuckets start from, read back from its storage at open.

Rules of this module (see docs/engine.md, "Warm-up"):
- ``warm_up`` is a function of the storage and the configuration (and the uuid source
  for new failover entries): it returns a ``Warmup`` and builds no bucket; ``Bucket.open``
  passes the result to the ``Bucket`` constructor, which makes the vbuckets from it.
- Every vbucket state, failover log, purge seqno and persisted snapshot comes from the
  ``vbstate`` DB; the key index (key -> newest version's metadata, built by
  ``vbucket.build_key_index``) comes from one scan of the vbucket's items (records carry
  their key), which also rebuilds the storage's disk key index.
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

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...protocol.opcodes import VBucketState
from .failover import FailoverTable
from .records import VBStateRecord
from .vbucket import build_key_index

if TYPE_CHECKING:
    from .config import EngineConfig
    from .storage import LmdbStorage

__all__ = ["VBucketWarmup", "Warmup", "failover_seqno_after_crash", "warm_up"]


class VBucketWarmup:
    """What one vbucket starts from: its persisted state and its key index."""

    __slots__ = (
        "failover_log",
        "high_seqno",
        "history_start",
        "index",
        "max_cas",
        "purge_seqno",
        "snap_end",
        "snap_start",
        "state",
        "vbid",
    )

    def __init__(
        self,
        vbid: int,
        state: VBucketState,
        failover_log: FailoverTable,
        *,
        high_seqno: int = 0,
        snap_start: int = 0,
        snap_end: int = 0,
        purge_seqno: int = 0,
        max_cas: int = 0,
        history_start: int = 0,
        index: dict[bytes, tuple] | None = None,
    ) -> None:
        self.vbid = vbid
        self.state = state
        self.failover_log = failover_log
        self.high_seqno = high_seqno
        self.snap_start = snap_start
        self.snap_end = snap_end
        self.purge_seqno = purge_seqno
        self.max_cas = max_cas
        self.history_start = history_start
        self.index: dict[bytes, tuple] = {} if index is None else index

    def state_record(self) -> VBStateRecord:
        """The state record persisting this starting point."""
        return VBStateRecord(
            int(self.state),
            self.failover_log.copy(),
            self.high_seqno,
            self.snap_start,
            self.snap_end,
            self.purge_seqno,
            self.max_cas,
            self.history_start,
        )


class Warmup:
    """The result of ``warm_up``: every vbucket's starting point, by vbid, and whether the
    previous shutdown was unclean."""

    __slots__ = ("unclean", "vbuckets")

    def __init__(self, vbuckets: list[VBucketWarmup], unclean: bool) -> None:
        self.vbuckets = vbuckets
        self.unclean = unclean


def failover_seqno_after_crash(rec: VBStateRecord) -> int:
    """The seqno of the failover entry added after an unclean shutdown (module rules)."""
    return rec.snap_end if rec.high_seqno == rec.snap_end else rec.snap_start


def warm_up(storage: LmdbStorage, config: EngineConfig, uuid_source: Callable[[], int]) -> Warmup:
    """Read every vbucket's starting point from ``storage`` (blocking; at open only).

    Raises:
        StorageError: reading the states or writing them back failed.
    """
    states = storage.load_states()
    unclean = not storage.fresh and not storage.clean_shutdown
    to_write: dict[int, VBStateRecord] = {}
    out = []
    for vbid in range(config.num_vbuckets):
        rec = states.get(vbid)
        if rec is None:
            table = FailoverTable.new(uuid_source, config.max_failover_entries)
            w = VBucketWarmup(vbid, config.initial_state, table)
            to_write[vbid] = w.state_record()
            out.append(w)
            continue
        table = FailoverTable(rec.failover, config.max_failover_entries)
        high = max(rec.high_seqno, storage.disk_high_seqno(vbid))
        if unclean and rec.state == VBucketState.ACTIVE:
            table.create_entry(failover_seqno_after_crash(rec), uuid_source)
        index, max_cas = build_key_index(storage.scan_for_warmup(vbid), rec.max_cas)
        w = VBucketWarmup(
            vbid,
            VBucketState(rec.state),
            table,
            high_seqno=high,
            snap_start=rec.snap_start,
            snap_end=rec.snap_end,
            purge_seqno=rec.purge_seqno,
            max_cas=max_cas,
            history_start=rec.history_start,
            index=index,
        )
        if table.entries != rec.failover:
            to_write[vbid] = w.state_record()
        out.append(w)
    storage.write_states(to_write, clean_shutdown=False)
    return Warmup(out, unclean)
