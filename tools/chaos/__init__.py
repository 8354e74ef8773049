"""The reliability harness: ``python -m tools.chaos <scenario>`` (see ``cli.py``) tries hard
to make the change stream lose or invent a change (crash, fuzz, slow, storage) and to make
the server spend unbounded memory or stall its neighbours (abuse). See ``tools/README.md``
and ``docs/reliability.md``.
"""
