"""The reliability harness: ``python -m tools.chaos <scenario>`` (see ``cli.py``) tries hard
to make the change stream lose or invent a change (crash, fuzz, slow, storage), to make
the server spend unbounded memory or stall its neighbours (abuse), and to make a cluster
lose a write acknowledged at a majority level or roll back a stable-only consumer
(failover). See ``tools/README.md``
and ``docs/reliability.md``.
"""
