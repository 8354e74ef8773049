"""The bucket: N vbuckets, the KV operations, checkpoint memory, flusher and storage.

Rules of this module:
- The facade the server drives. Synchronous and deterministic: time comes from the
  injected ``clock`` (epoch seconds), vbucket uuids from ``uuid_source``; nothing here
  imports trio, socket or time.
- Single-threaded: everything runs on the event-loop thread except the blocking storage
  calls (``LmdbStorage.write_batch``, ``open_backfill``/``BackfillScan.read``,
  ``compact``, ``grow_map``), which touch only LMDB and their own objects.
- Writes are acknowledged once they are in memory; a caller wanting durability waits
  for the vbucket's persisted seqno (``Flusher.add_persistence_listener`` or
  ``is_persisted``).
- Checkpoint memory is bucket-wide. Above the quota, the cursors of the slowest streams
  are dropped (never the persistence cursor) so their checkpoints can be freed; each
  listener is then called with the vbucket so the stream notices ``cursor.dropped``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path

from ...protocol.errors import NotMyVbucket
from ...protocol.opcodes import Status, VBucketState
from .checkpoint import Cursor
from .checkpoint_manager import CheckpointMemory
from .compaction import Compactor
from .config import EngineConfig
from .flusher import Flusher
from .item import GetResult, MutationResult
from .records import VBStateRecord
from .storage import LmdbStorage
from .vbucket import StoreMode, VBucket, build_key_index
from .warmup import VBucketWarmup, Warmup, warm_up

__all__ = ["Bucket"]

_MiB = 1024 * 1024


class Bucket:
    """A bucket of ``config.num_vbuckets`` vbuckets persisted in one LMDB environment."""

    def __init__(
        self,
        config: EngineConfig,
        storage: LmdbStorage,
        warmup: Warmup,
        *,
        clock: Callable[[], float],
        uuid_source: Callable[[], int],
    ) -> None:
        """Use ``Bucket.open``: it opens ``storage`` and warms it up (``warm_up``); the
        vbuckets start from ``warmup``. The bucket owns ``storage`` from here on."""
        self.config = config
        self.num_vbuckets = config.num_vbuckets
        self.storage = storage
        self.clock = clock
        self.uuid_source = uuid_source
        self._memory = CheckpointMemory(
            config.checkpoint_memory_quota,
            self._memory_pressure,
            retain_seconds=config.checkpoint_retain_seconds,
            clock=clock,
        )
        self._listeners: list[Callable[[int], None]] = []
        #: by vbid; the flusher and the compactor share this list
        self._vbuckets: list[VBucket] = [self._start_vbucket(w) for w in warmup.vbuckets]
        self.flusher = Flusher(self._vbuckets, storage, self._relieve_memory)
        self._mark_dirty = self.flusher.mark_dirty
        self.compactor = Compactor(self._vbuckets, config, clock)
        self.cursors_dropped = 0
        #: the previous shutdown was unclean: warm-up added failover entries
        self.warmup_unclean = warmup.unclean
        self._closed = False

    @classmethod
    def open(
        cls,
        data_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float],
        uuid_source: Callable[[], int],
    ) -> Bucket:
        """Open (or create) the bucket stored in ``data_dir`` and warm it up (blocking).

        Raises:
            ValueError: invalid ``config``.
            StorageError: LMDB cannot be opened or holds an incompatible bucket.
        """
        config = config or EngineConfig()
        config.validate()
        storage = LmdbStorage(
            data_dir,
            num_vbuckets=config.num_vbuckets,
            map_size=config.map_size,
            sync=config.lmdb_sync,
            history_enabled=config.history_enabled,
        )
        try:
            warmup = warm_up(storage, config, uuid_source)
            bucket = cls(config, storage, warmup, clock=clock, uuid_source=uuid_source)
        except BaseException:
            storage.close()
            raise
        return bucket

    def _start_vbucket(self, w: VBucketWarmup) -> VBucket:
        return VBucket(
            w.vbid,
            config=self.config,
            memory=self._memory,
            storage=self.storage,
            clock=self.clock,
            uuid_source=self.uuid_source,
            notify=self._queued,
            state=w.state,
            failover_log=w.failover_log,
            high_seqno=w.high_seqno,
            snap_start=w.snap_start,
            snap_end=w.snap_end,
            purge_seqno=w.purge_seqno,
            max_cas=w.max_cas,
            history_start=w.history_start,
            index=w.index,
        )

    # ------------------------------------------------------------------ vbuckets

    def vbucket(self, vb: int) -> VBucket:
        """The vbucket ``vb``; ``NotMyVbucket`` if out of range."""
        if not 0 <= vb < self.num_vbuckets:
            raise NotMyVbucket(Status.NOT_MY_VBUCKET, f"vbucket {vb} out of range")
        return self._vbuckets[vb]

    @property
    def vbuckets(self) -> list[VBucket]:
        return list(self._vbuckets)

    # ------------------------------------------------------------------ KV operations

    def owner(self, vb: int, key: bytes) -> VBucket:
        """The vbucket ``vb`` if it exists, else ``NotMyVbucket``. (Whether ``key`` hashes
        to ``vb`` is the wire layer's check: the engine stores what it is given.)"""
        if not 0 <= vb < self.num_vbuckets:
            raise NotMyVbucket(Status.NOT_MY_VBUCKET, f"vbucket {vb} out of range")
        return self._vbuckets[vb]

    def set(
        self,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiry: int = 0,
        cas: int = 0,
        datatype: int = 0,
    ) -> MutationResult:
        """Upsert (CAS-checked when ``cas`` != 0: KeyExists on mismatch, KeyNotFound if
        absent)."""
        return self.owner(vb, key).store(key, value, flags, expiry, cas, datatype, StoreMode.SET)

    def add(
        self,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiry: int = 0,
        cas: int = 0,
        datatype: int = 0,
    ) -> MutationResult:
        """Insert; ``KeyExists`` if a live version exists."""
        return self.owner(vb, key).store(key, value, flags, expiry, cas, datatype, StoreMode.ADD)

    def replace(
        self,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiry: int = 0,
        cas: int = 0,
        datatype: int = 0,
    ) -> MutationResult:
        """Update; ``KeyNotFound`` if no live version exists."""
        return self.owner(vb, key).store(
            key, value, flags, expiry, cas, datatype, StoreMode.REPLACE
        )

    def delete(self, vb: int, key: bytes, *, cas: int = 0) -> MutationResult:
        """Tombstone a live key; ``KeyNotFound`` if absent, ``KeyExists`` on CAS mismatch."""
        return self.owner(vb, key).delete(key, cas)

    def get(self, vb: int, key: bytes) -> GetResult:
        """The live document; ``KeyNotFound`` if absent, deleted or expired."""
        return self.owner(vb, key).get(key)

    def expire(self, now: float | None = None) -> int:
        """Expiry pass over every active vbucket; returns the number of items expired."""
        now = self.clock() if now is None else now
        return sum(vb.expire(now) for vb in self._vbuckets)

    def is_persisted(self, vb: int, seqno: int) -> bool:
        """True once ``seqno`` of ``vb`` is durable in LMDB."""
        return self.vbucket(vb).persisted_seqno >= seqno

    # ------------------------------------------------------------------ replica rollback

    def rollback_target(self, vb: int, seqno: int) -> int:
        """Where a rollback of ``vb`` to ``seqno`` can aim: not above what is persisted
        (the unpersisted tail is simply dropped from memory). Event-loop thread."""
        return min(seqno, self.vbucket(vb).persisted_seqno)

    def rollback_disk(
        self, vb: int, seqno: int, rec: VBStateRecord
    ) -> tuple[int, dict[bytes, tuple], int]:
        """The blocking half of a rollback (worker thread; the caller holds off the
        flusher and made ``rec``, the vbucket's state record, on its own thread): roll
        the storage back (``LmdbStorage.rollback``) and rebuild the key index from what
        stays. Returns (seqno reached, key index, max CAS) for ``VBucket.reset_to``."""
        reached = self.storage.rollback(vb, seqno, rec)
        index, max_cas = build_key_index(self.storage.scan_for_warmup(vb))
        return reached, index, max_cas

    def rollback(self, vb: int, seqno: int) -> int:
        """A whole rollback in one blocking call (tests and tools; the server splits it,
        see persistence.py). ``vb`` must not be active. Returns the seqno reached."""
        vbucket = self.vbucket(vb)
        if vbucket.state is VBucketState.ACTIVE:
            raise NotMyVbucket(Status.NOT_MY_VBUCKET, f"vbucket {vb} is active: no rollback")
        if self.flusher.in_flight is not None:
            raise RuntimeError("rollback while a flush batch is in flight")
        target = self.rollback_target(vb, seqno)
        rec = vbucket.state_record(target, target, target)
        reached, index, max_cas = self.rollback_disk(vb, target, rec)
        vbucket.reset_to(reached, index, max_cas)
        return reached

    # ------------------------------------------------------------------ listeners

    def add_listener(self, fn: Callable[[int], None]) -> None:
        """``fn(vbid)`` is called synchronously whenever items are queued into a vbucket's
        checkpoints, its state changes, or one of its cursors is dropped. (A batched
        writer, ``VBucket.store_set``, calls it once per vbucket at the end of its batch,
        before it returns to the event loop.)"""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[int], None]) -> None:
        self._listeners.remove(fn)

    def _queued(self, vbid: int) -> None:
        self._mark_dirty(vbid)
        for fn in self._listeners:
            fn(vbid)

    def queued_many(self, vbids: Collection[int]) -> None:
        """What each vbucket's notification does, once for every vbucket in ``vbids``
        (writers that batch, ``VBucket.store_set``, notify here after the batch)."""
        if vbids:
            self.flusher.mark_dirty_many(vbids)
            for fn in self._listeners:
                deque(map(fn, vbids), 0)  # call fn(vbid) for each, at C speed

    # ------------------------------------------------------------------ memory

    def checkpoint_memory(self) -> int:
        """Bytes held by all checkpoints of all vbuckets."""
        return self._memory.used

    @property
    def checkpoint_memory_quota(self) -> int:
        return self._memory.quota

    @checkpoint_memory_quota.setter
    def checkpoint_memory_quota(self, quota: int) -> None:
        self._memory.quota = self._memory.threshold = quota
        if self._memory.used > quota:
            self._memory_pressure()

    def checkpoint_retained(self) -> int:
        """Bytes of closed checkpoints no cursor needs, kept for ``checkpoint_retain_seconds``
        (part of ``checkpoint_memory``; memory pressure frees them first)."""
        return sum(vb.checkpoints.retained_bytes for vb in self._vbuckets)

    def release_retained(self) -> int:
        """Free retained checkpoints whose retention time is up; returns bytes freed
        (the server calls this about once a second)."""
        if not self._memory.retain_seconds:
            return 0
        return sum(vb.checkpoints.release_retained() for vb in self._vbuckets)

    def _relieve_memory(self) -> None:
        """After a flush: persisted items may be freeable now, if memory is over quota."""
        if self._memory.used > self._memory.quota:
            self._memory_pressure()

    def _memory_pressure(self) -> None:
        """Get checkpoint memory back under the quota, cheapest step first.

        1. Close open checkpoints the persistence cursor has fully read: an open
           checkpoint is never freed, so persisted items would otherwise stay in memory
           for good (kv_engine creates a new checkpoint under pressure for the same
           reason). Streams that read them all move on and the old ones are freed,
           together with every checkpoint kept only by ``checkpoint_retain_seconds``
           (retention is the first thing memory pressure takes).
        2. Drop the stream cursors pinning the most memory behind the persistence
           cursor (never the persistence cursor itself).
        If memory is still above the quota it is pinned by unpersisted items; the next
        attempt waits for some growth (or for the flusher, which calls this again).
        """
        mem = self._memory
        for vb in self._vbuckets:
            mgr = vb.checkpoints
            if mgr.persistence_caught_up() and mgr.open_checkpoint_items():
                mgr.create_checkpoint()
        if mem.retain_seconds:  # after step 1: the checkpoints it closed are retained too
            for vb in self._vbuckets:
                vb.checkpoints.release_retained(all_of_them=True)
        touched = []
        if mem.used > mem.quota:
            candidates: list[tuple[int, int, Cursor]] = []
            for vb in self._vbuckets:
                mgr = vb.checkpoints
                if mgr.num_checkpoints > 1:
                    candidates.extend((pinned, vb.vbid, c) for pinned, c in mgr.droppable_cursors())
            candidates.sort(key=lambda t: t[0], reverse=True)
            for _pinned, vbid, cursor in candidates:
                if mem.used <= mem.quota:
                    break
                self._vbuckets[vbid].checkpoints.drop_cursor(cursor)
                self.cursors_dropped += 1
                touched.append(vbid)
        if mem.used > mem.quota:  # pinned by persistence: retry after some growth only
            mem.threshold = mem.used + max(mem.quota // 16, _MiB)
        else:
            mem.threshold = mem.quota
        for vbid in dict.fromkeys(touched):
            for fn in self._listeners:
                fn(vbid)

    # ------------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, int]:
        return {
            "num_vbuckets": self.num_vbuckets,
            "checkpoint_memory": self._memory.used,
            "checkpoint_memory_quota": self._memory.quota,
            "cursors_dropped": self.cursors_dropped,
            "flusher_pending_items": self.flusher.pending_items(),
            "flusher_batches_written": self.flusher.batches_written,
            "flusher_batches_failed": self.flusher.batches_failed,
            "flusher_items_written": self.flusher.items_written,
            **{f"storage_{k}": v for k, v in self.storage.stats().items()},
        }

    def close(self, clean: bool = True) -> None:
        """Close storage. With ``clean`` (and nothing left unpersisted) write the
        clean-shutdown marker so the next warm-up adds no failover entry.

        The final flush is the caller's job; if items or state changes are still
        pending the shutdown is recorded as unclean (they are lost, and consumers that
        saw them must be told to roll back).
        """
        if self._closed:
            return
        self._closed = True
        try:
            if clean and not self.flusher.has_pending() and self.flusher.in_flight is None:
                self.storage.write_states({}, clean_shutdown=True)
        finally:
            self.storage.close()

    def __enter__(self) -> Bucket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(clean=exc[0] is None)
