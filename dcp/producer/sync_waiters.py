"""The server's durability wiring: its ``DurabilityMonitor`` and the connections whose
durable writes wait on each vbucket.

Rules of this module:
- ``start_durability`` builds the server's monitor (durability.py) once the bucket is
  open, names it as the cluster map names this node (a single node is ``self``), tells
  it of every flush, counts acks only while the cluster write gate is open, and has it
  wake the waiting connections when a seqno it tracks moves.
- ``SyncWaiters`` indexes the connections with a durable write waiting by the vbucket
  the write is on (a connection registers each vbucket it waits on, connection.py). A
  move of one vbucket's majority wakes only the connections waiting on it; a flush
  (``None``: persisted seqnos of any vbucket may have moved) wakes them all. Waking a
  connection is only setting its writer's event: the writer re-checks what it waits for
  (sync_writes.py ``settle``), so a spurious wake costs one check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import trio

from .durability import DurabilityMonitor

if TYPE_CHECKING:
    from .server import DcpServer

__all__ = ["SyncWaiters", "start_durability"]


class _Wakeable(Protocol):
    def wake(self) -> None: ...


class SyncWaiters:
    """Connections with durable writes waiting, by vbucket (see the module rules)."""

    __slots__ = ("_by_vb",)

    def __init__(self) -> None:
        self._by_vb: dict[int, set[_Wakeable]] = {}

    def add(self, conn: _Wakeable, vb: int) -> None:
        """``conn`` has a durable write of ``vb`` waiting."""
        self._by_vb.setdefault(vb, set()).add(conn)

    def discard(self, conn: _Wakeable, vbs: Iterable[int]) -> None:
        """``conn`` no longer waits on ``vbs``."""
        for vb in vbs:
            waiting = self._by_vb.get(vb)
            if waiting is not None:
                waiting.discard(conn)
                if not waiting:
                    del self._by_vb[vb]

    def of(self, vb: int) -> set[_Wakeable]:
        """The connections waiting on ``vb`` (tests, stats)."""
        return set(self._by_vb.get(vb, ()))

    def __len__(self) -> int:
        """How many connections wait on anything."""
        return len(set().union(*self._by_vb.values())) if self._by_vb else 0

    def wake(self, vbs: Sequence[int] | None) -> None:
        """Wake the connections waiting on ``vbs`` (None: all of them)."""
        by_vb = self._by_vb
        if vbs is None:
            groups: Iterable[set[_Wakeable]] = list(by_vb.values())
        else:
            groups = [by_vb[vb] for vb in vbs if vb in by_vb]
        for waiting in groups:
            for conn in waiting:
                conn.wake()


def start_durability(server: DcpServer) -> DurabilityMonitor:
    """The server's monitor over its open bucket, wired (see the module rules)."""
    monitor = DurabilityMonitor.of_vbuckets(server.config.node_name or "self", server.vbuckets)
    monitor.on_change = server.sync_waiters.wake
    monitor.call_soon = trio.lowlevel.current_trio_token().run_sync_soon
    # acks count only while the cluster lease is sure (durability.py: failover reads)
    monitor.trusted = lambda: server.write_gate is None or server.write_gate()
    server.persistence.add_flush_listener(monitor.flushed)
    return monitor
