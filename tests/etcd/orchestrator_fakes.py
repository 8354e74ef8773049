"""Fake nodes for the orchestrator tests: a NodeControl over a model of nodes that follow
the map in (real) etcd as cluster/agent.py does, replicate, take over and take writes.

Rules of this module:
- A node is up or down. Up: ``nodes/<name>`` exists in etcd (no lease: ``kill`` deletes
  it, as an expired lease would), its control calls answer, it follows the map. Down:
  every control call raises ControlUnavailable and it does nothing.
- Following the map (``reconcile``) applies the agent's rules, forward chains included:
  an old active that handed over (DEAD) stays DEAD, a new active that took over stays
  ACTIVE, a takeover assignment is kept.
- Each ``tick`` (every ``tick_interval``): actives take ``writes`` writes per vbucket,
  replicas copy their source's seqno (unless ``lagging``), and a pending takeover whose
  source is up and ACTIVE completes in one step (source DEAD, new ACTIVE with the
  source's seqno): never two actives at once, as the real hand-over guarantees.
- ``violations`` records every moment two up nodes were ACTIVE for one vbucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from dcp.producer.cluster.control import ControlUnavailable
from dcp.producer.cluster.election import map_key
from dcp.producer.cluster.membership import NodeRecord, cluster_prefix
from dcp.producer.cluster.store import EtcdStore, StoreUnavailable
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.protocol.opcodes import Status, VBucketState

A, R, P, D = VBucketState.ACTIVE, VBucketState.REPLICA, VBucketState.PENDING, VBucketState.DEAD


@dataclass
class FakeNode:
    name: str
    address: str
    nvb: int
    up: bool = True
    lagging: bool = False
    #: live (its key held, it follows the map) but the orchestrator cannot reach it
    unreachable: bool = False
    state: dict[int, VBucketState] = field(default_factory=dict)
    seqno: dict[int, int] = field(default_factory=dict)
    source: dict[int, str | None] = field(default_factory=dict)  # vb -> source node name
    takeover: dict[int, str] = field(default_factory=dict)  # vb -> source node name

    def __post_init__(self) -> None:
        for vb in range(self.nvb):
            self.state.setdefault(vb, D)
            self.seqno.setdefault(vb, 0)


class FakeNodes:
    def __init__(
        self, store: EtcdStore, cluster: str, nvb: int, *, writes: int = 1, lease_ttl: int = 2
    ) -> None:
        self.store = store
        #: the lease TTL the nodes' records state (the orchestrator dates failures by it)
        self.lease_ttl = lease_ttl
        self.cluster = cluster
        self.nvb = nvb
        self.writes = writes
        self.nodes: dict[str, FakeNode] = {}
        self.violations: list[tuple[int, list[str]]] = []
        self.calls: list[tuple[str, str, Any]] = []
        self.on_seqnos: Any = None  # an async hook run before each seqnos answer
        self.tick_interval = 0.02
        self.vbmap: VBucketMap | None = None

    # -- the cluster side -------------------------------------------------------------

    async def join(self, name: str) -> FakeNode:
        node = FakeNode(name, f"127.0.0.1:{20000 + len(self.nodes)}", self.nvb)
        self.nodes[name] = node
        rec = self.record(name)
        p = cluster_prefix(self.cluster)
        await self.store.put(p + "members/" + name, rec)
        await self.store.put(p + "nodes/" + name, rec)
        return node

    def record(self, name: str) -> bytes:
        node = self.nodes[name]
        return NodeRecord(
            name, node.address, f"uuid-{name}", self.nvb, "cid", self.lease_ttl
        ).to_json()

    async def kill(self, name: str) -> None:
        self.nodes[name].up = False
        await self.store.delete(cluster_prefix(self.cluster) + "nodes/" + name)

    async def revive(self, name: str) -> None:
        node = self.nodes[name]
        if self.vbmap is not None:
            self.reconcile(node, self.vbmap)
        node.up = True
        rec = self.record(name)
        await self.store.put(cluster_prefix(self.cluster) + "nodes/" + name, rec)

    def by_address(self, address: str) -> FakeNode:
        for node in self.nodes.values():
            if node.address == address:
                if not node.up or node.unreachable:
                    raise ControlUnavailable(address, "down" if not node.up else "no answer")
                return node
        raise ControlUnavailable(address, "no such node")

    def actives(self, vb: int) -> list[str]:
        return [n.name for n in self.nodes.values() if n.up and n.state[vb] == A]

    def _check(self) -> None:
        for vb in range(self.nvb):
            got = self.actives(vb)
            if len(got) > 1:
                self.violations.append((vb, got))

    def reconcile(self, node: FakeNode, m: VBucketMap) -> None:
        me = node.name
        for vb in range(m.num_vbuckets):
            c, f = m.names(vb), m.forward_names(vb)
            st = node.state[vb]
            if f is None:
                want, src = (A, None) if c[0] == me else (R, c[0]) if me in c[1:] else (D, None)
            elif c[0] == me:
                want, src = (D, None) if st == D else (A, None)
            elif f[0] == me and st == A:
                want, src = A, None
            elif me in c or me in f:
                want, src = R, c[0]
            else:
                want, src = D, None
            if want == R and node.takeover.get(vb) == src:
                continue  # a takeover assignment from that source is kept
            if (want, src) != (st, node.source.get(vb)):
                node.takeover.pop(vb, None)
            node.state[vb], node.source[vb] = want, src
        self._check()

    def tick(self) -> None:
        up = {n.name: n for n in self.nodes.values() if n.up}
        for node in up.values():
            for vb in range(self.nvb):
                if node.state[vb] == A:
                    node.seqno[vb] += self.writes
        for node in up.values():
            for vb, src_name in list(node.takeover.items()):
                src = up.get(src_name)
                if src is not None and src.state[vb] == A:
                    src.state[vb] = D
                    node.seqno[vb] = src.seqno[vb]
                    node.state[vb] = A
                    del node.takeover[vb]
            if node.lagging:
                continue
            for vb in range(self.nvb):
                src = up.get(node.source.get(vb) or "")
                if node.state[vb] == R and src is not None and src.state[vb] == A:
                    node.seqno[vb] = src.seqno[vb]
        self._check()

    async def run(self) -> None:
        """Follow the map and tick, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow)
            while True:
                self.tick()
                await trio.sleep(self.tick_interval)

    async def _follow(self) -> None:
        key = map_key(self.cluster)
        while True:
            try:
                async for snap in self.store.follow(key, interval=0.02):
                    got = snap.entries.get(key)
                    if got is None:
                        continue
                    self.vbmap = VBucketMap.from_json(got.value)
                    for node in self.nodes.values():
                        if node.up:
                            self.reconcile(node, self.vbmap)
            except StoreUnavailable:
                await trio.sleep(0.05)

    # -- NodeControl --------------------------------------------------------------------

    async def seqnos(self, address: str, state: VBucketState) -> dict[int, int]:
        if self.on_seqnos is not None:
            await self.on_seqnos(address)
        node = self.by_address(address)
        await trio.sleep(0)
        return {vb: node.seqno[vb] for vb in range(self.nvb) if node.state[vb] == state}

    async def failover_logs(self, address: str, vbs: list[int]) -> dict[int, list[tuple[int, int]]]:
        self.by_address(address)
        await trio.sleep(0)
        return {vb: [(1, 0)] for vb in vbs if 0 <= vb < self.nvb}  # one branch: seqnos decide

    async def states(self, address: str, vbs: list[int]) -> dict[int, VBucketState]:
        node = self.by_address(address)
        await trio.sleep(0)
        return {vb: node.state[vb] for vb in vbs if 0 <= vb < self.nvb}

    async def set_states(
        self, address: str, vbs: list[int], state: VBucketState, options: dict | None = None
    ) -> dict[int, int]:
        node = self.by_address(address)
        self.calls.append((node.name, state.name, options))
        opts = options or {}
        src = self.by_address(opts["source"]).name if opts.get("source") else None
        for vb in vbs:
            node.takeover.pop(vb, None)
            node.state[vb] = state
            if state == R:
                node.source[vb] = src or node.source.get(vb)
            if opts.get("takeover"):
                assert src is not None
                node.takeover[vb] = src
        self._check()
        await trio.sleep(0)
        return dict.fromkeys(vbs, int(Status.SUCCESS))
