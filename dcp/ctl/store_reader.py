"""A read-only view of a server's data directory (the LMDB environment), for ``inspect``.

Rules of this module:
- Never writes. The environment is opened ``readonly=True`` *with* LMDB's lock file
  (``lock=True``): readers then register in the shared reader table like the server's
  own, so the server's single writer never reuses pages a reader still sees. That makes
  inspecting a running server safe, and every read transaction a consistent snapshot.
  Without locking only when nothing can be writing: there is no ``lock.mdb`` (no
  process ever opened the environment here; we don't create one), or it cannot be
  opened (a read-only copy).
- The layout is the engine's (``dcp/producer/engine/storage.py``, ``records.py``):
  DBs ``meta``, ``vbstate`` and ``seq:%04x`` per vbucket; records are decoded with the
  engine's own ``records`` structs and ``decode_item``.
- Anything that is not a dcp data directory (missing, no ``data.mdb``, not LMDB,
  LMDB without our ``meta`` DB, another format version) is a one-line ``CtlError``.
  So is a ``data.mdb`` shorter than its LMDB meta page says is in use, checked before
  the map is opened (the engine's ``datafiles.read_meta_pages``): reading such a map
  past the end of the file is a SIGBUS, not an error.
- Every view reads inside one transaction (``with store.read() as snap``), so a
  vbucket's state record and its items always come from the same committed state, even
  while the server flushes. A transaction never outlives its ``with`` block.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import lmdb

from ..producer.engine.datafiles import read_meta_pages
from ..producer.engine.item import Item
from ..producer.engine.records import (
    FORMAT_UNCHECKED,
    FORMAT_VERSION,
    ITEM_KEY,
    ITEM_RECORD,
    VB_KEY,
    VBStateRecord,
    decode_item,
)
from .output import CtlError

__all__ = [
    "RECORD_HEAD",
    "DamagedRecord",
    "OfflineStore",
    "RawRecord",
    "Snapshot",
    "decode_state",
    "describe_env",
]

#: Named DBs and meta keys as ``LmdbStorage`` creates them (storage.py keeps them private).
_ITEM_DB = b"seq:%04x"
_META_FORMAT = b"format"
_META_NUM_VBUCKETS = b"num_vbuckets"
_META_CLEAN = b"clean_shutdown"
_MAX_DBS = 1024 + 8
RECORD_HEAD = ITEM_RECORD.size
_unpack = ITEM_RECORD.unpack_from
_unpack_key = ITEM_KEY.unpack


class DamagedRecord(CtlError):
    """A record too short to unpack; ``check`` reports it, other views stop on it."""


class RawRecord(NamedTuple):
    """One stored record, unpacked only as far as its fixed head."""

    key_vb: int  # the vbucket in the LMDB key (-1: key of the wrong size)
    key_seqno: int  # the seqno in the LMDB key
    seqno: int  # the seqno inside the record
    op: int
    cas: int
    rev_seqno: int
    key_len: int  # as the head says (``key`` is cut short if the record is)
    key: bytes
    raw: bytes


class OfflineStore:
    """``with OfflineStore(path) as store, store.read() as snap: snap.items(0, 1, 100)``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CtlError(f"{self.path}: no such directory")
        if not self.path.is_dir():
            raise CtlError(f"{self.path}: not a directory (give the server's --data-dir)")
        data = self.path / "data.mdb"
        if not data.is_file():
            raise CtlError(f"{self.path}: no data.mdb here; not a dcp data directory")
        self.file_size = data.stat().st_size
        if not self.file_size:
            raise CtlError(f"{self.path}: data.mdb is empty; not a dcp data directory")
        try:
            metas = read_meta_pages(data)
        except OSError as exc:
            raise CtlError(f"{self.path}: cannot read data.mdb: {exc.strerror}") from None
        if metas and self.file_size < metas[0].used_bytes:
            raise CtlError(
                f"{self.path}: data.mdb is truncated: {self.file_size} bytes, but "
                f"its LMDB meta page says {metas[0].used_bytes} are in use"
            )
        self.env = self._open()
        try:
            self._read_meta()
        except BaseException:
            self.env.close()
            raise

    def _open(self) -> Any:
        # A map at least as large as the file; the server may still grow it (see _begin).
        kw: dict[str, Any] = dict(
            readonly=True,
            subdir=True,
            max_dbs=_MAX_DBS,
            max_readers=1024,
            map_size=max(self.file_size, 1 << 20),
        )
        # No lock file: no process has this environment open (LMDB creates it on open),
        # so nothing can be writing; don't create one either.
        lock = (self.path / "lock.mdb").exists()
        try:
            return lmdb.open(str(self.path), lock=lock, **kw)
        except lmdb.Error as exc:
            if not lock or "Permission denied" not in str(exc):
                raise CtlError(f"{self.path}: cannot open as LMDB: {_why(exc)}") from None
        try:  # the lock file is not ours to open: a read-only copy nobody writes to
            return lmdb.open(str(self.path), lock=False, **kw)
        except lmdb.Error as exc:
            raise CtlError(f"{self.path}: cannot open as LMDB: {_why(exc)}") from None

    def _open_db(self, name: bytes) -> Any:
        """A named DB handle (py-lmdb opens it in a transaction of its own)."""
        for attempt in range(3):
            try:
                return self.env.open_db(name, create=False)
            except lmdb.MapResizedError:
                if attempt == 2:
                    raise CtlError(f"{self.path}: the store keeps growing; try again") from None
                self.env.set_mapsize(0)  # adopt the size the writer set
            except lmdb.NotFoundError:
                raise
            except lmdb.Error as exc:
                raise CtlError(f"{self.path}: unreadable LMDB environment: {_why(exc)}") from None
        raise AssertionError("unreachable")

    def _read_meta(self) -> None:
        try:
            self.meta_db = self._open_db(b"meta")
            self.state_db = self._open_db(b"vbstate")
        except lmdb.NotFoundError:
            raise CtlError(
                f"{self.path}: an LMDB environment, but not a dcp data "
                "directory (no meta/vbstate databases)"
            ) from None
        with self._begin() as txn:
            fmt = txn.get(_META_FORMAT, db=self.meta_db)
            nvb = txn.get(_META_NUM_VBUCKETS, db=self.meta_db)
            self.clean_shutdown = txn.get(_META_CLEAN, db=self.meta_db) == b"1"
        try:
            self.format_version = int(fmt) if fmt is not None else None
            self.num_vbuckets = int(nvb) if nvb is not None else 0
        except ValueError:
            raise CtlError(
                f"{self.path}: meta database holds format {fmt!r}, num_vbuckets {nvb!r}"
            ) from None
        if self.format_version == FORMAT_UNCHECKED:
            raise CtlError(
                f"{self.path}: format {fmt!r} (records without checksums); start "
                f"the server on it once to migrate it to format {FORMAT_VERSION}"
            )
        if self.format_version != FORMAT_VERSION:
            raise CtlError(
                f"{self.path}: format {fmt!r}; this dcpctl reads format {FORMAT_VERSION}"
            )
        if not 0 < self.num_vbuckets <= 1024:
            raise CtlError(f"{self.path}: meta says {self.num_vbuckets} vbuckets")
        self.item_dbs: list[Any] = []
        for vb in range(self.num_vbuckets):
            try:
                self.item_dbs.append(self._open_db(_ITEM_DB % vb))
            except lmdb.NotFoundError:
                raise CtlError(
                    f"{self.path}: the item database of vbucket {vb} is missing"
                ) from None

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _begin(self) -> Iterator[Any]:
        """A read transaction, released at the end; follows a map the server grew."""
        for attempt in range(3):
            try:
                txn = self.env.begin(buffers=False)
                break
            except lmdb.MapResizedError:
                if attempt == 2:
                    raise CtlError(f"{self.path}: the store keeps growing; try again") from None
                self.env.set_mapsize(0)  # adopt the size the writer set
            except lmdb.Error as exc:
                raise CtlError(f"{self.path}: cannot read: {_why(exc)}") from None
        try:
            yield txn
        except lmdb.Error as exc:
            raise CtlError(f"{self.path}: read failed: {_why(exc)}") from None
        finally:
            txn.abort()

    def check_vbucket(self, vb: int) -> None:
        if not 0 <= vb < self.num_vbuckets:
            raise CtlError(
                f"vbucket {vb} does not exist (this data dir has 0..{self.num_vbuckets - 1})"
            )

    @contextlib.contextmanager
    def read(self) -> Iterator[Snapshot]:
        """One consistent view (one read transaction): states and items agree."""
        with self._begin() as txn:
            yield Snapshot(self, txn)

    def close(self) -> None:
        self.env.close()

    def __enter__(self) -> OfflineStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Snapshot:
    """Reads inside one transaction of an ``OfflineStore`` (use only inside ``read()``)."""

    def __init__(self, store: OfflineStore, txn: Any) -> None:
        self.store = store
        self.txn = txn

    def state_records(self) -> dict[int, bytes]:
        """Raw vbucket state records by vbucket; keys of the wrong size get ids < 0."""
        out: dict[int, bytes] = {}
        for k, v in self.txn.cursor(db=self.store.state_db):
            if len(k) == VB_KEY.size:
                out[VB_KEY.unpack(k)[0]] = v
            else:
                out[-1 - len(out)] = k
        return out

    def state_raw(self, vb: int) -> bytes | None:
        self.store.check_vbucket(vb)
        return self.txn.get(VB_KEY.pack(vb), db=self.store.state_db)

    def state(self, vb: int) -> VBStateRecord | None:
        raw = self.state_raw(vb)
        return None if raw is None else decode_state(vb, raw)

    def seqno_range(self, vb: int) -> tuple[int, int]:
        """Lowest and highest stored seqno (0, 0 when empty)."""
        self.store.check_vbucket(vb)
        cur = self.txn.cursor(db=self.store.item_dbs[vb])
        if not cur.first():
            return 0, 0
        lo = _unpack_key(cur.key())[1]
        cur.last()
        return lo, _unpack_key(cur.key())[1]

    def records(self, vb: int, start: int = 0, end: int | None = None) -> Iterator[RawRecord]:
        """Records with start <= seqno <= end, in LMDB (= seqno) order.

        Raises:
            DamagedRecord: a record too short to hold its head.
        """
        self.store.check_vbucket(vb)
        size = ITEM_KEY.size
        cur = self.txn.cursor(db=self.store.item_dbs[vb])
        if not cur.set_range(ITEM_KEY.pack(vb, start)):
            return
        for k, v in cur:
            kvb, kseq = _unpack_key(k) if len(k) == size else (-1, -1)
            if end is not None and kseq > end:
                break
            if len(v) < RECORD_HEAD:
                raise DamagedRecord(
                    f"vbucket {vb}: record at seqno {kseq} has {len(v)} "
                    f"bytes, shorter than the {RECORD_HEAD}-byte head"
                )
            op, _dt, cas, kl, _dtime, seqno, rev, *_ = _unpack(v)
            yield RawRecord(
                kvb, kseq, seqno, op, cas, rev, kl, v[RECORD_HEAD : RECORD_HEAD + kl], v
            )

    def items(self, vb: int, start: int = 0, end: int | None = None) -> Iterator[Item]:
        """Decoded items with start <= seqno <= end (the engine's ``decode_item``)."""
        for rec in self.records(vb, start, end):
            try:
                item = decode_item(vb, rec.raw)
            except Exception as exc:  # struct.error and friends: a damaged record
                raise DamagedRecord(
                    f"vbucket {vb}: undecodable record at seqno "
                    f"{rec.key_seqno} ({exc}); run `dcpctl inspect DIR "
                    "check`"
                ) from None
            yield item


def decode_state(vb: int, raw: bytes) -> VBStateRecord:
    try:
        return VBStateRecord.decode(raw)
    except Exception as exc:  # ValueError, struct.error
        raise CtlError(f"vbucket {vb}: unreadable state record ({exc})") from None


def _why(exc: BaseException) -> str:
    """py-lmdb's "path: MDB_CODE: message" without the parts we already say."""
    return str(exc).rsplit(": ", 1)[-1]


def describe_env(store: OfflineStore) -> dict[str, Any]:
    return {
        "path": os.fspath(store.path),
        "format": store.format_version,
        "num_vbuckets": store.num_vbuckets,
        "clean_shutdown": store.clean_shutdown,
        "file_bytes": store.file_size,
    }
