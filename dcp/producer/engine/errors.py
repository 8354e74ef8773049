"""Errors of the storage layer.

Rules of this module:
- Storage failures are ``TemporaryFailure``s (status ETMPFAIL): the server answers
  ``exc.status`` and the client retries. Nothing already acknowledged as persisted is
  lost when one is raised: the transaction was aborted and the items stay queued.
- ``StorageFullError`` means the LMDB map (or the disk) is full; growing the map
  (``LmdbStorage.grow_map``) and retrying can succeed.
"""

from __future__ import annotations

from ...protocol.errors import TemporaryFailure
from ...protocol.opcodes import Status

__all__ = ["StorageError", "StorageFullError"]


class StorageError(TemporaryFailure):
    """An LMDB or I/O error; the transaction was aborted cleanly."""

    def __init__(self, message: str = "") -> None:
        super().__init__(Status.ETMPFAIL, message)


class StorageFullError(StorageError):
    """The LMDB map is full (MDB_MAP_FULL) or the disk is out of space."""
