"""The format of a store, checked in the transaction that opens it (owned by storage.py).

Rules of this module:
- The ``meta`` DB names the record format (``records.FORMAT_VERSION``) and the number
  of vbuckets. A new store gets both; a store of another format or vbucket count is
  refused (``StorageError``: nothing is changed); a format-1 store (records without
  checksum) is migrated: every record gets its trailer, then the format becomes 2, all
  in the caller's opening transaction, so a crash midway leaves it in format 1.
- A store without a format whose data directory has the marker file (datafiles.py)
  lost its data: ``DataDirError``, never a silently empty bucket.
- Called by ``LmdbStorage.__init__`` only, inside its write transaction; LMDB errors
  propagate for the caller to wrap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .datafiles import MARKER
from .errors import DataDirError, StorageError
from .records import FORMAT_UNCHECKED, FORMAT_VERSION, add_checksum

__all__ = ["StoreFormat", "check_format"]


class StoreFormat:
    """What opening found: ``fresh`` (a new store), ``migrated`` (records given a
    checksum by the format-1 migration)."""

    __slots__ = ("fresh", "migrated")

    def __init__(self, fresh: bool, migrated: int) -> None:
        self.fresh = fresh
        self.migrated = migrated


def check_format(
    txn: Any, meta_db: Any, item_dbs: list[Any], *, num_vbuckets: int, path: Path, marker: bool
) -> StoreFormat:
    """Check (or write, or migrate) the store's format inside ``txn`` (module rules).

    Raises:
        DataDirError: no format, but ``marker`` says the store existed.
        StorageError: another format or vbucket count.
    """
    fmt = txn.get(b"format", db=meta_db)
    nvb = txn.get(b"num_vbuckets", db=meta_db)
    if fmt is None:
        if marker:
            where = path.resolve()
            raise DataDirError(
                f"{where / 'data.mdb'} holds no bucket, but {where / MARKER} "
                "says it did; restore it from a backup, or start with "
                "--reset-data"
            )
        txn.put(b"format", b"%d" % FORMAT_VERSION, db=meta_db)
        txn.put(b"num_vbuckets", b"%d" % num_vbuckets, db=meta_db)
        return StoreFormat(True, 0)
    if int(fmt) not in (FORMAT_VERSION, FORMAT_UNCHECKED) or int(nvb or 0) != num_vbuckets:
        raise StorageError(
            f"{path} holds format {fmt!r} with {nvb!r} vbuckets; this "
            f"engine needs {FORMAT_VERSION} / {num_vbuckets}"
        )
    migrated = 0
    if int(fmt) == FORMAT_UNCHECKED:
        migrated = _add_checksums(txn, item_dbs)
        txn.put(b"format", b"%d" % FORMAT_VERSION, db=meta_db)
    return StoreFormat(False, migrated)


def _add_checksums(txn: Any, item_dbs: list[Any]) -> int:
    """Format 1 -> 2: append the checksum trailer to every record. Returns records."""
    n = 0
    for db in item_dbs:
        cur = txn.cursor(db=db)
        more = cur.first()
        while more:
            cur.put(cur.key(), add_checksum(cur.value()))  # the cursor stays there
            n += 1
            more = cur.next()
    return n
