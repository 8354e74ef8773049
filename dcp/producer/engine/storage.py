"""LMDB persistence of one bucket: items by (vbucket, seqno), vbucket state, meta.

Rules of this module:
- One LMDB environment per data dir. DBs: ``meta`` (format, clean-shutdown marker),
  ``vbstate`` (one ``VBStateRecord`` per vbucket) and one ``seq:XXXX`` DB per vbucket
  holding (vb, seqno) -> item record. One DB per vbucket keeps every flush an append
  (``cursor.putmulti(append=True)``, measured at 2.4-3.5 M items/s), which a single
  shared DB would only allow for the highest vbucket (docs/engine.md, "LMDB layout").
- Single writer: ``write_batch``, ``write_states`` and ``compact`` take ``_write_lock``;
  the server also runs them from one task. A write begins and ends inside one call
  (one thread), and either commits everything (items, deletions of superseded versions,
  vbucket state) or aborts and raises ``StorageError``/``StorageFullError``.
- Blocking methods touch only LMDB and storage-private state, the ``DiskIndex``
  (disk_index.py: key -> newest seqno on disk per vbucket, needed to delete superseded
  versions, rebuilt at warm-up; the purge seqno / history start compaction raised). It
  changes only after a commit succeeded.
- ``superseded_high[vb]`` bounds the seqnos of superseded versions a history window
  may have left on disk: a flush raises it BEFORE the commit that supersedes them and
  nothing lowers it (warm-up sets it from the records), so a reader that opened its
  transaction after a commit sees a bound at least as high as that commit's. A backfill
  scan for a plain client skips its search for superseded versions when the bound is
  at or below its start (backfill.py): insert-only data pays nothing for the history.
- Compaction's transaction is ``lmdb_compaction.compact_vbucket`` (this module's part,
  split off to keep files small); ``compact`` runs it per vbucket and applies the result
  to the ``DiskIndex``. The policy and the vbuckets' side are compaction.py's.
- ``grow_map`` remaps the file: LMDB requires that no transaction be open, so it waits
  for open backfill scans to close and holds off new ones meanwhile.
- Opening checks the data directory first (``datafiles.check_data_files``: a truncated,
  emptied or missing ``data.mdb`` is refused before LMDB maps it), then the store's
  format in the opening transaction (``store_format.check_format``, which migrates a
  format-1 store), and writes the marker once the store exists.
- Every record served (``get``, backfill scans) is checked against its checksum first;
  a mismatch raises ``ChecksumError`` (and ``get`` logs it), never returns the bytes.
- Errors are told apart (``_wrap``): only MDB_MAP_FULL is ``StorageFullError`` (a larger
  map helps); ENOSPC is ``DiskFullError`` and anything else ``StorageError``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb

from .backfill import BackfillScan
from .datafiles import MARKER, check_data_files, write_marker
from .disk_index import DiskIndex
from .errors import DiskFullError, StorageError, StorageFullError
from .item import Item
from .lmdb_compaction import CompactionPlan, CompactionResult, compact_vbucket
from .lmdb_rollback import rollback_vbucket
from .records import (
    FORMAT_VERSION,
    ITEM_RECORD,
    VB_KEY,
    VBStateRecord,
    checksum_error,
    decode_item,
    encode_item,
    item_key,
    record_intact,
)
from .store_format import check_format

if TYPE_CHECKING:
    from .flusher import FlushBatch

__all__ = ["LmdbStorage"]

log = logging.getLogger("dcp.storage")

_CLEAN = b"clean_shutdown"
_REC_HEAD = ITEM_RECORD.size
_rec_unpack = ITEM_RECORD.unpack_from


def _wrap(exc: lmdb.Error, what: str) -> StorageError:
    """The storage error for an LMDB error: only a full *map* is a ``StorageFullError``
    (growing the map helps); a full disk or an I/O error is not."""
    if isinstance(exc, lmdb.MapFullError):
        return StorageFullError(f"{what}: LMDB map full ({exc}); grow the map and retry")
    if isinstance(exc, lmdb.DiskError) or "No space left" in str(exc):
        return DiskFullError(f"{what}: disk full ({exc})")
    return StorageError(f"{what}: {exc}")


class LmdbStorage:
    """The bucket's LMDB store. See the module rules for threading."""

    def __init__(
        self,
        path: str | Path,
        *,
        num_vbuckets: int,
        map_size: int,
        sync: bool = True,
        history_enabled: bool = False,
    ) -> None:
        self.path = Path(path)
        self.num_vbuckets = num_vbuckets
        self.history_enabled = history_enabled
        #: test hook: called inside write_batch's transaction just before commit.
        self.before_commit: Callable[[Any], None] | None = None
        os.makedirs(self.path, exist_ok=True)
        check_data_files(self.path)  # before LMDB maps data.mdb (module rules)
        marker = (self.path / MARKER).exists()
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=map_size,
                max_dbs=num_vbuckets + 4,
                max_readers=1024,
                sync=sync,
                metasync=sync,
                subdir=True,
            )
        except lmdb.Error as exc:
            raise _wrap(exc, f"cannot open LMDB at {self.path}") from exc
        self._write_lock = threading.Lock()
        self._scans_cond = threading.Condition()
        self._open_scans = 0
        self._growing = False
        self._disk = DiskIndex(num_vbuckets)
        #: per vbucket, >= the seqno of every superseded version on disk (module rules)
        self.superseded_high = [0] * num_vbuckets
        env = self.env
        try:
            with env.begin(write=True) as txn:
                self.meta_db = env.open_db(b"meta", txn=txn)
                self.state_db = env.open_db(b"vbstate", txn=txn)
                self._item_dbs = [
                    env.open_db(b"seq:%04x" % vb, txn=txn) for vb in range(num_vbuckets)
                ]
                fmt = check_format(
                    txn,
                    self.meta_db,
                    self._item_dbs,
                    num_vbuckets=num_vbuckets,
                    path=self.path,
                    marker=marker,
                )
                #: a new store; records given a checksum by the format-1 migration
                self.fresh, self.migrated = fmt.fresh, fmt.migrated
                self.clean_shutdown = txn.get(_CLEAN, db=self.meta_db) == b"1"
            if not marker:
                write_marker(self.path, {"format": FORMAT_VERSION, "num_vbuckets": num_vbuckets})
        except lmdb.Error as exc:
            env.close()
            raise _wrap(exc, "cannot initialise LMDB") from exc
        except OSError as exc:
            env.close()
            raise StorageError(f"cannot write {self.path / MARKER}: {exc}") from exc
        except BaseException:
            env.close()
            raise

    def item_db(self, vb: int) -> Any:
        return self._item_dbs[vb]

    # ------------------------------------------------------------------ warm-up

    def load_states(self) -> dict[int, VBStateRecord]:
        """Every persisted vbucket state record (blocking; warm-up only)."""
        out = {}
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self.state_db):
                vb = VB_KEY.unpack(k)[0]
                rec = VBStateRecord.decode(v)
                out[vb] = rec
                self._disk.load_state(vb, rec)
        return out

    def scan_for_warmup(self, vb: int) -> Iterator[tuple]:
        """Yield (seqno, key, op, rev, cas, flags, expiry, datatype, delete_time) in seqno
        order for every stored record of ``vb``, rebuilding the disk key index as it goes.
        """
        dindex = self._disk.keys[vb]
        dindex.clear()
        high = self.superseded_high
        with self.env.begin() as txn:
            for _k, v in txn.cursor(db=self._item_dbs[vb]):
                op, dt, cas, kl, dtime, seqno, rev, flags, exp, _l, _n, _r = _rec_unpack(v)
                key = v[_REC_HEAD : _REC_HEAD + kl]
                old = dindex.get(key)
                if old is not None and old > high[vb]:  # a superseded version (module rules)
                    high[vb] = old
                dindex[key] = seqno
                yield seqno, key, op, rev, cas, flags, exp, dt, dtime

    def disk_keys(self, vb: int) -> dict[bytes, int]:
        """A copy of ``vb``'s disk key index: key -> seqno of its newest stored version."""
        return dict(self._disk.keys[vb])

    def disk_high_seqno(self, vb: int) -> int:
        """Highest seqno stored for ``vb`` (0 if none)."""
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._item_dbs[vb])
            return _seqno_of_key(cur.key()) if cur.last() else 0

    # ------------------------------------------------------------------ writes

    def write_states(self, records: dict[int, VBStateRecord], *, clean_shutdown: bool) -> None:
        """Write vbucket states and the clean-shutdown marker in one transaction."""
        with self._write_lock:
            try:
                with self.env.begin(write=True) as txn:
                    for vb, rec in records.items():
                        txn.put(
                            VB_KEY.pack(vb), self._disk.merged(vb, rec).encode(), db=self.state_db
                        )
                    txn.put(_CLEAN, b"1" if clean_shutdown else b"0", db=self.meta_db)
            except lmdb.Error as exc:
                raise _wrap(exc, "cannot write vbucket states") from exc

    def write_batch(self, batch: FlushBatch) -> None:
        """Persist a flush batch in ONE transaction (blocking; run it in a worker thread).

        Per vbucket: append the items, delete the versions they supersede (unless the
        history window keeps them), write the vbucket state. Within a batch only the
        newest version of a key is written when history is off.

        Raises:
            StorageFullError: the map is full; nothing was written.
            StorageError: any other LMDB error; nothing was written.
        """
        history = self.history_enabled
        with self._write_lock:
            # per vbucket written: its disk index and {key: newest seqno written}
            updates: list[tuple[dict[bytes, int], dict[bytes, int]]] = []
            try:
                txn = self.env.begin(write=True)
            except lmdb.Error as exc:
                raise _wrap(exc, "cannot begin flush") from exc
            try:
                state_db = self.state_db
                item_dbs = self._item_dbs
                disk_index = self._disk.keys
                merged = self._disk.merged
                put = txn.put
                for vf in batch.vbuckets:
                    vb = vf.vbid
                    items = vf.items
                    if items:
                        db = item_dbs[vb]
                        # items are in seqno order: the last one of a key wins
                        newest = {it.key: it.seqno for it in items}
                        if len(newest) != len(items) and not history:
                            items = [it for it in items if newest[it.key] == it.seqno]
                        pairs = [(item_key(vb, it.seqno), encode_item(it)) for it in items]
                        _, added = txn.cursor(db=db).putmulti(pairs, append=True)
                        if added != len(pairs):
                            raise StorageError(f"vb {vb}: items not above the stored seqnos")
                        dindex = disk_index[vb]
                        if not history and dindex:
                            # the stored versions these items supersede (seqnos are >= 1)
                            for old in list(filter(None, map(dindex.get, newest))):
                                txn.delete(item_key(vb, old), db=db)
                        elif history:  # raised before the commit (module rules)
                            self._note_superseded(vb, items, newest, dindex)
                        updates.append((dindex, newest))
                    put(VB_KEY.pack(vb), merged(vb, vf.state).encode(), db=state_db)
                if self.before_commit is not None:
                    self.before_commit(batch)
                txn.commit()
            except lmdb.Error as exc:
                txn.abort()
                raise _wrap(exc, "flush aborted") from exc
            except BaseException:
                txn.abort()
                raise
            for dindex, newest in updates:
                dindex.update(newest)

    def _note_superseded(
        self, vb: int, items: list[Item], newest: dict[bytes, int], dindex: dict[bytes, int]
    ) -> None:
        """Raise ``superseded_high[vb]`` to the newest version ``items`` supersede: stored
        ones (the disk index) and, when a key repeats in the batch, its earlier ones."""
        high = max(filter(None, map(dindex.get, newest)), default=0) if dindex else 0
        if len(newest) != len(items):
            high = max(high, max(it.seqno for it in items if newest[it.key] != it.seqno))
        if high > self.superseded_high[vb]:
            self.superseded_high[vb] = high

    # ------------------------------------------------------------------ reads

    def get(self, vb: int, seqno: int) -> Item | None:
        """Point read of the item stored at (vb, seqno); None if absent.

        Raises:
            ChecksumError: the stored record is damaged (logged here: the caller only
                answers a status).
        """
        with self._scans_cond:  # never during a remap
            try:
                with self.env.begin() as txn:
                    raw = txn.get(item_key(vb, seqno), db=self._item_dbs[vb])
            except lmdb.Error as exc:
                raise _wrap(exc, f"read of vb {vb} seqno {seqno} failed") from exc
        if raw is None:
            return None
        if not record_intact(raw):
            damaged = checksum_error(vb, seqno, raw)
            log.error(
                "%s (dcpctl inspect DATA_DIR check lists every damaged record)", damaged.detail
            )
            raise damaged
        return decode_item(vb, raw)

    def open_backfill(
        self, vb: int, start_seqno: int, *, every_version: bool = True
    ) -> BackfillScan:
        """A consistent scan of everything stored for ``vb`` after ``start_seqno``;
        ``every_version=False`` leaves out the superseded versions a history window keeps
        (each key once, as without history: backfill.py's module rules)."""
        if not 0 <= vb < self.num_vbuckets:
            raise ValueError(f"vbucket {vb} out of range")
        return BackfillScan(self, vb, start_seqno, every_version=every_version)

    def scan_opened(self) -> None:
        """A backfill scan is about to open its read transaction: wait while the map is
        being grown (LMDB needs no open transaction then), count it as open."""
        with self._scans_cond:
            while self._growing:
                self._scans_cond.wait()
            if self.env is None:
                raise StorageError("storage is closed")
            self._open_scans += 1

    def scan_closed(self) -> None:
        """A scan closed its read transaction (``grow_map`` may be waiting for it)."""
        with self._scans_cond:
            self._open_scans -= 1
            self._scans_cond.notify_all()

    @property
    def open_scans(self) -> int:
        return self._open_scans

    # ------------------------------------------------------------------ maintenance

    def compact(self, plan: CompactionPlan) -> CompactionResult:
        """Purge old tombstones and prune history (blocking; worker thread): one write
        transaction per vbucket (``lmdb_compaction.compact_vbucket``), after whose commit
        the disk index, purge seqno and history start follow the disk.

        Raises:
            StorageFullError, DiskFullError, StorageError: that vbucket's transaction was
                aborted (the vbuckets before it stay compacted).
        """
        disk = self._disk
        out = []
        with self._write_lock:
            for vb in plan.vbuckets:
                try:
                    with self.env.begin(write=True) as txn:
                        vc = compact_vbucket(
                            txn,
                            vb,
                            item_db=self._item_dbs[vb],
                            state_db=self.state_db,
                            disk_index=disk.keys[vb],
                            purge_seqno=disk.purge_seqno[vb],
                            history_start=disk.history_start[vb],
                            history=self.history_enabled,
                            plan=plan,
                        )
                except lmdb.Error as exc:
                    raise _wrap(exc, f"compaction of vb {vb} aborted") from exc
                disk.compacted(vc)  # committed: the bookkeeping follows the disk
                out.append(vc)
        return CompactionResult(out)

    def rollback(self, vb: int, seqno: int, state: VBStateRecord) -> int:
        """Roll ``vb`` back to ``seqno`` on disk (blocking; worker thread), or reset it
        to empty when that cannot be exact (lmdb_rollback.py). ``state`` is the state
        record to store (its seqnos and failover log are adjusted to the point reached);
        the disk key index is rebuilt. Returns the seqno reached (``seqno`` or 0).

        Raises:
            StorageFullError, DiskFullError, StorageError: nothing was changed.
        """
        disk = self._disk
        with self._write_lock:
            try:
                with self.env.begin(write=True) as txn:
                    reached = rollback_vbucket(
                        txn, vb, self._item_dbs[vb], seqno, disk.purge_seqno[vb]
                    )
                    rec = state.copy()
                    rec.high_seqno = rec.snap_start = rec.snap_end = reached
                    if reached == 0:
                        rec.purge_seqno = rec.history_start = 0
                    # as FailoverTable.prune_above: entries above the point go
                    rec.failover = [e for e in rec.failover if e[1] <= reached] or [
                        rec.failover[-1]
                    ]
                    txn.put(VB_KEY.pack(vb), rec.encode(), db=self.state_db)
            except lmdb.Error as exc:
                raise _wrap(exc, f"rollback of vb {vb} aborted") from exc
            if reached == 0:
                disk.purge_seqno[vb] = disk.history_start[vb] = 0
        return reached

    @property
    def map_size(self) -> int:
        return self.env.info()["map_size"]

    def grow_map(self, new_size: int, timeout: float | None = 30.0) -> None:
        """Grow the LMDB map to ``new_size`` bytes (blocking).

        Waits (up to ``timeout`` s) for open backfill scans to close; new scans wait
        meanwhile. Never runs concurrently with a write (it takes the write lock).

        Raises:
            StorageError: scans still open after ``timeout``, or LMDB refused.
        """
        with self._write_lock, self._scans_cond:
            self._growing = True
            try:
                if not self._scans_cond.wait_for(lambda: self._open_scans == 0, timeout):
                    raise StorageError(
                        f"{self._open_scans} backfill scans still open; map not grown"
                    )
                if new_size > self.map_size:
                    self.env.set_mapsize(new_size)
            except lmdb.Error as exc:
                raise _wrap(exc, "cannot grow the map") from exc
            finally:
                self._growing = False
                self._scans_cond.notify_all()

    def stats(self) -> dict[str, int]:
        info = self.env.info()
        stat = self.env.stat()
        return {
            "map_size": info["map_size"],
            "last_pgno": info["last_pgno"],
            "page_size": stat["psize"],
            "used_bytes": (info["last_pgno"] + 1) * stat["psize"],
            "open_scans": self._open_scans,
            "num_readers": info["num_readers"],
        }

    def close(self) -> None:
        """Close the environment (idempotent). Open scans are invalidated."""
        env = self.env
        if env is not None:
            with self._write_lock:
                env.close()
            self.env = None  # type: ignore[assignment]


def _seqno_of_key(key: bytes) -> int:
    return int.from_bytes(key[2:10], "big")
