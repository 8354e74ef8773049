"""The cluster's control plane on etcd (issue #15).

Rules of this package:
- No imports from the server or connection code, except in the two modules that wire the
  package into the node: ``agent.py`` (``ClusterAgent``: membership, the map followed and
  reconciled into the node's vbucket states, the orchestrator while leading) and
  ``serving.py`` (``ClusterSide``: what the server's handlers ask). Every other part
  reaches the node through the small Protocols defined here (``membership.NodeHooks``;
  the store Protocols), so it is tested alone, against a real etcd (tests/etcd/) or a
  fake on trio's MockClock. ``reconcile.py``: the node side's rules, pure.
- ``store.py``: etcd through etcd3gw in ``trio.to_thread`` (``EtcdStore``).
- ``vbmap.py``: the map as a value, its JSON, the bucket config clients route with;
  ``placement.py``: computing a balanced map with few moves (pure).
- ``membership.py``: joining, the lease, fencing; ``election.py``: one orchestrator, and
  the guarded compare-and-swap that is the only way to write the map.
- ``orchestrator.py`` (with ``view.py``, ``rebalance.py``, ``failover.py``,
  ``failover_ops.py``): the decisions of the elected node; ``control.py``: how it
  reaches the nodes (``NodeControl``).
"""
