"""Errors of the storage layer.

Rules of this module:
- Storage failures are ``TemporaryFailure``s (status ETMPFAIL): the server answers
  ``exc.status`` and the client retries. Nothing already acknowledged as persisted is
  lost when one is raised: the transaction was aborted and the items stay queued.
- ``StorageFullError`` means the LMDB *map* is full (MDB_MAP_FULL): growing the map
  (``LmdbStorage.grow_map``) and retrying can succeed. A full *disk* (ENOSPC) or an I/O
  error (EIO) is a plain ``StorageError`` (``DiskFullError`` for ENOSPC): growing the map
  cannot help there, it only reserves address space the disk does not have.
- Two errors are not temporary and answer EINTERNAL: ``ChecksumError`` (a stored record
  does not match its checksum: retrying reads the same bytes) and ``DataDirError`` (the
  data directory is damaged or missing files; raised only when the store opens, so the
  server refuses to start).
"""

from __future__ import annotations

from ...protocol.errors import StatusError, TemporaryFailure
from ...protocol.opcodes import Status

__all__ = [
    "ChecksumError",
    "DataDirError",
    "DiskFullError",
    "ReplicationError",
    "StorageError",
    "StorageFullError",
]


class StorageError(TemporaryFailure):
    """An LMDB or I/O error; the transaction was aborted cleanly."""

    def __init__(self, message: str = "") -> None:
        super().__init__(Status.ETMPFAIL, message)
        self.detail = message


class StorageFullError(StorageError):
    """The LMDB map is full (MDB_MAP_FULL); a larger map can hold more."""


class DiskFullError(StorageError):
    """The file system is out of space (ENOSPC); a larger map would not help."""


class _PermanentStorageError(StorageError):
    retriable = False

    def __init__(self, message: str = "") -> None:
        StatusError.__init__(self, Status.EINTERNAL, message)
        self.detail = message


class ChecksumError(_PermanentStorageError):
    """A stored record failed its checksum; ``vbucket``, ``key`` and ``seqno`` name it
    (``key`` as stored, which may itself be damaged)."""

    def __init__(self, vbucket: int, seqno: int, key: bytes) -> None:
        self.vbucket = vbucket
        self.seqno = seqno
        self.key = key
        super().__init__(
            f"checksum mismatch in the stored record of vb {vbucket} seqno "
            f"{seqno} key {key[:64]!r}: the data file is damaged there"
        )


class DataDirError(_PermanentStorageError):
    """The data directory cannot be opened safely (damaged, truncated or missing files).
    ``detail`` is a one-line explanation naming the file and the remedy."""


class ReplicationError(ValueError):
    """A snapshot from the source node cannot be applied as it is (out of order, for
    another vbucket, not above what the replica holds...): nothing of it was applied.
    The replication stream that sent it is closed and requested again."""
