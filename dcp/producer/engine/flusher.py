"""The flusher: the persistence cursor's reader, persisting checkpoints into LMDB.

Rules of this module:
- Three steps, so the event loop never blocks on disk and a failure loses nothing:

      collect()  (event-loop thread, cheap)   copy items + vbucket states into a batch;
          |                                    the persistence cursor does NOT move
          v
      LmdbStorage.write_batch(batch)          (worker thread, blocking) one transaction
          |                  \\
          v                   v
      complete(batch)        failed(batch, exc)
      cursor advances,       nothing moves: the same items are collected again
      persisted seqnos rise, on the next collect (retry after growing the map...)
      checkpoints freed

- One batch in flight at a time (``collect`` refuses a second one): a batch's items are
  appended above the stored seqnos, so the same items must never be written twice.
- A batch holds whole snapshots only (the cursor never splits one), so every persisted
  state is a consistent point: persisted high seqno == last persisted snapshot end.
- Vbuckets are visited round-robin from where the previous batch stopped, so a busy
  vbucket cannot starve the others; each vbucket's items are contiguous in the batch.
- The flusher owns what it needs to know: the dirty set (vbuckets with unpersisted items
  or state, marked through ``mark_dirty``/``mark_dirty_many`` by the bucket's
  notification) and, per vbucket, the ``state_version`` it last persisted. It gets the
  vbuckets, the storage and the bucket's memory relief as constructor arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from .item import Item
from .records import VBStateRecord

if TYPE_CHECKING:
    from .checkpoint_manager import PeekMark
    from .storage import LmdbStorage
    from .vbucket import VBucket

__all__ = ["FlushBatch", "Flusher", "VBucketFlush"]


class VBucketFlush:
    """One vbucket's part of a batch: items in seqno order and the state to persist."""

    __slots__ = (
        "high_seqno",
        "items",
        "mark",
        "snap_end",
        "snap_start",
        "state",
        "state_version",
        "vbid",
    )

    def __init__(
        self, vbid: int, items: list[Item], state: VBStateRecord, mark: PeekMark, state_version: int
    ) -> None:
        self.vbid = vbid
        self.items = items
        self.state = state
        self.mark = mark
        self.state_version = state_version
        self.high_seqno = state.high_seqno
        self.snap_start = state.snap_start
        self.snap_end = state.snap_end


class FlushBatch:
    """Everything one LMDB transaction writes. Read-only once collected."""

    __slots__ = ("num_items", "vbuckets")

    def __init__(self, vbuckets: list[VBucketFlush]) -> None:
        self.vbuckets = vbuckets
        self.num_items = sum(len(v.items) for v in vbuckets)

    def __repr__(self) -> str:
        return f"FlushBatch({len(self.vbuckets)} vbuckets, {self.num_items} items)"


class Flusher:
    """Reads every vbucket's persistence cursor; see the module rules."""

    __slots__ = (
        "_dirty",
        "_in_flight",
        "_listeners",
        "_next_vb",
        "_persisted_versions",
        "_relieve_memory",
        "_storage",
        "_vbuckets",
        "batches_failed",
        "batches_written",
        "items_written",
        "last_error",
        "mark_dirty",
        "mark_dirty_many",
    )

    def __init__(
        self, vbuckets: Sequence[VBucket], storage: LmdbStorage, relieve_memory: Callable[[], None]
    ) -> None:
        """``vbuckets``: the bucket's vbuckets, indexed by vbid (the bucket's own list,
        filled at warm-up). ``relieve_memory()`` is called after every durable batch:
        the items it persisted may now be freed (the bucket checks its quota)."""
        self._vbuckets = vbuckets
        self._storage = storage
        self._relieve_memory = relieve_memory
        self._dirty: set[int] = set()
        #: ``mark_dirty(vbid)``: the vbucket has something to persist. The set's own
        #: method, so the per-write notification costs what a set insert costs.
        self.mark_dirty: Callable[[int], None] = self._dirty.add
        #: ``mark_dirty_many(vbids)``: the same for a batch of vbuckets
        self.mark_dirty_many: Callable[[Iterable[int]], None] = self._dirty.update
        self._persisted_versions: dict[int, int] = {}  # vbid -> state_version persisted
        self._in_flight: FlushBatch | None = None
        self._next_vb = 0
        self._listeners: list[Callable[[int, int], None]] = []
        self.batches_written = 0
        self.batches_failed = 0
        self.items_written = 0
        self.last_error: BaseException | None = None

    def add_persistence_listener(self, fn: Callable[[int, int], None]) -> None:
        """``fn(vbid, persisted_seqno)`` after each batch that advanced a vbucket.

        This is how a durable write learns it is persisted: wait until the vbucket's
        persisted seqno reaches the write's seqno.
        """
        self._listeners.append(fn)

    def remove_persistence_listener(self, fn: Callable[[int, int], None]) -> None:
        self._listeners.remove(fn)

    def collect(self, max_items: int = 20_000) -> FlushBatch | None:
        """Copy up to ~``max_items`` unpersisted items (whole snapshots) into a batch.

        Returns None when nothing needs persisting.

        Raises:
            RuntimeError: the previous batch was neither completed nor failed.
        """
        if self._in_flight is not None:
            raise RuntimeError("a flush batch is already in flight")
        dirty = self._dirty
        if not dirty:
            return None
        start = self._next_vb
        order = sorted(dirty)
        if start:
            order = [v for v in order if v >= start] + [v for v in order if v < start]
        out: list[VBucketFlush] = []
        n = 0
        vbs = self._vbuckets
        persisted = self._persisted_versions
        for vbid in order:
            if n >= max_items:
                self._next_vb = vbid
                break
            vb = vbs[vbid]
            mgr = vb.checkpoints
            snaps, mark = mgr.peek(mgr.persistence_cursor, max_items - n)
            version = vb.state_version
            if snaps:
                if len(snaps) == 1:
                    items = snaps[0].items
                else:
                    items = [it for s in snaps for it in s.items]
                last = snaps[-1]
                rec = vb.state_record(last.end, last.start, last.end)
            elif version != persisted.get(vbid, 0):
                items = []
                rec = vb.state_record(
                    vb.persisted_seqno, vb.persisted_snap_start, vb.persisted_snap_end
                )
            else:
                dirty.discard(vbid)
                continue
            out.append(VBucketFlush(vbid, items, rec, mark, version))
            n += len(items)
        else:
            self._next_vb = 0
        if not out:
            return None
        batch = FlushBatch(out)
        self._in_flight = batch
        return batch

    def complete(self, batch: FlushBatch) -> dict[int, int]:
        """The batch is durable: advance cursors and persisted seqnos, free checkpoints.

        Returns {vbid: persisted seqno} for the vbuckets whose persisted seqno rose.
        """
        if batch is not self._in_flight:
            raise RuntimeError("complete() of a batch that is not in flight")
        self._in_flight = None
        vbs = self._vbuckets
        dirty = self._dirty
        persisted = self._persisted_versions
        advanced: dict[int, int] = {}
        for vf in batch.vbuckets:
            vb = vbs[vf.vbid]
            version = persisted.get(vf.vbid, 0)
            if vf.state_version > version:
                version = persisted[vf.vbid] = vf.state_version
            if vf.items:
                mgr = vb.checkpoints
                mgr.advance_to(mgr.persistence_cursor, vf.mark)
                vb.persisted_seqno = vf.high_seqno
                vb.persisted_snap_start = vf.snap_start
                vb.persisted_snap_end = vf.snap_end
                advanced[vf.vbid] = vf.high_seqno
            if vb.persisted_seqno >= vb.high_seqno and version == vb.state_version:
                dirty.discard(vf.vbid)
        self._relieve_memory()  # persisted items may now be freeable
        self.batches_written += 1
        self.items_written += batch.num_items
        for fn in self._listeners:
            for vbid, seqno in advanced.items():
                fn(vbid, seqno)
        return advanced

    def failed(self, batch: FlushBatch, exc: BaseException) -> None:
        """The write failed and was rolled back: keep everything queued for a retry."""
        if batch is self._in_flight:
            self._in_flight = None
        self.batches_failed += 1
        self.last_error = exc

    def state_persisted(self, vbid: int, version: int) -> bool:
        """True once the state of ``vbid`` as of its ``state_version`` ``version`` (or a
        later one) is on disk."""
        return self._persisted_versions.get(vbid, 0) >= version

    @property
    def in_flight(self) -> FlushBatch | None:
        return self._in_flight

    def pending_items(self) -> int:
        """Seqnos not yet persisted, summed over vbuckets (an upper bound on items:
        deduplicated seqnos are counted too)."""
        vbs = self._vbuckets
        return sum(vbs[v].high_seqno - vbs[v].persisted_seqno for v in self._dirty)

    def has_pending(self) -> bool:
        """True while some vbucket has items or a state change not yet persisted."""
        return bool(self._dirty)

    def flush_all(self, max_items: int = 20_000) -> int:
        """Collect, write and complete until nothing is pending (blocking; for
        tests, tools and shutdown — the server uses the three steps). Returns items."""
        total = 0
        storage = self._storage
        while (batch := self.collect(max_items)) is not None:
            try:
                storage.write_batch(batch)
            except BaseException as exc:
                self.failed(batch, exc)
                raise
            self.complete(batch)
            total += batch.num_items
        return total
