"""``dcp-server`` on a disk that fills up: once the file named by the first argument
exists, every LMDB commit fails with ENOSPC. The rest of the arguments are dcp-server's.

The failure is raised inside the write transaction just before its commit, the same way
the engine's storage tests simulate one (``LmdbStorage.before_commit``, see
tests/engine/test_flusher_storage.py): the transaction aborts and nothing is written.
Every ``grow_map`` call is reported on stderr, so a test can tell that a full disk was
not mistaken for a full map.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lmdb

from dcp.producer import cli
from dcp.producer.engine import storage

trigger = Path(sys.argv.pop(1))
_init = storage.LmdbStorage.__init__
_grow = storage.LmdbStorage.grow_map


def _disk_full(_batch: object) -> None:
    if trigger.exists():
        raise lmdb.DiskError("mdb_txn_commit: No space left on device")


def _init_failing(self: storage.LmdbStorage, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    self.before_commit = _disk_full


def _grow_reported(self: storage.LmdbStorage, new_size: int, *args: Any, **kwargs: Any) -> None:
    print(f"TEST: grow_map({new_size}) called", file=sys.stderr, flush=True)
    _grow(self, new_size, *args, **kwargs)


storage.LmdbStorage.__init__ = _init_failing  # type: ignore[method-assign]
storage.LmdbStorage.grow_map = _grow_reported  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
