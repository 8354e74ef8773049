"""A cluster on a real etcd: ``dcp-server --cluster`` processes on loopback, and the waits
and checks the cluster tests (and nothing else) need.

Rules of this module:
- ``EtcdCluster`` owns one throwaway etcd (``tests/etcd/conftest.py``'s ``EtcdProcess``,
  reused, not copied) and the nodes it made (``tests/cluster/nodes.py``'s ``Node``: a
  child ``python -m dcp.producer`` with a fixed free port, so a restarted node comes back
  at the address the map and its peers know). ``aclose`` kills every node (a SIGSTOPped
  one is continued first) whatever happened; the conftest fixture calls it.
- Nodes run with short cluster timings (lease TTL 2 s, auto-failover after 4 s) so a
  failover test lasts seconds, and 32 vbuckets so a rebalance is quick.
- What the cluster decided is read where it is decided: the map, the live nodes and the
  orchestrator's status from etcd (``EtcdStore``); what each node does from the node
  itself (``STAT replication``: per vbucket its state, its source and whether that stream
  is streaming). A cluster is *settled* when both agree.
- Every wait has a deadline and fails naming what it waited for and what it last saw.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from dcp.producer.cluster.election import read_map
from dcp.producer.cluster.membership import cluster_prefix
from dcp.producer.cluster.store import EtcdStore, StoreUnavailable
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.protocol import codec
from tests.cluster.nodes import Node
from tests.etcd.conftest import EtcdProcess
from tools.chaos.procs import RawClient

NVB = 32
LEASE_TTL = 2
FAILOVER_TIMEOUT = 4.0


def balance_problems(vbmap: VBucketMap, names: Sequence[str]) -> list[str]:
    """What keeps ``vbmap`` from being a settled, balanced map over exactly ``names``
    (empty: none). Balanced: every vbucket has an active and ``min(replicas + 1, nodes)``
    copies on distinct nodes, no move in flight, and per node the actives and the
    replicas each differ by at most one between any two nodes."""
    out: list[str] = []
    if vbmap.moving():
        out.append(f"{len(vbmap.moving())} vbuckets still moving")
    copies = min(vbmap.num_replicas + 1, len(names))
    holders: set[str] = set()
    for vb in range(vbmap.num_vbuckets):
        chain = [n for n in vbmap.names(vb) if n is not None]
        holders.update(chain)
        if vbmap.active(vb) is None:
            out.append(f"vb {vb} has no active")
        if len(chain) != copies or len(set(chain)) != len(chain):
            out.append(f"vb {vb}: chain {vbmap.names(vb)}, want {copies} distinct nodes")
    if holders != set(names):
        out.append(f"copies on {sorted(holders)}, want {sorted(names)}")
    counts = vbmap.counts()
    for what, i in (("actives", 0), ("replicas", 1)):
        per = [counts.get(n, (0, 0))[i] for n in names]
        if per and max(per) - min(per) > 1:
            out.append(f"{what} per node {dict(zip(names, per, strict=True))} differ by > 1")
    return out[:6]


def expected_states(vbmap: VBucketMap, name: str) -> dict[int, str]:
    """vb -> the state ``name`` must hold by the (settled) map: active, replica or dead."""
    out = {}
    for vb in range(vbmap.num_vbuckets):
        chain = vbmap.names(vb)
        out[vb] = "active" if chain[0] == name else "replica" if name in chain[1:] else "dead"
    return out


async def until(check: Callable[[], Any], what: str, timeout: float) -> Any:
    """Poll ``check`` (every 0.1 s; a plain or an async function) until it returns a true
    value, which is returned; fails after ``timeout`` s naming ``what`` and the last error
    it raised, if any."""
    last: BaseException | None = None
    with trio.move_on_after(timeout):
        while True:
            try:
                got = check()
                if inspect.isawaitable(got):
                    got = await got
            except (OSError, StoreUnavailable, trio.TooSlowError, EOFError) as exc:
                last, got = exc, None
            if got:
                return got
            await trio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last error: {last!r})")


class EtcdCluster:
    """An etcd and the ``dcp-server --cluster`` nodes of one test (see the module rules)."""

    def __init__(
        self,
        root: Path,
        etcd: EtcdProcess,
        *,
        name: str = "test",
        num_vbuckets: int = NVB,
        lease_ttl: int = LEASE_TTL,
        failover_timeout: float = FAILOVER_TIMEOUT,
    ) -> None:
        self.root = root
        self.etcd = etcd
        self.name = name
        self.num_vbuckets = num_vbuckets
        self.lease_ttl = lease_ttl
        self.failover_timeout = failover_timeout
        self.store = EtcdStore(etcd.endpoint, timeout=2.0)
        self.nodes: dict[str, Node] = {}

    # -- processes ----------------------------------------------------------------------

    def node_args(self, name: str) -> list[str]:
        return [
            "--cluster",
            self.etcd.endpoint,
            "--node-name",
            name,
            "--cluster-name",
            self.name,
            "--cluster-lease-ttl",
            str(self.lease_ttl),
            "--auto-failover-timeout",
            str(self.failover_timeout),
        ]

    async def start(self, *names: str) -> list[Node]:
        """Start (or restart) these nodes, concurrently; returns them once each listens."""
        for n in names:
            if n not in self.nodes:
                self.nodes[n] = Node(self.root, n, self.num_vbuckets, self.node_args(n))
        async with trio.open_nursery() as nursery:
            for n in names:
                nursery.start_soon(self.nodes[n].start)
        return [self.nodes[n] for n in names]

    def kill(self, name: str) -> None:
        self.nodes[name].kill()

    def pause(self, name: str) -> None:
        self.nodes[name].pause()

    def resume(self, name: str) -> None:
        self.nodes[name].resume()

    def alive(self, name: str) -> bool:
        return self.nodes[name].proc.alive()

    def etcd_down(self) -> None:
        self.etcd.stop()

    async def etcd_up(self) -> None:
        await trio.to_thread.run_sync(self.etcd.start)

    async def aclose(self) -> None:
        for n in self.nodes.values():
            n.kill()
        await self.store.aclose()

    def assert_no_crash(self) -> None:
        """No node logged an unhandled exception (a crash or a task that died)."""
        for n in self.nodes.values():
            tbs = n.tracebacks()
            assert not tbs, f"{n.name} logged {len(tbs)} traceback(s):\n{tbs[0]}"

    def address(self, name: str) -> str:
        return self.nodes[name].address

    def port_of(self, name: str) -> int:
        return self.nodes[name].port

    # -- what etcd says -----------------------------------------------------------------

    def key(self, suffix: str) -> str:
        return cluster_prefix(self.name) + suffix

    async def read_map(self) -> tuple[VBucketMap | None, int]:
        return await read_map(self.store, self.name)

    async def live(self) -> set[str]:
        """Nodes whose lease-bound ``nodes/<name>`` key exists."""
        snap = await self.store.get_prefix(self.key("nodes/"))
        return {k.rsplit("/", 1)[1] for k in snap.entries}

    async def status(self) -> dict[str, Any] | None:
        got = await self.store.get(self.key("status"))
        return None if got is None else json.loads(got.value)

    async def failed_over_count(self) -> int:
        got = await self.store.get(self.key("autofailover"))
        return 0 if got is None else int(json.loads(got.value).get("count", 0))

    # -- what the nodes say -------------------------------------------------------------

    async def replication(self, name: str) -> dict[int, dict[str, str]]:
        """vb -> {state, source?, stream?} from the node's ``STAT replication``."""
        st = await self.nodes[name].stats("replication")
        out: dict[int, dict[str, str]] = {}
        for k, v in st.items():
            head, _, field = k.partition(":")
            if head.startswith("vb_") and head[3:].isdigit():
                out.setdefault(int(head[3:]), {})[field] = v
        return out

    async def reconcile_problems(self, vbmap: VBucketMap, names: Sequence[str]) -> list[str]:
        """Where the nodes ``names`` do not (yet) hold what ``vbmap`` says: an active not
        active, a replica not replicating from the vbucket's active, a copy the map does
        not name still active."""
        out: list[str] = []
        for name in names:
            rep = await self.replication(name)
            for vb, want in expected_states(vbmap, name).items():
                got = rep.get(vb, {})
                state = got.get("state")
                if want == "active" and state != "active":
                    out.append(f"{name} vb {vb}: {state}, want active")
                elif want == "replica":
                    src = self.address(vbmap.active(vb) or "")
                    if (state, got.get("source"), got.get("stream")) != (
                        "replica",
                        src,
                        "streaming",
                    ):
                        out.append(f"{name} vb {vb}: {got}, want replica streaming from {src}")
                elif want == "dead" and state == "active":
                    out.append(f"{name} vb {vb}: active, the map says dead")
        return out

    async def wait_settled(
        self, names: Sequence[str], timeout: float = 60.0
    ) -> tuple[VBucketMap, int]:
        """Until etcd's map is balanced over exactly ``names`` (``balance_problems``), the
        nodes hold what it says (``reconcile_problems``) and it has not changed while they
        were checked. Returns the map and its revision."""
        seen: dict[str, object] = {}

        async def settled() -> tuple[VBucketMap, int] | None:
            vbmap, rev = await self.read_map()
            if vbmap is None:
                seen["map"] = "none yet"
                return None
            problems = balance_problems(vbmap, names)
            if not problems:
                problems = (await self.reconcile_problems(vbmap, names))[:6]
            seen.update(revision=rev, problems=problems)
            if problems or (await self.read_map())[1] != rev:
                return None
            return vbmap, rev

        try:
            return await until(settled, f"a settled map over {sorted(names)}", timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen: {seen}") from None

    async def copies_differ(self, vbmap: VBucketMap) -> dict[int, dict[str, int]]:
        """vb -> {node: high seqno} where the copies of ``vbmap`` do not hold the same
        high seqno and failover log as the vbucket's active (empty: all converged)."""
        highs, logs = {}, {}
        for name in {n for vb in range(vbmap.num_vbuckets) for n in vbmap.names(vb) if n}:
            highs[name] = await self.nodes[name].high_seqnos()
            logs[name] = await self.nodes[name].failover_logs()
        out = {}
        for vb in range(vbmap.num_vbuckets):
            chain = [n for n in vbmap.names(vb) if n]
            if any(
                (highs[n].get(vb), logs[n].get(vb)) != (highs[chain[0]][vb], logs[chain[0]][vb])
                for n in chain[1:]
            ):
                out[vb] = {n: highs[n].get(vb, -1) for n in chain}
        return out

    async def get_cluster_config(self, name: str) -> dict[str, Any]:
        """The node's GET_CLUSTER_CONFIG (opcode 0xB5) answer as JSON; fails on a status."""
        c = await RawClient.connect(self.port_of(name))
        try:
            f = await c.call(codec.request(0xB5, opaque=7), 7)
        finally:
            await c.aclose()
        assert f.status == 0, f"GET_CLUSTER_CONFIG on {name}: status 0x{f.status:02x}"
        doc: dict[str, Any] = json.loads(bytes(f.value))
        return doc
