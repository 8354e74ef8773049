"""ReplicationManager: makes this node's vbuckets follow a desired assignment
``{vb: Assignment(state, source, takeover)}``, streaming replicas from their sources.

Rules of this module:
- One component for every way the assignment is decided (a static ``--replica-of``
  topology now, a cluster map later): they all call ``reconcile`` with the whole desired
  assignment, and this module does the rest.
- ``reconcile`` is synchronous and may be called at any time from the event loop, before
  or while ``run`` runs. For each assigned vbucket whose state differs it calls
  ``target.set_state``; replica and pending vbuckets with a source are streamed from
  it (a vbucket whose source changed moves to the new source's connection); every
  other vbucket, and any vbucket missing from the assignment, is not streamed (its
  stream is closed). States of vbuckets missing from the assignment are left alone.
- One ``SourceConnection`` (source.py) per source node that has vbuckets to stream, run
  as a task of ``run``'s nursery; it is stopped when its last vbucket goes.
- A takeover (``Assignment(replica, source, takeover=True)``) changes the state here
  from the stream itself (pending, then active). From the source's first state message
  on, ``reconcile`` leaves that vbucket's state alone while its assignment is the same;
  once it is active the assignment is satisfied: it is not streamed again until the
  assignment of that vbucket changes.
- Acks (acks.py): connections send SEQNO_ACKNOWLEDGED under ``consumer_name``;
  ``flushed`` is the node's flush listener (one per node, whatever the sources).
- ``stats``/``vbucket_info``/``stat_pairs`` are read-only views for the STAT group
  ``replication`` and metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from ...protocol.opcodes import VBucketState
from .link import OpenStream, SourceAuth, SourceSettings, split_address
from .source import SourceConnection
from .target import Assignment, ReplicaTarget

__all__ = ["ReplicationManager"]

_STREAMED = (VBucketState.REPLICA, VBucketState.PENDING)


class ReplicationManager:
    """See the module rules.

    Args:
        target: the node (``target.py``).
        open_stream: ``await open_stream(host, port)`` -> a trio stream (tests inject
            proxies or fault injectors here).
        backoff_initial, backoff_max: seconds of the jittered exponential backoff of
            reconnects and stream retries.
        connect_timeout: seconds for a connect, and again for the handshake.
        noop_interval: seconds between the source's DCP noops; after this much silence
            the connection is probed, after twice as much it is dropped. None: no noops.
        window: the flow-control buffer asked of the source (bytes; 0: none).
        auth: the user replication connections authenticate as (None: they do not).
        consumer_name: the name this node's acks name it by (DCP_CONTROL
            consumer_name): its cluster node name, as the map's chains name it (not
            ``target.node_name``, its address). None or "": no acks (no cluster: the
            active's chain is itself alone).
    """

    def __init__(
        self,
        target: ReplicaTarget,
        *,
        open_stream: OpenStream = trio.open_tcp_stream,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
        connect_timeout: float = 5.0,
        noop_interval: float | None = 5.0,
        window: int = 16 * 1024 * 1024,
        auth: SourceAuth | None = None,
        consumer_name: str | None = None,
    ) -> None:
        if not 0 < backoff_initial <= backoff_max:
            raise ValueError("need 0 < backoff_initial <= backoff_max")
        self.target = target
        self.settings = SourceSettings(
            open_stream=open_stream,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            connect_timeout=connect_timeout,
            noop_interval=noop_interval,
            window=window,
            auth=auth,
            consumer_name=consumer_name or None,
        )
        self._assignment: dict[int, Assignment] = {}
        #: takeovers whose source already changed the state here, with their assignment
        self._handover: dict[int, Assignment] = {}
        #: takeovers finished (active here), with the assignment they satisfied
        self._done: dict[int, Assignment] = {}
        self._sources: dict[str, SourceConnection] = {}
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the source connections until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                self._sync_tasks()
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def reconcile(self, assignment: Mapping[int, Assignment]) -> None:
        """Make states and streams follow ``assignment`` (see the module rules).

        Raises:
            ValueError: a state that is not a ``VBucketState`` or a source that is not
                ``HOST:PORT`` (checked before anything changes).
        """
        new = {int(vb): _normal(a) for vb, a in assignment.items()}
        # checked once per source, not per vbucket: a node reconciles its whole
        # assignment at each SET_VBUCKET_STATE, and a rebalance sends them by the hundred
        for source in {a.source for a in new.values() if a.source is not None}:
            split_address(source)
        for table in (self._handover, self._done):
            for vb in [vb for vb, a in table.items() if new.get(vb) != a]:
                del table[vb]
        target = self.target
        want: dict[str, dict[int, bool]] = {}
        for vb, a in new.items():
            if vb not in self._handover and target.state(vb) != a.state:
                target.set_state(vb, a.state)
            if a.source and a.state in _STREAMED and vb not in self._done:
                want.setdefault(a.source, {})[vb] = a.takeover
        self._assignment = new
        for source, conn in self._sources.items():
            wanted = want.get(source, {})
            for vb in conn.vbuckets():
                if vb not in wanted:
                    conn.drop(vb)
        for source, vbs in want.items():
            if source not in self._sources:
                self._sources[source] = self._new_connection(source)
            for vb, takeover in vbs.items():
                self._sources[source].want(vb, takeover)
        self._sync_tasks()

    def flushed(self) -> None:
        """The flush listener (``Persistence.add_flush_listener``, registered by the
        server): each connection acks the vbuckets whose persisted seqno moved."""
        for conn in self._sources.values():
            conn.flushed()

    def _new_connection(self, source: str) -> SourceConnection:
        conn: SourceConnection

        def on_state(vb: int, state: VBucketState) -> None:
            a = self._assignment.get(vb)
            if a is not None:
                self._handover[vb] = a
                if state == VBucketState.ACTIVE:
                    self._done[vb] = a

        def on_idle() -> None:
            if self._sources.get(source) is conn:
                self._sync_tasks()

        conn = SourceConnection(
            source, self.target, self.settings, on_state=on_state, on_idle=on_idle
        )
        return conn

    def _sync_tasks(self) -> None:
        """Stop the connections with nothing left to do; start the new ones."""
        for source, conn in list(self._sources.items()):
            if conn.idle():
                del self._sources[source]
                conn.stop()
            elif not conn.started and self._nursery is not None:
                conn.started = True
                self._nursery.start_soon(conn.run)

    # ------------------------------------------------------------------ views

    def assignment(self) -> dict[int, Assignment]:
        return dict(self._assignment)

    def vbucket_info(self, vb: int) -> dict[str, Any] | None:
        """The replication of ``vb``, or None if it is not streamed from a source:
        ``source``, ``connected``, ``stream`` (requested|streaming|backoff|takeover),
        ``high_seqno`` (the replica's), ``source_seqno`` (highest snapshot end the source
        announced so far) and ``lag`` (seqnos behind, >= 0)."""
        a = self._assignment.get(vb)
        conn = self._sources.get(a.source) if a is not None and a.source else None
        state = conn.stream_state(vb) if conn is not None else None
        if conn is None or state is None:
            return None
        high = self.target.position(vb)[0]
        source_seqno = max(conn.source_seqno(vb), high)
        return {
            "source": conn.source,
            "connected": conn.connected,
            "stream": state,
            "high_seqno": high,
            "source_seqno": source_seqno,
            "lag": source_seqno - high,
        }

    def stats(self) -> dict[str, Any]:
        """``{"sources": {addr: {connected, bytes_received, items_applied,
        snapshots_applied, rollbacks, reconnects}}, "vbuckets": {vb: vbucket_info}}``."""
        sources = {
            addr: {"connected": conn.connected, **conn.counters}
            for addr, conn in sorted(self._sources.items())
        }
        vbuckets = {}
        for vb in sorted(self._assignment):
            info = self.vbucket_info(vb)
            if info is not None:
                vbuckets[vb] = info
        return {"sources": sources, "vbuckets": vbuckets}

    def stat_pairs(self) -> list[tuple[str, str]]:
        """The STAT group ``replication`` but its ``vb_<N>:state`` keys (the server has
        every vbucket's state): per streamed vbucket and per source node."""
        s = self.stats()
        out: list[tuple[str, str]] = []
        for vb, info in s["vbuckets"].items():
            for key in ("source", "high_seqno", "source_seqno", "lag", "stream"):
                out.append((f"vb_{vb}:{key}", str(info[key])))
        for addr, c in s["sources"].items():
            for key, value in c.items():
                out.append((f"source:{addr}:{key}", _text(value)))
        return out


def _normal(a: Any) -> Assignment:
    """``a`` as an ``Assignment`` with a ``VBucketState`` (callers may pass plain tuples
    and ints); one that already is one is taken as it is (the common, cheap case)."""
    if type(a) is Assignment and type(a.state) is VBucketState:
        return a
    return Assignment(VBucketState(a[0]), *a[1:])


def _text(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)
