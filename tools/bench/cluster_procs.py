"""The cluster of the ``cluster`` benchmark: an etcd and ``dcp-server --cluster`` nodes on
loopback, and what the measurements ask of them (the map, a settled cluster, routed
writes).

Rules of this module:
- Every process is started here (``etcd`` from Debian's ``etcd-server`` on free ports,
  its data in the scenario's scratch directory; nodes as ``OurServer``) and stopped by its
  own PID when the ``cluster`` context ends, whatever happened. Every wait has a deadline
  and raises ``BenchError`` naming what it waited for.
- What the cluster decided is read from etcd (``EtcdStore``: the map, the live nodes,
  the orchestrator's status), what a node does from the node (``STAT vbucket``); the
  blocking STAT calls run in ``trio.to_thread``.
- Writes are routed by the map read from etcd: each vbucket's keys go to its active
  through one pipelined ``KvClient`` per node, re-routed when a node does not take them.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import trio

from dcp.consumer import BatchWriteError, DcpClientError, KvClient
from dcp.producer.cluster.election import read_map
from dcp.producer.cluster.membership import cluster_prefix
from dcp.producer.cluster.store import EtcdStore, StoreUnavailable
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.protocol.errors import StatusError
from dcp.protocol.layout import vbucket_for_key

from .procs import BenchError, OurServer, Scratch, free_port, stat

CLUSTER = "bench"
HOST = "127.0.0.1"


class Etcd:
    """A throwaway single-member etcd on free loopback ports."""

    def __init__(self, data_dir: str, log_path: str) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise BenchError("etcd is not installed (Debian: apt-get install -y etcd-server)")
        client, peer = free_port(), free_port()
        self.endpoint = f"http://{HOST}:{client}"
        peer_url = f"http://{HOST}:{peer}"
        argv = [
            exe,
            "--name=bench",
            f"--data-dir={data_dir}",
            f"--listen-client-urls={self.endpoint}",
            f"--advertise-client-urls={self.endpoint}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=bench={peer_url}",
            "--log-level=error",
            "--logger=zap",
        ]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"etcd exited at start (log: {log_path})")
            try:
                with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as r:
                    if b'"health":"true"' in r.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise BenchError(f"etcd did not answer within 30 s (log: {log_path})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class Cluster:
    """The processes of one run; ``settings`` are the nodes' cluster flags."""

    etcd: Etcd
    scratch: Scratch
    vbuckets: int
    settings: dict[str, Any]
    log_dir: str
    nodes: dict[str, OurServer] = field(default_factory=dict)

    def start(self, name: str) -> OurServer:
        node = OurServer(
            self.scratch.sub(name),
            self.vbuckets,
            {
                "cluster": self.etcd.endpoint,
                "node_name": name,
                "cluster_name": CLUSTER,
                **self.settings,
            },
            log_path=f"{self.log_dir}/cluster-{name}.log",
        ).start()
        self.nodes[name] = node
        return node

    def store(self) -> EtcdStore:
        return EtcdStore(self.etcd.endpoint, timeout=2.0)


@contextlib.contextmanager
def cluster(
    scratch: Scratch, vbuckets: int, settings: dict[str, Any], log_dir: str, names: list[str]
) -> Iterator[Cluster]:
    """etcd and the nodes ``names``; all stopped (nodes killed, etcd killed) at the end."""
    etcd = Etcd(scratch.sub("etcd"), f"{log_dir}/cluster-etcd.log")
    cl = Cluster(etcd, scratch, vbuckets, settings, log_dir)
    try:
        for name in names:
            cl.start(name)
        yield cl
    finally:
        for node in cl.nodes.values():
            if node.alive():
                node.proc.kill()
                node.proc.wait(10)
        etcd.stop()


# ---------------------------------------------------------------------- etcd reads


async def current_map(store: EtcdStore) -> tuple[VBucketMap | None, int]:
    return await read_map(store, CLUSTER)


async def status(store: EtcdStore) -> dict[str, Any]:
    got = await store.get(cluster_prefix(CLUSTER) + "status")
    return {} if got is None else json.loads(got.value)


async def is_live(store: EtcdStore, name: str) -> bool:
    return await store.get(cluster_prefix(CLUSTER) + f"nodes/{name}") is not None


def _states(node: OurServer) -> dict[int, str]:
    st = stat(node.port, "vbucket", 30)
    return {int(k[3:]): v for k, v in st.items() if k.startswith("vb_") and k[3:].isdigit()}


def high_seqnos(node: OurServer) -> dict[int, int]:
    st = stat(node.port, "vbucket-seqno", 30)
    return {
        int(k[3:].partition(":")[0]): int(v) for k, v in st.items() if k.endswith(":high_seqno")
    }


async def settled(cl: Cluster, store: EtcdStore, names: list[str]) -> VBucketMap | None:
    """The map when it is balanced over exactly ``names``, not moving, every vbucket has
    an active, and each node holds active/replica what it names; else None."""
    vbmap, _ = await current_map(store)
    if vbmap is None or vbmap.moving() or vbmap.unavailable():
        return None
    copies = min(vbmap.num_replicas + 1, len(names))
    held = {n for vb in range(vbmap.num_vbuckets) for n in vbmap.names(vb) if n}
    if held != set(names):
        return None
    if any(sum(1 for n in vbmap.names(vb) if n) != copies for vb in range(vbmap.num_vbuckets)):
        return None
    counts = vbmap.counts()
    for i in (0, 1):
        per = [counts.get(n, (0, 0))[i] for n in names]
        if max(per) - min(per) > 1:
            return None
    for name in names:
        states = await trio.to_thread.run_sync(_states, cl.nodes[name])
        for vb in range(vbmap.num_vbuckets):
            chain = vbmap.names(vb)
            want = "active" if chain[0] == name else "replica" if name in chain[1:] else None
            if want is not None and states.get(vb) != want:
                return None
    return vbmap


async def wait_settled(
    cl: Cluster, store: EtcdStore, names: list[str], timeout: float, poll: float = 0.1
) -> VBucketMap:
    deadline = trio.current_time() + timeout
    while trio.current_time() < deadline:
        try:
            got = await settled(cl, store, names)
        except (StoreUnavailable, BenchError, OSError):
            got = None
        if got is not None:
            return got
        await trio.sleep(poll)
    raise BenchError(f"the cluster did not settle over {names} within {timeout:g} s")


# ---------------------------------------------------------------------- routed writes


class Router:
    """Writes routed by etcd's map; one pipelined ``KvClient`` per node (see the rules)."""

    def __init__(self, cl: Cluster, store: EtcdStore, op_timeout: float = 0.5) -> None:
        self.cl = cl
        self.store = store
        self.op_timeout = op_timeout
        self.vbmap: VBucketMap | None = None
        self._clients: dict[str, KvClient] = {}
        self._lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._nursery_cm = trio.open_nursery()

    async def __aenter__(self) -> Router:
        self._nursery = await self._nursery_cm.__aenter__()
        await self.refresh()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        await self._nursery_cm.__aexit__(None, None, None)

    async def refresh(self) -> None:
        with contextlib.suppress(StoreUnavailable):
            vbmap, _ = await current_map(self.store)
            if vbmap is not None:
                self.vbmap = vbmap

    async def _hold(self, name: str, task_status: trio.TaskStatus[KvClient]) -> None:
        # a KvClient is entered and left in one task (its nursery), whoever asked first
        async with KvClient(
            HOST, self.cl.nodes[name].port, num_vbuckets=self.cl.vbuckets, timeout=self.op_timeout
        ) as kv:
            task_status.started(kv)
            await trio.sleep_forever()

    async def client(self, name: str) -> KvClient:
        """The node's client; raises when the node does not answer."""
        async with self._lock:
            kv = self._clients.get(name)
            if kv is None:
                assert self._nursery is not None
                kv = await self._nursery.start(self._hold, name)
                self._clients[name] = kv
            return kv

    async def write_many(self, items: dict[bytes, bytes], give_up: float) -> None:
        """Write ``items``, grouped by their active node, re-routed until all are taken."""
        left = dict(items)
        deadline = trio.current_time() + give_up
        while left:
            if trio.current_time() > deadline:
                raise BenchError(f"{len(left)} writes not taken within {give_up:g} s")
            assert self.vbmap is not None
            groups: dict[str, dict[bytes, bytes]] = {}
            for k, v in left.items():
                name = self.vbmap.active(vbucket_for_key(k, self.cl.vbuckets))
                if name is not None:
                    groups.setdefault(name, {})[k] = v
            done: list[bytes] = []
            async with trio.open_nursery() as nursery:
                for name, part in groups.items():
                    nursery.start_soon(self._send, name, part, done)
            for k in done:
                del left[k]
            if left:
                await trio.sleep(0.02)
                await self.refresh()

    async def _send(self, name: str, part: dict[bytes, bytes], done: list[bytes]) -> None:
        """One node's share; the keys it took go to ``done``."""
        try:
            kv = await self.client(name)
            await kv.set_many(part)
        except BatchWriteError as exc:  # some were taken: only the rest go again
            ok = [not isinstance(r, BaseException) for r in exc.results]
            done.extend(k for k, taken in zip(part, ok, strict=True) if taken)
        except (DcpClientError, StatusError, OSError):
            pass
        else:
            done.extend(part)
