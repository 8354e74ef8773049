"""Old home of the SDK's value types, kept only as an import path.

Rules of this module:
- Nothing in ``dcp`` imports it. The types live in ``batches.py`` (what ``DcpClient``
  delivers), ``offset.py`` (``Offset``, ``StartFrom``) and ``kv_results.py`` (what
  ``KvClient`` returns); applications import them from ``dcp.consumer``. This module
  re-exports them for code outside the package that still names it
  (``tests/producer/test_ingest_batch.py``) and goes away once that code moves.
"""

from .batches import (
    Deletion,
    Event,
    Expiration,
    Mutation,
    RollbackEvent,
    SnapshotBatch,
    SnapshotMarker,
    StreamEnd,
)
from .kv_results import GetResult, MutationResult
from .offset import Offset, StartFrom

__all__ = ["Deletion", "Event", "Expiration", "GetResult", "Mutation", "MutationResult",
           "Offset", "RollbackEvent", "SnapshotBatch", "SnapshotMarker", "StartFrom",
           "StreamEnd"]
