"""The cluster of the ``failover`` scenario: one etcd and ``dcp-server --cluster`` nodes on
loopback, their faults (kill -9, SIGSTOP/SIGCONT, etcd kill -9 and restart) and the
bounded waits that tell when the cluster has healed.

Rules of this module:
- Every process is a tracked child (``procs.track``): etcd here, the nodes through
  ``procs.ServerProcess``. A ``@scenario`` kills whatever is still running when it ends;
  ``ChaosCluster.stop_all`` does it earlier (a stopped node is continued first).
- Fixed free ports picked once, so a restarted node or etcd comes back at the address
  the map, its peers and the clients know; the data directories stay.
- What the cluster decided is read where it is decided: the map from etcd (``read_map``),
  what a node holds from the node (``STAT vbucket``). Every wait is bounded and returns
  what it last saw instead of raising: a round that never heals is a reported error,
  never a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import trio

from dcp.producer.cluster.election import read_map
from dcp.producer.cluster.store import EtcdStore, StoreUnavailable
from dcp.producer.cluster.vbmap import VBucketMap

from .procs import HOST, HarnessError, RawClient, ServerProcess, failover_logs, free_port, track

__all__ = ["CLUSTER", "ChaosCluster", "EtcdChild"]

CLUSTER = "chaos"


class EtcdChild:
    """A single-member etcd on fixed free loopback ports; ``kill`` + ``start`` is an etcd
    crash and restart on the same data."""

    def __init__(self, root: Path) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            raise HarnessError("etcd is not installed (Debian: apt-get install -y etcd-server)")
        self.exe = exe
        self.root = Path(root)
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"http://{HOST}:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    async def start(self, timeout: float = 30.0) -> None:
        peer = f"http://{HOST}:{self.peer_port}"
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "etcd.log", "ab") as log:
            self.proc = track(
                subprocess.Popen(
                    [
                        self.exe,
                        "--name=chaos",
                        f"--data-dir={self.root / 'data'}",
                        f"--listen-client-urls={self.endpoint}",
                        f"--advertise-client-urls={self.endpoint}",
                        f"--listen-peer-urls={peer}",
                        f"--initial-advertise-peer-urls={peer}",
                        f"--initial-cluster=chaos={peer}",
                        "--logger=zap",
                        "--log-level=error",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise HarnessError(f"etcd exited at start (log {self.root / 'etcd.log'})")
            if await trio.to_thread.run_sync(self._healthy):
                return
            await trio.sleep(0.05)
        self.kill()
        raise HarnessError(f"etcd did not answer on {self.endpoint} within {timeout:g} s")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as r:
                return b'"health":"true"' in r.read()
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class ChaosCluster:
    """etcd and the nodes ``n1..nN`` (see the module rules)."""

    def __init__(
        self,
        root: Path,
        *,
        nodes: int = 3,
        num_vbuckets: int = 16,
        num_replicas: int = 2,
        lease_ttl: int = 2,
        failover_timeout: float = 3.0,
    ) -> None:
        self.root = Path(root)
        self.num_vbuckets = num_vbuckets
        self.failover_timeout = failover_timeout
        self.etcd = EtcdChild(self.root / "etcd")
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.nodes: dict[str, ServerProcess] = {}
        self.paused: set[str] = set()
        flags = [
            "--cluster",
            self.etcd.endpoint,
            "--cluster-name",
            CLUSTER,
            "--cluster-lease-ttl",
            str(lease_ttl),
            "--auto-failover-timeout",
            str(failover_timeout),
            # every round may fail a node over: the count must never run out
            "--auto-failover-max-count",
            "1000",
            "--num-replicas",
            str(num_replicas),
            "--log-level",
            "INFO",
            # a frozen peer's replication connection is judged dead within seconds
            "--noop-interval",
            "2",
        ]
        for name in self.names:
            self.nodes[name] = ServerProcess(
                self.root / name,
                self.root / f"{name}.log",
                port=free_port(),
                num_vbuckets=num_vbuckets,
                args=[*flags, "--node-name", name],
            )
        self.store = EtcdStore(self.etcd.endpoint, timeout=2.0)

    # -- processes ------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{HOST}:{n.port}" for n in self.nodes.values())

    def name_of_port(self, port: int) -> str:
        return next((n for n, p in self.nodes.items() if p.port == port), f"port {port}")

    async def start(self) -> None:
        await self.etcd.start()
        async with trio.open_nursery() as nursery:
            for name in self.names:
                nursery.start_soon(self.start_node, name)

    async def start_node(self, name: str) -> None:
        await self.nodes[name].start(timeout=60)

    def kill(self, name: str) -> None:
        self.resume(name)
        self.nodes[name].kill()

    def pause(self, name: str) -> None:
        os.kill(self.nodes[name].pid, signal.SIGSTOP)
        self.paused.add(name)

    def resume(self, name: str) -> None:
        if name in self.paused and self.nodes[name].alive():
            os.kill(self.nodes[name].pid, signal.SIGCONT)
        self.paused.discard(name)

    async def stop_all(self) -> None:
        for name in list(self.paused):
            self.resume(name)
        for node in self.nodes.values():
            node.kill()
        self.etcd.kill()
        await self.store.aclose()

    def tracebacks(self) -> list[str]:
        return [f"{name}: {sig}" for name, n in self.nodes.items() for sig in n.crash_signatures()]

    # -- what etcd and the nodes say -----------------------------------------------------

    async def read_map(self) -> VBucketMap | None:
        try:
            return (await read_map(self.store, CLUSTER))[0]
        except (StoreUnavailable, OSError, ValueError):
            return None

    async def states(self, name: str) -> dict[int, str]:
        c = await RawClient.connect(self.nodes[name].port, timeout=5)
        try:
            st = await c.stats("vbucket", timeout=5)
        finally:
            await c.aclose()
        return {int(k[3:]): v for k, v in st.items() if k.startswith("vb_") and k[3:].isdigit()}

    async def logs(self) -> dict[str, dict[int, list[tuple[int, int]]]]:
        """Every running node's failover logs (nodes that do not answer are left out)."""
        out = {}
        for name, node in self.nodes.items():
            if node.alive() and name not in self.paused:
                try:
                    with trio.fail_after(10):
                        out[name] = await failover_logs(node.port)
                except (OSError, EOFError, HarnessError, trio.TooSlowError):
                    pass
        return out

    async def problems(self, names: list[str]) -> list[str]:
        """What keeps the cluster from being healed over ``names`` (empty: healed): every
        vbucket has an active, none is moving, the copies are balanced over exactly these
        nodes (``min(replicas + 1, nodes)`` distinct ones per vbucket, actives and replicas
        within one of each other per node), and every node holds what the map names."""
        vbmap = await self.read_map()
        if vbmap is None:
            return ["no map (etcd away?)"]
        out: list[str] = []
        if vbmap.unavailable():
            out.append(f"vbuckets without an active: {vbmap.unavailable()[:8]}")
        if vbmap.moving():
            out.append(f"{len(vbmap.moving())} vbuckets moving")
        copies = min(vbmap.num_replicas + 1, len(names))
        held: set[str] = set()
        for vb in range(vbmap.num_vbuckets):
            chain = [n for n in vbmap.names(vb) if n is not None]
            held.update(chain)
            if len(chain) != copies or len(set(chain)) != len(chain):
                out.append(f"vb {vb}: chain {vbmap.names(vb)}")
                break
        if held != set(names):
            out.append(f"copies on {sorted(held)}, want {sorted(names)}")
        counts = vbmap.counts()
        for what, i in (("actives", 0), ("replicas", 1)):
            per = [counts.get(n, (0, 0))[i] for n in names]
            if max(per) - min(per) > 1:
                out.append(f"{what} per node {per}")
        if out:
            return out
        for name in names:
            try:
                with trio.fail_after(10):
                    states = await self.states(name)
            except (OSError, EOFError, HarnessError, trio.TooSlowError) as exc:
                return [f"{name} does not answer STAT: {exc!r}"]
            for vb in range(vbmap.num_vbuckets):
                names_ = vbmap.names(vb)
                want = "active" if names_[0] == name else "replica" if name in names_[1:] else None
                if want is not None and states.get(vb) != want:
                    return [f"{name} vb {vb} is {states.get(vb)}, the map says {want}"]
        return []

    async def wait_healed(self, names: list[str], timeout: float) -> tuple[float, list[str]]:
        """Poll ``problems`` until there are none or ``timeout`` passes; (seconds waited,
        the last problems: empty when healed)."""
        t0 = trio.current_time()
        last = ["not checked"]
        with trio.move_on_after(timeout):
            while True:
                last = await self.problems(names)
                if not last:
                    break
                await trio.sleep(0.2)
        return trio.current_time() - t0, last

    async def failover_count(self) -> int | None:
        """The cluster's count of automatic failovers (None: etcd did not answer)."""
        try:
            got = await self.store.get(f"/dcp/{CLUSTER}/autofailover")
        except (StoreUnavailable, OSError):
            return None
        return 0 if got is None else int(json.loads(got.value).get("count", 0))

    async def wait_failover_count(self, want: int, timeout: float) -> tuple[float, list[str]]:
        """Until the count of automatic failovers reaches ``want`` (a restarted node that
        waits to be failed over shows no map change of its own to wait for: it leaves the
        map and comes back through the rebalance, maybe between two reads)."""
        t0 = trio.current_time()
        last = ["not checked"]
        with trio.move_on_after(timeout):
            while True:
                got = await self.failover_count()
                if got is not None and got >= want:
                    return trio.current_time() - t0, []
                last = [f"automatic failovers: {got}, want {want}"]
                await trio.sleep(0.1)
        return trio.current_time() - t0, last

    async def wait_failed_over(self, name: str, timeout: float) -> tuple[float, list[str]]:
        """Until the map names ``name`` in no chain and every vbucket has an active."""
        t0 = trio.current_time()
        last = ["not checked"]
        with trio.move_on_after(timeout):
            while True:
                vbmap = await self.read_map()
                if vbmap is None:
                    last = ["no map (etcd away?)"]
                elif vbmap.unavailable():
                    last = [f"vbuckets without an active: {vbmap.unavailable()[:8]}"]
                elif any(name in vbmap.names(vb) for vb in range(vbmap.num_vbuckets)):
                    last = [f"{name} still in the map"]
                else:
                    return trio.current_time() - t0, []
                await trio.sleep(0.1)
        return trio.current_time() - t0, last
