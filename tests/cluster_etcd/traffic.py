"""Load on a cluster as a cluster-aware client makes it: writes routed by the vbucket map,
DCP streams that follow their vbucket to its new active, and the checks of what they saw.

Rules of this module:
- Routing reads the map from etcd (``Router``); when etcd does not answer the last map
  read is kept, as a client keeps its last config. A write that fails on a node
  (NOT_MY_VBUCKET, ETMPFAIL, a node that is gone or frozen: the SDK's ``KvClient``
  retries those for ``op_timeout`` and then raises) re-reads the map and goes to the
  vbucket's active again, until ``give_up``.
- Each key is written by one task, in order, with values ``key|version``; a retried write
  re-sends the same version. So after the load, a key's value must be its last
  acknowledged version or one sent after it and never acknowledged (a write whose answer
  was lost may have been applied): anything else, or a missing key that was
  acknowledged, is an acknowledged write lost (``Writer.lost``).
- A stream (``Follower``) is one ``DcpClient`` per vbucket on the node the map names; when
  the vbucket leaves that node (the client gives up after ``retry_timeout``) it is opened
  again on the new active from the last snapshot received (its end seqno and failover
  log), as a cluster-aware consumer resumes. Each snapshot is checked as it arrives:
  items strictly increasing within ``[start, end]``, and a snapshot never starting
  beyond the previous end + 1 (a gap: seqnos the consumer was never offered).
- Every loop is bounded: by a count of operations or by an event the test sets, and by
  ``give_up`` per operation.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from dcp.consumer import DcpClient, KvClient, Offset, RollbackEvent
from dcp.consumer.errors import DcpClientError
from dcp.producer.cluster.store import StoreUnavailable
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.protocol.errors import StatusError
from dcp.protocol.layout import vbucket_for_key

from .harness import EtcdCluster

HOST = "127.0.0.1"
#: What a write attempt may fail with before it is re-routed.
RETRY = (DcpClientError, StatusError, OSError, trio.TooSlowError)


class Router:
    """The map a client routes with: etcd's, or the last one read while etcd is away."""

    def __init__(self, cluster: EtcdCluster) -> None:
        self.cluster = cluster
        self.vbmap: VBucketMap | None = None
        self.revision = 0
        self.etcd_failures = 0

    async def refresh(self) -> None:
        try:
            vbmap, rev = await self.cluster.read_map()
        except StoreUnavailable:
            self.etcd_failures += 1
            return
        if vbmap is not None:
            self.vbmap, self.revision = vbmap, rev

    def active(self, vb: int) -> str | None:
        return None if self.vbmap is None else self.vbmap.active(vb)


@dataclass
class KeyLog:
    acked: int | None = None  # last acknowledged version
    unacked: set[int] = field(default_factory=set)  # sent after it, never acknowledged
    acked_by: str | None = None  # the node that acknowledged ``acked``
    acked_at: float = 0.0  # when (trio time)


def value_of(key: bytes, version: int) -> bytes:
    return key + b"|" + str(version).encode()


class Writer:
    """Routed SETs (see the module rules); ``acked`` counts acknowledged writes."""

    def __init__(
        self, cluster: EtcdCluster, router: Router, *, op_timeout: float = 1.0, give_up: float = 40
    ) -> None:
        self.cluster = cluster
        self.router = router
        self.op_timeout = op_timeout
        self.give_up = give_up
        self.log: dict[bytes, KeyLog] = {}
        self.acked = 0
        self.reroutes = 0
        self.slowest = 0.0  # the longest a write took to be acknowledged (s)
        self._clients: dict[str, KvClient] = {}
        self._lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._nursery_cm = trio.open_nursery()

    async def __aenter__(self) -> Writer:
        self._nursery = await self._nursery_cm.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        await self._nursery_cm.__aexit__(None, None, None)

    async def _hold(self, name: str, task_status: trio.TaskStatus[KvClient]) -> None:
        """A node's client lives in a task of the writer's nursery: a ``KvClient`` is
        entered and left in one task, whichever write task asked for it first."""
        async with KvClient(
            HOST,
            self.cluster.port_of(name),
            num_vbuckets=self.cluster.num_vbuckets,
            timeout=self.op_timeout,
        ) as kv:
            task_status.started(kv)
            await trio.sleep_forever()

    async def _client(self, name: str) -> KvClient:
        """The node's client; raises (re-routed) when the node does not answer."""
        async with self._lock:
            kv = self._clients.get(name)
            if kv is None:
                assert self._nursery is not None
                kv = await self._nursery.start(self._hold, name)
                self._clients[name] = kv
            return kv

    async def write(self, key: bytes, version: int) -> bool:
        """One write, re-routed until acknowledged; False if ``give_up`` passed first."""
        entry = self.log.setdefault(key, KeyLog())
        entry.unacked.add(version)
        vb = vbucket_for_key(key, self.cluster.num_vbuckets)
        t0 = trio.current_time()
        while trio.current_time() - t0 < self.give_up:
            if self.router.active(vb) is None:
                await self.router.refresh()
            name = self.router.active(vb)
            if name is not None:
                try:
                    kv = await self._client(name)
                    await kv.set(key, value_of(key, version))
                except RETRY:
                    pass
                else:
                    entry.acked, entry.unacked = version, set()
                    entry.acked_by, entry.acked_at = name, trio.current_time()
                    self.acked += 1
                    self.slowest = max(self.slowest, trio.current_time() - t0)
                    return True
            self.reroutes += 1
            await trio.sleep(0.05)
            await self.router.refresh()
        return False

    async def run(self, keys: list[bytes], stop: trio.Event, max_ops: int = 1_000_000) -> None:
        """Write ``keys`` round-robin (one task) until ``stop`` is set or ``max_ops``."""
        version = 0
        while not stop.is_set() and version < max_ops:
            for key in keys:
                if stop.is_set():
                    return
                await self.write(key, version)
            version += 1

    def lost(
        self,
        found: dict[bytes, bytes | None],
        excuse: Callable[[KeyLog], bool] | None = None,
    ) -> list[str]:
        """Acknowledged writes the cluster does not hold (``found``: key -> value read),
        except those ``excuse`` allows: a kill -9 may lose what its victim acknowledged but
        had not replicated yet (asynchronous replication, docs/cluster.md), nothing else."""
        out = []
        for key, entry in self.log.items():
            if entry.acked is None or (excuse is not None and excuse(entry)):
                continue
            got = found.get(key)
            allowed = {value_of(key, v) for v in {entry.acked, *entry.unacked}}
            if got not in allowed:
                out.append(f"{key!r}: acked version {entry.acked}, cluster holds {got!r}")
        return out


def probe_keys(num_vbuckets: int) -> dict[int, bytes]:
    """One key per vbucket (to write-probe every vbucket)."""
    out: dict[int, bytes] = {}
    i = 0
    while len(out) < num_vbuckets:
        k = f"probe-{i}".encode()
        out.setdefault(vbucket_for_key(k, num_vbuckets), k)
        i += 1
    return out


async def all_writable(writer: Writer, version: int) -> float:
    """Write one key in every vbucket, concurrently, each re-routed until acknowledged;
    returns the seconds until the last was (fails if one gave up)."""
    keys = probe_keys(writer.cluster.num_vbuckets)
    t0 = trio.current_time()
    failed: list[int] = []

    async def probe(vb: int) -> None:
        if not await writer.write(keys[vb], version):
            failed.append(vb)

    async with trio.open_nursery() as nursery:
        for vb in keys:
            nursery.start_soon(probe, vb)
    assert not failed, f"vbuckets {sorted(failed)} took no write within {writer.give_up:g} s"
    return trio.current_time() - t0


async def read_all(cluster: EtcdCluster, keys: list[bytes]) -> dict[bytes, bytes | None]:
    """Each key's value on its vbucket's active by etcd's map now (None: not found)."""
    vbmap, _ = await cluster.read_map()
    assert vbmap is not None
    by_node: dict[str, list[bytes]] = {}
    for k in keys:
        name = vbmap.active(vbucket_for_key(k, cluster.num_vbuckets))
        assert name is not None, f"{k!r}: its vbucket has no active"
        by_node.setdefault(name, []).append(k)
    out: dict[bytes, bytes | None] = {}
    for name, ks in by_node.items():
        async with KvClient(
            HOST, cluster.port_of(name), num_vbuckets=cluster.num_vbuckets, timeout=30
        ) as kv:
            got = await kv.get_many(ks)
        for k in ks:
            r = got.get(k)
            out[k] = None if r is None else bytes(r.value)
    return out


def keys_for(n: int, prefix: str, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    return [f"{prefix}-{i}-{rng.randrange(1 << 20)}".encode() for i in range(n)]


@dataclass
class VbStream:
    """What one vbucket's follower received."""

    high: int = 0  # the last snapshot end received
    offset: Offset | None = None
    values: dict[bytes, bytes | None] = field(default_factory=dict)  # newest per key
    problems: list[str] = field(default_factory=list)
    rollbacks: int = 0
    opens: int = 0
    nodes: list[str] = field(default_factory=list)  # where it streamed from, in order


class Follower:
    """DCP streams of every vbucket, following them across the cluster (module rules)."""

    def __init__(self, cluster: EtcdCluster, router: Router, retry_timeout: float = 2.0) -> None:
        self.cluster = cluster
        self.router = router
        self.retry_timeout = retry_timeout
        self.vbs = {vb: VbStream() for vb in range(cluster.num_vbuckets)}

    def _take(self, vb: int, batch: object) -> None:
        st = self.vbs[vb]
        start, end = batch.start, batch.end  # type: ignore[attr-defined]
        if start > st.high + 1:
            st.problems.append(f"snapshot {start}-{end} after {st.high}: a gap")
        prev = start - 1
        for e in batch.events:  # type: ignore[attr-defined]
            if not (start <= e.seqno <= end) or e.seqno <= prev:
                st.problems.append(f"seqno {e.seqno} out of order in snapshot {start}-{end}")
            prev = e.seqno
            val = getattr(e, "value", None)
            st.values[bytes(e.key)] = None if val is None else bytes(val)
        st.high = max(st.high, end)
        st.offset = Offset(vb, seqno=end, failover_log=batch.failover_log)  # type: ignore[attr-defined]

    async def _follow(self, vb: int, stop: trio.Event) -> None:
        st = self.vbs[vb]
        while not stop.is_set():
            name = self.router.active(vb)
            if name is None:
                await trio.sleep(0.1)
                await self.router.refresh()
                continue
            st.opens += 1
            st.nodes.append(name)
            try:
                async with DcpClient(
                    HOST,
                    self.cluster.port_of(name),
                    vbuckets=[vb],
                    offsets=None if st.offset is None else {vb: st.offset},
                    retry_timeout=self.retry_timeout,
                    connect_timeout=self.retry_timeout,
                    noop_interval=1.0,
                    name=f"follower-{vb}-{st.opens}",
                    cluster=False,  # pinned to the node: this follower does the routing
                ) as client:
                    async for got in client:
                        if isinstance(got, RollbackEvent):
                            st.rollbacks += 1
                            st.high = got.rollback_seqno
                            continue
                        self._take(vb, got)
            except DcpClientError:
                pass  # the vbucket left that node, or the node is gone: route again
            await trio.sleep(0.1)
            await self.router.refresh()

    async def run(self, stop: trio.Event) -> None:
        async with trio.open_nursery() as nursery:
            for vb in self.vbs:
                nursery.start_soon(self._follow, vb, stop)
            await stop.wait()
            nursery.cancel_scope.cancel()

    async def caught_up(self) -> bool:
        return not await self.lagging()

    async def lagging(self) -> dict[int, tuple[int, int]]:
        """vb -> (received, active's high seqno) where the stream is behind its active."""
        vbmap, _ = await self.cluster.read_map()
        assert vbmap is not None
        out = {}
        for name in set(vbmap.servers):
            if not self.cluster.alive(name):
                continue
            highs = await self.cluster.nodes[name].high_seqnos()
            for vb, st in self.vbs.items():
                if vbmap.active(vb) == name and st.high < highs.get(vb, 0):
                    out[vb] = (st.high, highs[vb])
        return out

    def problems(self) -> list[str]:
        return [f"vb {vb}: {p}" for vb, st in self.vbs.items() for p in st.problems][:10]
