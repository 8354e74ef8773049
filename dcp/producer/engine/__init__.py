"""The storage/replication engine of the DCP producer.

Synchronous and deterministic (clock and uuid source are injected; no trio, socket or
time imports): vbuckets with seqnos and failover logs, checkpoints with deduplication
and named cursors, the stream-request decision, and LMDB persistence (flusher, disk
backfill, compaction, warm-up). See ``docs/engine.md``.

Module map::

    config.py             EngineConfig
    item.py               Item, ItemOp, MutationResult, GetResult
    failover.py           FailoverTable
    stream_decision.py    decide_stream_request -> StreamDecision (pure, protocol_spec/README.md §8)
    checkpoint.py         Checkpoint (+ wire log), Cursor (a position), Snapshot,
                          CursorRegistration
    checkpoint_list.py    CheckpointList (queue, compaction, freeing), CheckpointMemory
    checkpoint_manager.py CheckpointManager (cursors: place, read, move, drop)
    vbucket.py            VBucket (KV operations, key index, expiry)
    bucket.py             Bucket (facade, memory pressure / cursor dropping)
    flusher.py            Flusher, FlushBatch (collect -> write_batch -> complete)
    storage.py            LmdbStorage;  backfill.py  BackfillScan
      disk_index.py       DiskIndex (storage's key -> newest stored seqno, purge seqnos)
      lmdb_compaction.py  compaction's write transaction, CompactionPlan/Result
      store_format.py     the store's format checked (and migrated) at open
    compaction.py         Compactor (the policy of a run; the vbuckets' side)
    warmup.py             warm_up(storage, config) -> Warmup, which Bucket starts from;
                          failover entries after an unclean shutdown
    records.py            on-disk layouts;  errors.py  StorageError, StorageFullError...
    datafiles.py          data directory checks before LMDB maps the file; the marker
"""

from .backfill import BackfillScan
from .bucket import Bucket
from .checkpoint import Checkpoint, Cursor, CursorRegistration, Snapshot
from .checkpoint_manager import PERSISTENCE_CURSOR, CheckpointManager, CheckpointMemory
from .compaction import CompactionPlan, CompactionResult, Compactor
from .config import EngineConfig
from .errors import (
    ChecksumError,
    DataDirError,
    DiskFullError,
    StorageError,
    StorageFullError,
)
from .failover import FailoverTable
from .flusher import FlushBatch, Flusher, VBucketFlush
from .item import GetResult, Item, ItemOp, MutationResult
from .records import VBStateRecord
from .storage import LmdbStorage
from .stream_decision import DecisionKind, StreamDecision, decide_stream_request, needs_rollback
from .vbucket import StoreMode, VBucket

__all__ = [
    "PERSISTENCE_CURSOR",
    "BackfillScan",
    "Bucket",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointMemory",
    "ChecksumError",
    "CompactionPlan",
    "CompactionResult",
    "Compactor",
    "Cursor",
    "CursorRegistration",
    "DataDirError",
    "DecisionKind",
    "DiskFullError",
    "EngineConfig",
    "FailoverTable",
    "FlushBatch",
    "Flusher",
    "GetResult",
    "Item",
    "ItemOp",
    "LmdbStorage",
    "MutationResult",
    "Snapshot",
    "StorageError",
    "StorageFullError",
    "StoreMode",
    "StreamDecision",
    "VBStateRecord",
    "VBucket",
    "VBucketFlush",
    "decide_stream_request",
    "needs_rollback",
]
