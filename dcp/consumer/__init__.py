"""The Python consumer SDK: whole snapshots, explicit commits, explicit rollbacks.

An application sees only whole snapshots (``SnapshotBatch``), can stop and restart
anywhere without losing or repeating a committed change, and is told through a
``RollbackEvent`` (or ``RollbackError``) whenever the server's history diverged.
See ``docs/sdk.md``. Imports ``dcp.protocol`` and trio only.
"""

from .batches import (
    Deletion,
    Expiration,
    Mutation,
    RollbackEvent,
    SnapshotBatch,
    SnapshotMarker,
    StreamEnd,
)
from .blocking import BlockingDcpClient, BlockingKvClient
from .client import DcpClient
from .errors import (
    AccessDenied,
    AuthenticationError,
    BatchWriteError,
    ClientClosedError,
    ConnectionLostError,
    DcpClientError,
    DeadConnectionError,
    DurabilityImpossibleError,
    InvalidOffsetError,
    KeyExists,
    KeyNotFound,
    NoNodeAnsweredError,
    NotStored,
    RetryTimeoutError,
    RollbackError,
    StatusError,
    StreamError,
    SyncWriteAmbiguous,
    TlsError,
    TransientError,
    UsageError,
)
from .kv import KvClient
from .kv_results import GetResult, MutationResult
from .offset import Offset, StartFrom
from .offset_store import FileOffsetStore, MemoryOffsetStore, OffsetStore
from .rollback import RollbackPolicy

__all__ = [
    "AccessDenied",
    "AuthenticationError",
    "BatchWriteError",
    "BlockingDcpClient",
    "BlockingKvClient",
    "ClientClosedError",
    "ConnectionLostError",
    "DcpClient",
    "DcpClientError",
    "DeadConnectionError",
    "Deletion",
    "DurabilityImpossibleError",
    "Expiration",
    "FileOffsetStore",
    "GetResult",
    "InvalidOffsetError",
    "KeyExists",
    "KeyNotFound",
    "KvClient",
    "MemoryOffsetStore",
    "Mutation",
    "MutationResult",
    "NoNodeAnsweredError",
    "NotStored",
    "Offset",
    "OffsetStore",
    "RetryTimeoutError",
    "RollbackError",
    "RollbackEvent",
    "RollbackPolicy",
    "SnapshotBatch",
    "SnapshotMarker",
    "StartFrom",
    "StatusError",
    "StreamEnd",
    "StreamError",
    "SyncWriteAmbiguous",
    "TlsError",
    "TransientError",
    "UsageError",
]
