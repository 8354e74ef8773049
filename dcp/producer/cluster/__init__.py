"""The cluster's control plane on etcd (issue #15): standalone parts, not yet wired into
the server.

Rules of this package:
- No imports from the server or connection code: the node is reached through the small
  Protocols defined here (``membership.NodeHooks``; the store Protocols), so every part is
  tested alone, against a real etcd (tests/etcd/) or a fake on trio's MockClock.
- ``store.py``: etcd through etcd3gw in ``trio.to_thread`` (``EtcdStore``).
- ``vbmap.py``: the map as a value, its JSON, the bucket config clients route with;
  ``placement.py``: computing a balanced map with few moves (pure).
- ``membership.py``: joining, the lease, fencing; ``election.py``: one orchestrator, and
  the guarded compare-and-swap that is the only way to write the map.
"""
