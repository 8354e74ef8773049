"""Persistence: the one writer of the storage (flusher, compaction, the final flush).

Rules of this module:
- ``Persistence`` owns everything about getting queued items to disk: the storage lock,
  the flush and durable-write events, the pause switch, the storage error that makes
  writes ETMPFAIL, and the long-running flusher and compaction loops (started by
  ``DcpServer.run`` in its background nursery; they run until cancelled).
- Storage writes (flush, compaction) hold the storage lock, so there is exactly one
  writer. A write and the engine bookkeeping that follows it are shielded from
  cancellation together: a batch is either written *and* completed, or neither.
- Blocking LMDB work runs in ``trio.to_thread.run_sync``; the engine's in-memory state
  is touched only between awaits, on the trio thread.
- Storage failures never crash the server: writes get ETMPFAIL meanwhile
  (``storage_error``), the flusher retries with backoff, items stay queued.
- Connections are seen only as ``DurableWaiter``s: the flusher wakes those with a durable
  write waiting for this node's persistence when a flush advanced a persisted seqno, and
  keeps its interval short while one waits.
- Flush listeners (``add_flush_listener``: the durability monitor, the replication
  manager's acks) are called after every successful flush transaction, on the trio
  thread; one that raises is logged and the others still run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Protocol

import trio

from ..protocol.errors import NotMyVbucket
from ..protocol.opcodes import Status, VBucketState
from .config import ServerConfig
from .engine import Bucket, StorageError, StorageFullError
from .metrics import ServerMetrics

__all__ = ["DurableWaiter", "Persistence"]

log = logging.getLogger("dcp.persistence")

#: How many times the final flush doubles a full map before it gives up.
_FINAL_FLUSH_GROWTHS = 8


class DurableWaiter(Protocol):
    """What the flusher needs of a connection: does a durable write wait for this node's
    persistence (``has_pending_durable``), wake it."""

    def has_pending_durable(self) -> bool: ...

    def wake(self) -> None: ...


class Persistence:
    """Flushing and compaction of one bucket (see the module rules)."""

    def __init__(
        self,
        bucket: Bucket,
        config: ServerConfig,
        metrics: ServerMetrics,
        waiters: Collection[DurableWaiter],
        clock: Callable[[], float],
    ) -> None:
        self.bucket = bucket
        self.config = config
        self.metrics = metrics
        self.waiters = waiters
        self.clock = clock
        #: Operators (and tests) can hold the flusher, e.g. to drain a disk; writes still
        #: land in memory and durable writes wait.
        self.paused = False
        #: why the last flush failed, until one succeeds (writes get ETMPFAIL meanwhile)
        self.storage_error: str | None = None
        #: the last flush was capped at ``flush_batch_items``: more is waiting
        self.flush_backlog = False
        self._lock = trio.Lock()
        self._flush_event = trio.Event()
        self._durable_event = trio.Event()
        self._flush_listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ signals

    def add_flush_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every successful flush transaction (persisted seqnos may
        have moved)."""
        self._flush_listeners.append(fn)

    def wake(self) -> None:
        """New items are queued: a flusher idle for lack of work looks again now."""
        self._flush_event.set()

    def want_flush(self) -> None:
        """A durable write waits for persistence: flush now, skipping ``flush_interval``."""
        self._flush_event.set()
        self._durable_event.set()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._flush_event.set()

    def persisted_seqno(self, vbid: int) -> int:
        return self.bucket.vbucket(vbid).persisted_seqno

    def write_refusal(self) -> str:
        """Why writes must be refused right now ("" = accept)."""
        if self.storage_error:
            return f"temporary failure: storage cannot persist ({self.storage_error})"
        bucket = self.bucket
        quota = bucket.checkpoint_memory_quota
        # Slow streams lose their cursors at the quota; what is left above it is pinned by
        # unpersisted items. Refuse only well past it, so bursts don't bounce.
        if bucket.checkpoint_memory() > max(2 * quota, quota + (64 << 20)):
            return "temporary failure: checkpoint memory over quota, persistence behind"
        return ""

    # ------------------------------------------------------------------ flushing

    async def flush_once(self, *, respect_pause: bool = False) -> bool:
        """Write one batch. Returns False when nothing was queued (or, with
        ``respect_pause``, when persistence is paused: checked under the storage lock, so
        a pause takes effect even for a flusher that was already waiting for the lock).

        Raises:
            StorageError: the batch could not be written (it stays queued).
        """
        bucket = self.bucket
        flusher = bucket.flusher
        limit = self.config.flush_batch_items
        with trio.CancelScope(shield=True):
            async with self._lock:
                if respect_pause and self.paused:
                    return False
                batch = flusher.collect(limit)
                if batch is None:
                    return False
                try:
                    await trio.to_thread.run_sync(bucket.storage.write_batch, batch)
                except StorageError as exc:
                    flusher.failed(batch, exc)
                    raise
                advanced = flusher.complete(batch)
                # a capped batch left items behind: the flusher must not pause before them
                self.flush_backlog = batch.num_items >= limit
        self.metrics.flushes += 1
        if self.storage_error:
            log.info("storage recovered: flushing again")
            self.storage_error = None
        if advanced:
            for waiter in list(self.waiters):
                if waiter.has_pending_durable():
                    waiter.wake()
        for fn in self._flush_listeners:
            try:
                fn()
            except Exception:  # a listener's bug must not stop the flusher
                log.exception("flush listener %r failed", fn)
        return True

    async def flush_all(self) -> None:
        """Persist everything queued, paused or not (shutdown and tests)."""
        while await self.flush_once():
            pass

    async def final_flush(self) -> bool:
        """Persist everything acknowledged before stopping; False when some could not be.

        A full LMDB *map* (``StorageFullError``) must not turn a graceful stop into data
        loss: grow the map (a sparse file: growing costs no disk) until the queue fits,
        and say so. A full disk (``DiskFullError``, ENOSPC) or an I/O error (EIO) is not
        a full map: growing cannot help and would only reserve address space the disk
        does not have, so the flush gives up at once. The server turns False into an
        unclean shutdown, which ``dcp-server`` reports with exit code 4
        (docs/operations.md)."""
        storage = self.bucket.storage
        for _ in range(_FINAL_FLUSH_GROWTHS):
            try:
                await self.flush_all()
                return True
            except StorageFullError:
                new_size = storage.map_size * 2
                log.warning(
                    "LMDB map full at shutdown: growing it to %d bytes to persist "
                    "%d acknowledged items",
                    new_size,
                    self.bucket.flusher.pending_items(),
                )
                try:
                    await trio.to_thread.run_sync(storage.grow_map, new_size)
                except StorageError as exc:
                    log.error("cannot grow the map: %s", exc)
                    break
            except StorageError as exc:
                log.error("final flush failed: %s", exc)
                break
        log.error(
            "shutdown could not persist everything: %d acknowledged items (up to) are "
            "lost; the next start treats this stop as a crash",
            self.bucket.flusher.pending_items(),
        )
        return False

    def _durable_waiting(self) -> bool:
        return any(w.has_pending_durable() for w in self.waiters)

    async def run_flusher(self) -> None:
        """Flush until cancelled: at once while there is a backlog or a durable write
        waits, else at most every ``flush_interval``; retry failures with backoff."""
        backoff = 0.05
        interval = self.config.flush_interval
        while True:
            if self.paused:
                self._flush_event = trio.Event()
                await self._flush_event.wait()
                continue
            # A durable write that arrives from here on is not in this batch: it must cut
            # the pause below short (want_flush sets the event).
            self._durable_event = trio.Event()
            try:
                progressed = await self.flush_once(respect_pause=True)
            except StorageError as exc:
                if self.storage_error != str(exc):
                    log.error("flusher error: %s (writes get ETMPFAIL until it clears)", exc)
                self.storage_error = str(exc)
                self.metrics.flush_errors += 1
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            if not progressed:
                self._flush_event = trio.Event()
                with trio.move_on_after(0.5):
                    await self._flush_event.wait()
            elif interval and not self.flush_backlog and not self._durable_waiting():
                # Persist by time under a trickle of writes: one fsync'd transaction per
                # interval rather than per request batch (each costs the event loop GIL
                # time). Never with a backlog left or a durable write still waiting (it
                # may be of a vbucket a capped batch did not reach).
                with trio.move_on_after(interval):
                    await self._durable_event.wait()

    # ------------------------------------------------------------------ replica rollback

    async def rollback(self, vbid: int, seqno: int) -> int:
        """Roll a replica vbucket back to ``seqno`` or below (engine: ``Bucket.rollback``'s
        parts) under the storage lock, so no flush batch is in flight or collected
        meanwhile; returns the seqno reached. The unpersisted tail is dropped, not
        flushed: flushing it would delete the versions the rollback must restore.

        Raises:
            StorageError: nothing was rolled back (the caller retries later).
        """
        bucket = self.bucket
        vb = bucket.vbucket(vbid)
        with trio.CancelScope(shield=True):
            async with self._lock:
                state = vb.state
                if state not in (VBucketState.REPLICA, VBucketState.PENDING):
                    raise NotMyVbucket(
                        Status.NOT_MY_VBUCKET, f"vbucket {vbid} is {state.name}: no rollback"
                    )
                target = bucket.rollback_target(vbid, seqno)
                rec = vb.state_record(target, target, target)  # memory: read on this thread
                reached, index, max_cas = await trio.to_thread.run_sync(
                    bucket.rollback_disk, vbid, target, rec
                )
                if vb.state is not state:  # pragma: no cover - VBucketStates refuses it
                    raise RuntimeError(f"vb {vbid} changed state during its rollback")
                vb.reset_to(reached, index, max_cas)
        log.info("vb %d rolled back to seqno %d (asked for %d)", vbid, reached, seqno)
        return reached

    # ------------------------------------------------------------------ compaction

    async def run_compaction(self) -> None:
        """Purge tombstones older than the purge age (raises purge seqnos), periodically."""
        while True:
            await trio.sleep(self.config.compaction_interval)
            await self.compact_now()

    async def compact_now(self) -> int:
        """One compaction under the storage lock; the number of tombstones purged (0 when
        it failed: logged, the next round tries again)."""
        compactor = self.bucket.compactor
        storage = self.bucket.storage
        try:
            with trio.CancelScope(shield=True):
                async with self._lock:
                    # plan and complete touch vbuckets (this thread); compact is LMDB only
                    plan = compactor.plan(self.clock())
                    result = await trio.to_thread.run_sync(storage.compact, plan)
                    purged = compactor.complete(result)
        except StorageError as exc:
            log.error("compaction failed: %s", exc)
            return 0
        if purged:
            log.info("compaction purged=%d tombstones", purged)
        return purged
