"""VBucketStates: this node's vbucket states and where its replicas are fed from.

Rules of this module:
- ``VBucketStates`` keeps the node's desired assignment ``{vb: Assignment(state, source,
  takeover)}`` and hands all of it to the replication manager's ``reconcile`` after
  every change; the engine's vbucket state is the truth for what the node does now.
  Every way of changing states goes through here: SET_VBUCKET_STATE (``set``), the
  static topology (``--replica-of``: every vbucket a replica of one node), the cluster
  map (``assign``: a whole batch, one reconcile; cluster/agent.py), and the
  replication manager itself (``ReplicaTarget.set_state`` during a takeover).
- It is also the engine-backed ``ReplicaTarget`` (replication/target.py): snapshots go
  into the vbucket, then its streams and the flusher are woken; a real state change
  ends the vbucket's producer streams with STREAM_END state-changed; a rollback runs
  under the storage lock (``Persistence.rollback``) and ends them with Rollback.
- The sources of replica vbuckets are remembered in ``replication.json`` in the data
  directory (written by the ``run`` task, at most every 0.2 s, atomically), so a
  replica keeps following its source after a restart; ``--replica-of`` overrides it.
- Every state change is told to the durability monitor (``server.durability.
  state_changed``): a vbucket that left active drops its replicas' acks and starts a new
  term, so the durable writes waiting on it are answered ambiguous at once. A takeover
  changes the engine state itself and then records it through ``set``, which tells it too.
- Options of SET_VBUCKET_STATE are our extension (protocol_spec/README.md): ``source``
  ("HOST:PORT") and ``takeover`` (true). Anything else is EINVAL.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..protocol.errors import InvalidArguments, NotMyVbucket, TemporaryFailure
from ..protocol.opcodes import Status, StreamEndStatus, VBucketState
from .replication.target import Assignment

if TYPE_CHECKING:
    from .engine.item import Item
    from .replication.manager import ReplicationManager
    from .server import DcpServer

__all__ = ["VBucketStates", "parse_address"]

log = logging.getLogger("dcp.vbstates")

SOURCES_FILE = "replication.json"
_OPTION_KEYS = frozenset(("source", "takeover"))
_FED = (VBucketState.REPLICA, VBucketState.PENDING)


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> (host, port); ValueError naming the problem otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


class VBucketStates:
    """See the module rules. Built by ``DcpServer.run`` once the bucket is open."""

    def __init__(self, server: DcpServer, node_name: str) -> None:
        self._server = server
        self.node_name = node_name
        self._assignment: dict[int, Assignment] = {}
        #: vbuckets whose rollback is running: their state and source stay as they are
        #: until it is done (a promotion meanwhile would be wiped by the rollback)
        self._rolling_back: set[int] = set()
        self.manager: ReplicationManager | None = None
        self._dirty = trio.Event()
        self._path = Path(server.config.data_dir) / SOURCES_FILE

    # ------------------------------------------------------------------ assignment

    def start(self, replica_of: str) -> None:
        """The assignment at start: every vbucket a replica of ``replica_of`` (the static
        topology), else the sources remembered from the last run."""
        bucket = self._server.bucket
        if replica_of and self._is_me(replica_of):
            log.error("ignoring --replica-of %s: that is this node itself", replica_of)
            replica_of = ""
        if replica_of:
            active = sum(1 for v in bucket.vbuckets if v.state is VBucketState.ACTIVE)
            if active:
                log.warning(
                    "--replica-of %s: %d active vbuckets become replicas (writes they took "
                    "that %s does not have will be rolled back); start without "
                    "--replica-of to keep them active",
                    replica_of,
                    active,
                    replica_of,
                )
            for vb in range(bucket.num_vbuckets):
                self._assignment[vb] = Assignment(VBucketState.REPLICA, replica_of)
            self._dirty.set()
        else:
            for vb, source in self._load_sources().items():
                if 0 <= vb < bucket.num_vbuckets and bucket.vbucket(vb).state in _FED:
                    state = bucket.vbucket(vb).state
                    self._assignment[vb] = Assignment(state, source)
        self._reconcile()

    def set(self, vb: int, state: VBucketState, options: dict[str, Any]) -> None:
        """SET_VBUCKET_STATE: make ``vb`` ``state`` here (and feed it from ``source``).

        Raises:
            NotMyVbucket: no such vbucket.
            InvalidArguments: unknown options, a malformed source, takeover without one.
        """
        bucket = self._server.bucket
        if not 0 <= vb < bucket.num_vbuckets:
            raise NotMyVbucket(Status.NOT_MY_VBUCKET, f"no vbucket {vb}")
        if vb in self._rolling_back:
            raise TemporaryFailure(Status.ETMPFAIL, f"vbucket {vb} is rolling back; retry")
        unknown = set(options) - _OPTION_KEYS
        if unknown:
            raise InvalidArguments(Status.EINVAL, f"unknown options {sorted(unknown)}")
        source = options.get("source")
        takeover = options.get("takeover", False)
        if source is not None:
            if not isinstance(source, str):
                raise InvalidArguments(Status.EINVAL, "source must be a string HOST:PORT")
            try:
                parse_address(source)
            except ValueError as exc:
                raise InvalidArguments(Status.EINVAL, f"source: {exc}") from None
        if not isinstance(takeover, bool):
            raise InvalidArguments(Status.EINVAL, "takeover must be true or false")
        if state not in _FED and (source or takeover):
            raise InvalidArguments(Status.EINVAL, f"a {state.name.lower()} vbucket has no source")
        if takeover and not source:
            raise InvalidArguments(Status.EINVAL, "takeover needs a source")
        if takeover and state != VBucketState.REPLICA:
            raise InvalidArguments(Status.EINVAL, "a takeover starts from a replica vbucket")
        if source is not None and self._is_me(source):
            raise InvalidArguments(Status.EINVAL, f"source {source} is this node itself")
        if state in _FED and source is None:
            old = self._assignment.get(vb)
            source = old.source if old is not None else None
        self._assignment[vb] = Assignment(state, source, takeover)
        self._dirty.set()
        self._reconcile()
        self._server.durability.state_changed(vb)  # a takeover set the state itself

    def assign(self, assignment: Mapping[int, Assignment]) -> int:
        """The cluster map's assignment (cluster/agent.py): every vbucket given takes its
        assignment, in one reconcile for the whole batch. A vbucket rolling back keeps
        its assignment (``set`` would refuse it too); the agent's next reconcile (about a
        second later) retries it.
        Returns how many vbuckets changed assignment or state."""
        changed = 0
        for vb, a in assignment.items():
            if vb in self._rolling_back:
                continue
            if self._assignment.get(vb) != a or self.state(vb) != a.state:
                self._assignment[vb] = a
                changed += 1
        if changed:
            self._dirty.set()
            self._reconcile()
        return changed

    def _is_me(self, address: str) -> bool:
        """Whether ``address`` names this node (its advertised name, or any loopback or
        listen address with its port): a vbucket fed from itself would never be fed."""
        host, port = parse_address(address)
        if address == self.node_name:
            return True
        mine = {self._server.config.host, "127.0.0.1", "localhost", "::1", "0.0.0.0", ""}
        return port == self._server.port and host.strip("[]") in mine

    def assignment(self, vb: int) -> Assignment | None:
        return self._assignment.get(vb)

    def _reconcile(self) -> None:
        if self.manager is not None:
            self.manager.reconcile(dict(self._assignment))
        else:  # no replication running (tests of the handlers): states only
            for vb, a in self._assignment.items():
                self.set_state(vb, a.state)

    # ------------------------------------------------------------------ ReplicaTarget

    def state(self, vb: int) -> VBucketState:
        return self._server.bucket.vbucket(vb).state

    def set_state(self, vb: int, state: VBucketState, *, takeover: bool = False) -> None:
        changed = self._server.bucket.vbucket(vb).set_state(state, takeover=takeover)
        if not changed:
            return
        self._server.durability.state_changed(vb)
        log.info("vb %d is now %s%s", vb, state.name.lower(), " (takeover)" if takeover else "")
        if takeover and state == VBucketState.ACTIVE:
            self._assignment[vb] = Assignment(VBucketState.ACTIVE)
            self._dirty.set()
        self._server.stream_registry.end_streams(vb, StreamEndStatus.STATE_CHANGED)
        self._server.stream_registry.wake_dirty()

    def position(self, vb: int) -> tuple[int, int, int, int]:
        return self._server.bucket.vbucket(vb).replication_position()

    def persisted_seqno(self, vb: int) -> int:
        return self._server.bucket.vbucket(vb).persisted_seqno

    def adopt_failover_log(self, vb: int, entries: list[tuple[int, int]]) -> None:
        self._server.bucket.vbucket(vb).adopt_failover_log(entries)

    def apply_snapshot(self, vb: int, start: int, end: int, flags: int, items: list[Item]) -> None:
        error = self._server.persistence.storage_error
        if error:  # nothing can be persisted: do not pile snapshots up in memory
            raise TemporaryFailure(Status.ETMPFAIL, f"storage cannot persist ({error})")
        self._server.bucket.vbucket(vb).apply_snapshot(start, end, flags, items)
        self._server.stream_registry.wake_dirty()  # its streams, and the flusher

    async def rollback(self, vb: int, seqno: int) -> int:
        """Roll back to ``seqno``, except a rollback to 0 asked of a replica whose newest
        failover entry starts at its high seqno: that entry is dropped instead and the
        data kept, so the next request names the previous branch (the source may know
        it: the entry was added by this node's own warm-up after a crash). Only when no
        older branch is left does it reset."""
        server = self._server
        if seqno == 0 and server.bucket.vbucket(vb).drop_newest_failover_entry():
            log.info("vb %d: source does not know our newest branch; asking with the previous", vb)
            return server.bucket.vbucket(vb).high_seqno
        self._rolling_back.add(vb)
        try:
            server.stream_registry.end_streams(vb, StreamEndStatus.ROLLBACK)
            reached = await server.persistence.rollback(vb, seqno)
            # streams opened while the disk was rolled back read the discarded checkpoints
            server.stream_registry.end_streams(vb, StreamEndStatus.ROLLBACK)
        finally:
            self._rolling_back.discard(vb)
        server.metrics.replica_rollbacks += 1
        return reached

    # ------------------------------------------------------------------ remembering sources

    def _load_sources(self) -> dict[int, str]:
        try:
            data = json.loads(self._path.read_text())
            return {int(vb): str(src) for vb, src in data.get("sources", {}).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("ignoring %s: %s", self._path, exc)
            return {}

    def _save_sources(self, sources: dict[int, str]) -> None:
        tmp = self._path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"sources": {str(k): v for k, v in sources.items()}}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)

    async def run(self) -> None:
        """Write the sources whenever they changed (at most every 0.2 s), until cancelled."""
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            sources = {vb: a.source for vb, a in self._assignment.items() if a.source}
            try:
                await trio.to_thread.run_sync(self._save_sources, sources)
            except OSError as exc:
                log.error("cannot write %s: %s", self._path, exc)
            await trio.sleep(0.2)
