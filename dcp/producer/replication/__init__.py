"""Replication: this node as a DCP client of the nodes holding the active copies of its
replica vbuckets (Couchbase's intra-cluster replication, one connection per source node).

Rules of this package:
- The server drives it through ``ReplicationManager.reconcile`` (manager.py) with the
  desired ``{vb: Assignment}`` and implements ``ReplicaTarget`` (target.py) over its
  engine; nothing here touches the engine's vbuckets, storage or streams otherwise.
- Layers inside: ``manager`` (assignment -> connections) -> ``source`` (one connection's
  life) -> ``stream_table`` (its streams and the session's events) -> ``replica_stream``
  (one vbucket's snapshot buffer and checks); ``link`` does the connection's I/O.
- Wire work goes through ``dcp.protocol.session.ClientSession``; nothing here imports
  ``dcp.consumer`` (the SDK is a separate product; tests/test_layering.py).
"""

from .manager import ReplicationManager
from .target import Assignment, Position, ReplicaTarget

__all__ = ["Assignment", "Position", "ReplicaTarget", "ReplicationManager"]
