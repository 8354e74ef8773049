"""Disk backfill: one consistent scan of a vbucket's stored items, read in bounded chunks.

Rules of this module:
- One LMDB read transaction per scan, opened in ``__init__`` and held until ``close``:
  the whole scan sees one committed state, so it is ONE logical disk snapshot
  ``(start_seqno, end_seqno]`` where ``end_seqno`` is the persisted high seqno in that
  transaction.
- ``read`` is blocking (run it in a worker thread) and touches only LMDB and this
  object. py-lmdb opens environments with MDB_NOTLS, so a read transaction may move
  between threads as long as two threads never use it at once.
- Always ``close()`` (or use ``with``): an open scan pins old pages in the file and
  blocks map growth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lmdb

from .errors import StorageError
from .item import Item
from .records import VB_KEY, VBStateRecord, decode_item, item_key

if TYPE_CHECKING:
    from .storage import LmdbStorage

__all__ = ["BackfillScan"]


class BackfillScan:
    """Every live item and tombstone of ``vbucket`` with start_seqno < seqno <= end_seqno.

    ``history`` is True when the snapshot holds every version of that range (history
    window on and the range inside it): the marker gets the History flag.
    ``may_contain_duplicates`` is True whenever superseded versions can appear.
    """

    __slots__ = ("_done", "_end_key", "_iter", "_storage", "_txn", "end_seqno", "history",
                 "may_contain_duplicates", "start_seqno", "vbucket")

    def __init__(self, storage: LmdbStorage, vbucket: int, start_seqno: int) -> None:
        self.vbucket = vbucket
        self.start_seqno = start_seqno
        self._txn = None
        self._iter = None
        self._done = True
        self._storage = None
        storage._scan_opened()  # may block while the map is being grown
        self._storage = storage
        try:
            txn = storage.env.begin(buffers=False)
            self._txn = txn
            raw = txn.get(VB_KEY.pack(vbucket), db=storage.state_db)
            rec = VBStateRecord.decode(raw) if raw else None
            self.end_seqno = rec.high_seqno if rec else 0
            hist_on = storage.history_enabled
            self.may_contain_duplicates = hist_on
            self.history = hist_on and rec is not None and start_seqno + 1 >= rec.history_start
            self._end_key = item_key(vbucket, self.end_seqno)
            self._done = start_seqno >= self.end_seqno
            if not self._done:
                cur = txn.cursor(db=storage.item_db(vbucket))
                if cur.set_range(item_key(vbucket, start_seqno + 1)):
                    self._iter = cur.iternext()
                else:
                    self._done = True
        except lmdb.Error as exc:
            self.close()
            raise StorageError(f"cannot open backfill of vb {vbucket}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def read(self, max_items: int) -> list[Item]:
        """Up to ``max_items`` items in seqno order; ``[]`` once the scan is done."""
        if self._done:
            return []
        out: list[Item] = []
        append = out.append
        vb = self.vbucket
        end_key = self._end_key
        try:
            for k, v in self._iter:  # type: ignore[union-attr]
                if k > end_key:
                    self._done = True
                    break
                append(decode_item(vb, v))
                if len(out) >= max_items:
                    break
            else:
                self._done = True
        except lmdb.Error as exc:
            self._done = True
            raise StorageError(f"backfill of vb {vb} failed: {exc}") from exc
        return out

    @property
    def done(self) -> bool:
        return self._done

    def close(self) -> None:
        """Release the read transaction (idempotent)."""
        txn, self._txn = self._txn, None
        self._iter = None
        self._done = True
        if txn is not None:
            try:
                txn.abort()
            except lmdb.Error:  # pragma: no cover - invalidated by a forced close
                pass
        if self._storage is not None:
            self._storage._scan_closed()
            self._storage = None  # type: ignore[assignment]

    def __enter__(self) -> BackfillScan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"BackfillScan(vb={self.vbucket}, {self.start_seqno}..{self.end_seqno}, "
                f"history={self.history}, done={self._done})")
