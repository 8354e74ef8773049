"""The data directory's files, checked before LMDB maps them.

Rules of this module:
- LMDB maps ``data.mdb`` and trusts it: a file shorter than what its meta page says is
  in use makes the first read past the end a SIGBUS, and a missing or empty file is
  silently initialised as a new, empty store. So ``check_data_files`` runs before every
  open and reads only the two meta pages at the start of the file, with plain ``read``
  (never a map), comparing the newest meta page's last used page with the file's size.
- The marker file (``MARKER``) is written beside the LMDB files once the store exists
  (``write_marker``); from then on a missing, empty or never-written ``data.mdb`` means
  data was lost, and the open is refused with a ``DataDirError`` instead of starting
  empty. Stores written before the marker existed get it at their next open; until then
  LMDB's ``lock.mdb`` is the evidence: LMDB writes the meta pages of ``data.mdb`` when
  it creates ``lock.mdb``, so a lock file beside a missing or empty data file means the
  data file was lost too.
- Every refusal is one line naming the file and the remedy. ``set_aside_damaged`` (the
  server's ``--reset-data``) acts only on a directory that fails these checks, and
  renames the damaged file rather than deleting it.
- Blocking file I/O only; no LMDB, no threads.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from .errors import DataDirError

__all__ = [
    "DATA_FILE",
    "MARKER",
    "MetaPage",
    "check_data_files",
    "read_meta_pages",
    "set_aside_damaged",
    "write_marker",
]

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
#: written beside the LMDB files once the store holds a bucket
MARKER = "dcp-store.json"

# LMDB's file layout (its data file format version 1): pages 0 and 1 are meta pages;
# each starts with a 16-byte page header, then MDB_meta: magic, version, map address,
# map size, two MDB_db records (free pages, main DB) of 48 bytes, last used page number,
# transaction id. The free DB's first field (md_pad) holds the page size. Native order
# (this engine only runs on little-endian hosts with 64-bit LMDB).
_PAGE_HEADER = 16
_META = struct.Struct("<IIQQ48s48sQQ")
_DB_PAD = struct.Struct("<I")
_DB_ENTRIES = struct.Struct("<32xQ")  # md_entries of an MDB_db
_MAGIC = 0xBEEFC0DE
_MIN_PAGE, _MAX_PAGE = 512, 65536


class MetaPage:
    """One LMDB meta page as found in ``data.mdb``."""

    __slots__ = ("last_pgno", "main_entries", "map_size", "page_size", "txnid")

    def __init__(
        self, page_size: int, map_size: int, last_pgno: int, txnid: int, main_entries: int
    ) -> None:
        self.page_size = page_size
        self.map_size = map_size
        self.last_pgno = last_pgno
        self.txnid = txnid
        self.main_entries = main_entries

    @property
    def used_bytes(self) -> int:
        """Bytes of ``data.mdb`` this meta page says are in use."""
        return (self.last_pgno + 1) * self.page_size


def _meta_at(buf: bytes, offset: int) -> MetaPage | None:
    if len(buf) < offset + _PAGE_HEADER + _META.size:
        return None
    magic, version, _addr, mapsize, free_db, main_db, last, txnid = _META.unpack_from(
        buf, offset + _PAGE_HEADER
    )
    psize = _DB_PAD.unpack_from(free_db)[0]
    if (
        magic != _MAGIC
        or version != 1
        or not _MIN_PAGE <= psize <= _MAX_PAGE
        or psize & (psize - 1)
    ):
        return None
    return MetaPage(psize, mapsize, last, txnid, _DB_ENTRIES.unpack_from(main_db)[0])


def read_meta_pages(path: Path) -> list[MetaPage]:
    """The valid meta pages of the LMDB data file ``path``, newest first ([] if none)."""
    with open(path, "rb") as f:
        head = f.read(_PAGE_HEADER + _META.size)
        first = _meta_at(head, 0)
        metas = [first] if first else []
        # the second meta page sits one page in; the first tells the page size (else try
        # the common ones: a damaged first page must not hide an intact second one)
        for psize in (
            [first.page_size] if first else [4096, 8192, 16384, 65536, 512, 1024, 2048, 32768]
        ):
            f.seek(psize)
            second = _meta_at(f.read(_PAGE_HEADER + _META.size), 0)
            if second is not None and second.page_size == psize:
                metas.append(second)
                break
    metas.sort(key=lambda m: m.txnid, reverse=True)
    return metas


def _remedy(path: Path) -> str:
    return (
        f"restore {path.name} from a backup, or start with --reset-data to set it aside "
        "and begin with an empty store"
    )


def check_data_files(data_dir: str | Path) -> None:
    """Refuse (``DataDirError``) a data directory LMDB must not open; see the module rules.

    A directory without a data file and without a marker is a new store: accepted.
    """
    d = Path(data_dir).resolve()
    data = d / DATA_FILE
    marker_exists = (d / MARKER).exists()
    if marker_exists:
        evidence = f"{d / MARKER} says this directory holds a bucket"
    else:
        evidence = f"{d / LOCK_FILE} shows an LMDB environment was created here"
    lost = marker_exists or (d / LOCK_FILE).exists()
    try:
        size = data.stat().st_size
    except FileNotFoundError:
        if lost:
            raise DataDirError(f"{data} is missing, but {evidence}; {_remedy(data)}") from None
        return
    except OSError as exc:
        raise DataDirError(f"cannot stat {data}: {exc.strerror}") from None
    if size == 0:
        if lost:
            raise DataDirError(f"{data} is empty (0 bytes), but {evidence}; {_remedy(data)}")
        return
    try:
        metas = read_meta_pages(data)
    except OSError as exc:
        raise DataDirError(f"cannot read {data}: {exc.strerror}") from None
    if not metas:
        raise DataDirError(
            f"{data} ({size} bytes) has no valid LMDB meta page: not an LMDB "
            f"data file, or its first pages are damaged; {_remedy(data)}"
        )
    newest = metas[0]
    if size < newest.used_bytes:
        raise DataDirError(
            f"{data} is truncated: {size} bytes, but its LMDB meta page (transaction "
            f"{newest.txnid}) says {newest.used_bytes} bytes are in use; {_remedy(data)}"
        )
    if marker_exists and newest.main_entries == 0:
        raise DataDirError(
            f"{data} holds an empty LMDB environment, but {d / MARKER} says "
            f"this directory holds a bucket; {_remedy(data)}"
        )


def write_marker(data_dir: str | Path, fields: dict[str, object]) -> None:
    """Write the marker durably (temp file, fsync, rename, fsync of the directory)."""
    d = Path(data_dir)
    tmp = d / (MARKER + ".tmp")
    body = (
        json.dumps(
            {
                "what": "dcp data directory: data.mdb holds a bucket; do not start "
                "this store empty without --reset-data",
                **fields,
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / MARKER)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_aside_damaged(data_dir: str | Path) -> list[str]:
    """``--reset-data``: if the directory fails ``check_data_files``, rename the data file
    to ``data.mdb.damaged[.N]`` and remove the lock file and the marker, so the next open
    starts an empty store. Returns one line per action ([] for an intact directory,
    which is left alone: the flag never discards a healthy store)."""
    d = Path(data_dir).resolve()
    try:
        check_data_files(d)
    except DataDirError as exc:
        done = [f"--reset-data: {exc.detail}"]
    else:
        return []
    data = d / DATA_FILE
    if data.exists():
        aside = d / (DATA_FILE + ".damaged")
        n = 1
        while aside.exists():
            aside = d / f"{DATA_FILE}.damaged.{n}"
            n += 1
        os.replace(data, aside)
        done.append(f"--reset-data: moved {data} to {aside} (delete it once it is not needed)")
    for name in (LOCK_FILE, MARKER):
        p = d / name
        if p.exists():
            p.unlink()
            done.append(f"--reset-data: removed {p}")
    return done
