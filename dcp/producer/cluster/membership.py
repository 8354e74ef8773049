"""Membership: a node joins the cluster in etcd, keeps its lease alive, and fences itself
before etcd could consider it gone.

Rules of this module:
- Keys (``/dcp/<cluster>/``): ``meta`` = {cluster_id, num_vbuckets}, created by the first
  node to join; ``nodes/<name>`` = the node's ``NodeRecord`` under its lease (present
  while the node is alive: the orchestrator's view of liveness); ``members/<name>`` =
  the same record without a lease (the roster: nodes that joined and were not removed,
  so a map can still name, and clients still reach, a node that is down).
- Joining refuses, with one line (``JoinRefused``), a node whose name is held by a live
  node with another uuid or is in the roster (``members/<name>``) with another uuid
  (another data directory: its vbuckets' data is not here), whose vbucket count
  differs from the cluster's, or whose data directory belongs to another cluster or node.
  The data directory's ``cluster.json`` records the cluster, its id, the node name and
  the node uuid; it is written on the first join (atomically) and is what makes a
  restarted node the same node: it may take over its own name even while its previous
  lease has not yet expired — unless it must first be failed over (``join``'s ``hold``:
  cluster/rejoin.py, after an unclean shutdown).
- Fencing. etcd extends a lease by its TTL from the moment it handles a keepalive, which
  is after the node sent it: so the lease lives at least until ``sent + ttl`` (by a clock
  that runs at the node's rate). The node's *fence point* is ``sent + ttl - margin`` of
  its last successful keepalive (or grant). At the fence point, unless a keepalive has
  succeeded since, ``NodeHooks.fence`` is called: the node stops taking writes on its
  active vbuckets there, before any orchestrator can see the lease gone and promote a
  replica. ``writes_allowed()`` is the same rule as a synchronous check for the write
  path, because a process that was frozen (SIGSTOP) may serve a request before its
  watchdog task runs again.
- A lease that etcd reports expired means the node key is gone: fence at once (if not
  yet), register again under a new lease and call ``NodeHooks.rejoined``; the node stays
  fenced until the map tells it what it holds (it may have been failed over meanwhile).
  A keepalive that succeeds after a fence on the same lease calls ``NodeHooks.restored``:
  the lease never lapsed, so no failover can have happened.
- Time is ``trio.current_time()`` (tests use trio's MockClock); blocking work (the data
  directory file) runs in ``trio.to_thread``; etcd calls go through the ``Store``
  protocol (cluster/store.py's ``EtcdStore`` in production).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from .store import Entry, LeaseExpired, StoreUnavailable

__all__ = ["JoinRefused", "Membership", "NodeHooks", "NodeRecord", "Store", "cluster_prefix"]

log = logging.getLogger(__name__)

IDENTITY_FILE = "cluster.json"


class Store(Protocol):
    """The etcd operations membership uses (cluster/store.py's ``EtcdStore``)."""

    async def get(self, key: str) -> Entry | None: ...
    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int: ...
    async def compare_and_put(
        self, key: str, value: bytes, *, mod_revision: int, lease: int = 0
    ) -> int | None: ...
    async def grant_lease(self, ttl: int) -> tuple[int, int]: ...
    async def refresh_lease(self, lease: int) -> int: ...
    async def revoke_lease(self, lease: int) -> None: ...


class NodeHooks(Protocol):
    """What membership tells the node. All three are synchronous and quick."""

    def fence(self, reason: str) -> None:
        """Stop taking writes on every active vbucket *before returning* (flip them in
        memory to pending/dead; persisting the state may follow). Called once per lapse."""

    def restored(self) -> None:
        """A keepalive succeeded after a fence on the same lease: it never lapsed."""

    def rejoined(self, lease: int) -> None:
        """Registered again under a new lease after the old one expired."""


class JoinRefused(Exception):
    """This node may not join this cluster; the message is one line saying why."""


def cluster_prefix(cluster: str) -> str:
    return f"/dcp/{cluster}/"


@dataclass(frozen=True)
class NodeRecord:
    name: str
    address: str
    uuid: str
    num_vbuckets: int
    cluster_id: str
    #: the node's lease TTL (s): its key vanishes that long after its last keepalive, so
    #: the orchestrator dates a failure from when it saw the key gone minus this
    lease_ttl: int = 5

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> NodeRecord:
        doc = json.loads(data)
        return cls(
            str(doc["name"]),
            str(doc["address"]),
            str(doc["uuid"]),
            int(doc["num_vbuckets"]),
            str(doc["cluster_id"]),
            int(doc.get("lease_ttl", 5)),  # records written before it existed: the default
        )


def _read_identity(data_dir: Path) -> dict[str, Any] | None:
    path = data_dir / IDENTITY_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise JoinRefused(f"cannot read {path}: {exc}") from exc
    if (
        not isinstance(doc, dict)
        or not {"cluster", "cluster_id", "node", "node_uuid"} <= doc.keys()
    ):
        raise JoinRefused(f"{path} is not a cluster identity file")
    return doc


def _write_identity(data_dir: Path, doc: dict[str, Any]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{IDENTITY_FILE}.", dir=data_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, data_dir / IDENTITY_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Membership:
    def __init__(
        self,
        store: Store,
        hooks: NodeHooks,
        *,
        cluster: str,
        node_name: str,
        address: str,
        num_vbuckets: int,
        data_dir: str | os.PathLike[str],
        lease_ttl: int = 5,
        fence_margin: float | None = None,
    ) -> None:
        if lease_ttl < 2:
            raise ValueError(f"lease_ttl must be at least 2 s, not {lease_ttl}")
        self.store = store
        self.hooks = hooks
        self.cluster = cluster
        self.node_name = node_name
        self.address = address
        self.num_vbuckets = num_vbuckets
        self.data_dir = Path(data_dir)
        self.lease_ttl = lease_ttl
        #: how long before the earliest possible expiry the node fences itself
        self.fence_margin = fence_margin if fence_margin is not None else max(0.5, lease_ttl / 5)
        self.refresh_interval = lease_ttl / 3
        self.record: NodeRecord | None = None
        self.lease = 0
        self.fenced = False
        self._fenced_lease = 0
        self._fence_at = -float("inf")
        self._watchdog: trio.CancelScope | None = None

    # -- the write gate -------------------------------------------------------------------

    @property
    def fence_at(self) -> float:
        """The trio time at which the node fences itself unless a keepalive succeeds."""
        return self._fence_at

    def writes_allowed(self) -> bool:
        """May an active vbucket of this node take a write now?"""
        return not self.fenced and trio.current_time() < self._fence_at

    def _granted(self, sent: float, ttl: int) -> None:
        self._fence_at = sent + min(ttl, self.lease_ttl) - self.fence_margin
        if self._watchdog is not None:
            self._watchdog.deadline = self._fence_at

    def resume(self) -> bool:
        """Lift a fence kept after registering again (the node calls it once it has the
        map read after its new registration). False when the lease is not valid now."""
        if trio.current_time() >= self._fence_at or not self.lease:
            return False
        self.fenced = False
        return True

    def _fence(self, reason: str) -> None:
        if not self.fenced:
            self.fenced = True
            self._fenced_lease = self.lease
            log.warning("node %s fenced: %s", self.node_name, reason)
            self.hooks.fence(reason)

    # -- joining --------------------------------------------------------------------------

    def _key(self, kind: str) -> str:
        return f"{cluster_prefix(self.cluster)}{kind}/{self.node_name}"

    async def join(self, hold: Callable[[], Awaitable[None]] | None = None) -> NodeRecord:
        """Check this node may join, register it under a new lease, and return its record.
        ``hold`` is awaited between the checks and the registration (cluster/rejoin.py:
        after an unclean shutdown the node may have to be failed over first). Raises
        ``JoinRefused`` (one line) or ``StoreUnavailable``."""
        identity = await trio.to_thread.run_sync(_read_identity, self.data_dir)
        where = f"data dir {self.data_dir}"
        if identity is not None and identity["cluster"] != self.cluster:
            raise JoinRefused(
                f"{where} belongs to cluster {identity['cluster']!r}, not {self.cluster!r}"
            )
        if identity is not None and identity["node"] != self.node_name:
            raise JoinRefused(
                f"{where} belongs to node {identity['node']!r}, not {self.node_name!r}"
            )
        cluster_id, num_vbuckets = await self._cluster_meta()
        if num_vbuckets != self.num_vbuckets:
            raise JoinRefused(
                f"node {self.node_name} has {self.num_vbuckets} vbuckets; "
                f"cluster {self.cluster!r} has {num_vbuckets}"
            )
        if identity is not None and identity["cluster_id"] != cluster_id:
            raise JoinRefused(
                f"{where} belongs to another cluster named {self.cluster!r} "
                f"(id {identity['cluster_id']}, this one is {cluster_id})"
            )
        await self._check_roster(identity)
        if identity is None:
            identity = {
                "cluster": self.cluster,
                "cluster_id": cluster_id,
                "node": self.node_name,
                "node_uuid": uuid.uuid4().hex,
            }
            await trio.to_thread.run_sync(_write_identity, self.data_dir, identity)
        if hold is not None:
            await hold()
        self.record = NodeRecord(
            self.node_name,
            self.address,
            identity["node_uuid"],
            self.num_vbuckets,
            cluster_id,
            self.lease_ttl,
        )
        await self._register()
        await self.store.put(self._key("members"), self.record.to_json())
        return self.record

    async def _check_roster(self, identity: dict[str, Any] | None) -> None:
        """A name in the roster belongs to the data directory that joined with it: a node
        started under that name with another directory (an empty one after a disk was
        replaced, say) would otherwise be handed the map's vbuckets with none of their
        data, and its replicas told to roll back to nothing."""
        if await self.store.get(self._key("nodes")) is not None:
            return  # live: registering refuses it, naming where that node runs
        held = await self.store.get(self._key("members"))
        if held is None:
            return
        try:
            other = NodeRecord.from_json(held.value)
        except (ValueError, TypeError, KeyError) as exc:
            raise JoinRefused(f"{self._key('members')} in etcd is malformed ({exc!r})") from exc
        mine = identity["node_uuid"] if identity is not None else None
        if other.uuid != mine:
            what = "an empty data directory" if identity is None else "another data directory"
            raise JoinRefused(
                f"node name {self.node_name!r} is a member of cluster {self.cluster!r} with "
                f"another data directory (uuid {other.uuid}), and {self.data_dir} is "
                f"{what}: fail {self.node_name} over or eject it (dcpctl cluster) first"
            )

    async def _cluster_meta(self) -> tuple[str, int]:
        key = cluster_prefix(self.cluster) + "meta"
        for _ in range(3):
            got = await self.store.get(key)
            if got is None:
                cluster_id = uuid.uuid4().hex
                doc = {"cluster_id": cluster_id, "num_vbuckets": self.num_vbuckets}
                if await self.store.compare_and_put(key, json.dumps(doc).encode(), mod_revision=0):
                    return cluster_id, self.num_vbuckets
                continue  # another node created it first: read theirs
            try:
                meta = json.loads(got.value)
                return str(meta["cluster_id"]), int(meta["num_vbuckets"])
            except (ValueError, TypeError, KeyError) as exc:
                raise JoinRefused(f"{key} in etcd is malformed ({exc!r})") from exc
        raise StoreUnavailable(f"{key} keeps changing")

    async def _register(self) -> None:
        """Put ``nodes/<name>`` under a new lease, unless a live node of another uuid
        holds the name. Leaves ``lease`` and the fence point set."""
        assert self.record is not None
        key = self._key("nodes")
        sent = trio.current_time()
        lease, ttl = await self.store.grant_lease(self.lease_ttl)
        try:
            for _ in range(3):
                held = await self.store.get(key)
                if held is not None:
                    try:
                        other = NodeRecord.from_json(held.value)
                    except (ValueError, TypeError, KeyError) as exc:
                        raise JoinRefused(f"{key} in etcd is malformed ({exc!r})") from exc
                    if other.uuid != self.record.uuid:
                        raise JoinRefused(
                            f"node name {self.node_name!r} is held by a live node at "
                            f"{other.address} (uuid {other.uuid})"
                        )
                rev = await self.store.compare_and_put(
                    key,
                    self.record.to_json(),
                    mod_revision=held.mod_revision if held is not None else 0,
                    lease=lease,
                )
                if rev is not None:
                    self.lease = lease
                    self._granted(sent, ttl)
                    return
            raise JoinRefused(f"node name {self.node_name!r} is being registered concurrently")
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                try:
                    await self.store.revoke_lease(lease)
                except (StoreUnavailable, LeaseExpired):
                    pass
            raise

    # -- staying alive --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the lease alive and fence on time, until cancelled. ``join`` first."""
        if self.record is None:
            raise RuntimeError("join() before run()")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch)
            task_status.started()
            await self._keepalive()

    async def _watch(self) -> None:
        while True:
            with trio.CancelScope(deadline=self._fence_at) as scope:
                self._watchdog = scope
                await trio.sleep_forever()
            self._watchdog = None
            if trio.current_time() >= self._fence_at:
                self._fence(f"no lease keepalive succeeded by the fence point ({self._ttl_text()})")
                # wait for the next successful keepalive or registration to move the point
                while trio.current_time() >= self._fence_at:
                    await trio.sleep(self.refresh_interval / 4)

    def _ttl_text(self) -> str:
        return f"lease TTL {self.lease_ttl} s, margin {self.fence_margin:g} s"

    async def _keepalive(self) -> None:
        failures = 0
        while True:
            await trio.sleep(self.refresh_interval)
            sent = trio.current_time()
            try:
                ttl = await self.store.refresh_lease(self.lease)
            except StoreUnavailable as exc:
                failures += 1
                if failures == 1 or failures % 10 == 0:
                    log.warning("lease keepalive failed (%d in a row): %s", failures, exc)
                continue
            except LeaseExpired:
                self._fence("etcd reports the lease expired")
                self._fenced_lease = 0  # lapsed: only resume() lifts this fence
                await self._rejoin()
                failures = 0
                continue
            failures = 0
            self._granted(sent, ttl)
            if self.fenced and self._fenced_lease == self.lease:
                self.fenced = False
                log.warning("node %s: the lease was kept alive after the fence", self.node_name)
                self.hooks.restored()

    async def _rejoin(self) -> None:
        while True:
            try:
                await self._register()
            except StoreUnavailable as exc:
                log.warning("registering again failed: %s", exc)
                await trio.sleep(self.refresh_interval)
                continue
            self.hooks.rejoined(self.lease)
            return

    async def leave(self) -> None:
        """Revoke the lease: the node key goes at once (a clean stop, not a failure)."""
        if self.lease:
            lease, self.lease = self.lease, 0
            self._fence("leaving the cluster")
            try:
                await self.store.revoke_lease(lease)
            except (StoreUnavailable, LeaseExpired):
                pass
