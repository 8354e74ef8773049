"""The agent hosts the orchestrator: one node at a time runs it (a recording fake here),
the next one takes over when the leader leaves, and a fence stops it until the lease is
known to be alive again (then the same term is taken up, not waited out)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import trio

from dcp.producer.cluster.election import Leadership
from dcp.producer.cluster.store import EtcdStore
from dcp.producer.server import DcpServer
from dcp.protocol.opcodes import VBucketState
from tests.producer.conftest import client_of
from tests.producer.wire import keys_for_vb

from .agent_support import node, until
from .conftest import EtcdProcess

Events = list[tuple[str, str, int]]


def recorder(events: Events, name: str) -> Callable[[Leadership], object]:
    async def run(leadership: Leadership) -> None:
        assert leadership.node == name
        events.append(("start", name, leadership.term))
        try:
            await trio.sleep_forever()
        finally:
            events.append(("stop", name, leadership.term))

    return run


def running(events: Events) -> list[tuple[str, int]]:
    """Who runs the orchestrator now, by the start/stop events."""
    now: list[tuple[str, int]] = []
    for kind, name, term in events:
        if kind == "start":
            now.append((name, term))
        else:
            now.remove((name, term))
    return now


async def test_one_orchestrator_and_the_next_takes_over_when_it_leaves(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    events: Events = []
    async with contextlib.AsyncExitStack() as stack:
        nodes = {}
        for name in ("n1", "n2"):
            nodes[name] = await stack.enter_async_context(
                node(tmp_path, ep, cluster_name, name, run_orchestrator=recorder(events, name))
            )
        await until(lambda: len(running(events)) == 1, "one leader")
        await trio.sleep(1.0)  # and it stays one
        [(leader, term)] = running(events)
        other = "n2" if leader == "n1" else "n1"
        agent = nodes[leader].cluster.agent
        assert agent is not None and agent.leadership is not None
        assert agent.leadership.term == term
        stats_leader = agent.stat_pairs()
        assert ("orchestrator", "true") in stats_leader and ("term", term) in stats_leader
        # the leader stops gracefully: it revokes its lease, the other is elected at once
        await agent.leave()
        store = EtcdStore(ep)
        try:  # revoked, not left to expire: the node key is gone at once
            assert await store.get(f"/dcp/{cluster_name}/nodes/{leader}") is None
        finally:
            await store.aclose()
        await until(lambda: any(n == other for n, _ in running(events)), "next", timeout=10)
        assert ("stop", leader, term) in events
        [(name, new_term)] = running(events)
        assert name == other and new_term > term


async def test_a_fence_stops_the_orchestrator_and_the_kept_lease_resumes_its_term(
    etcd_factory: Callable[[], EtcdProcess], tmp_path: Path
) -> None:
    etcd = etcd_factory()
    events: Events = []
    async with node(
        tmp_path,
        etcd.endpoint,
        "c",
        "n1",
        cluster_lease_ttl=2,
        run_orchestrator=recorder(events, "n1"),
    ) as n1:
        await until(lambda: len(running(events)) == 1, "leader")
        [(_, term)] = running(events)
        agent = n1.cluster.agent
        assert agent is not None
        etcd.stop()
        await until(lambda: agent.fenced, "fenced", timeout=10)
        await until(lambda: running(events) == [], "orchestrator cancelled")
        await trio.to_thread.run_sync(etcd.start)
        await until(lambda: len(running(events)) == 1, "leads again", timeout=30)
        [(_, again)] = running(events)
        if not agent.membership.lease or agent.membership.fenced:
            raise AssertionError("the node should be serving again")
        # etcd kept the lease across its restart, so the office (bound to it) was kept:
        # the same term is taken up rather than waiting for a key that never expires
        assert again == term


async def test_with_the_real_orchestrator_three_nodes_converge_and_replicate(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    """Nodes joining one after the other: the first map, then rebalance moves (forward
    chains, takeovers) driven by cluster/orchestrator.py through the agents' reconcile."""
    ep = etcd_server.endpoint
    nvb = 8
    async with contextlib.AsyncExitStack() as stack:
        nodes: list[DcpServer] = []
        for name in ("n1", "n2", "n3"):
            nodes.append(
                await stack.enter_async_context(
                    node(
                        tmp_path,
                        ep,
                        cluster_name,
                        name,
                        run_orchestrator="real",
                        num_vbuckets=nvb,
                    )
                )
            )

        def settled() -> bool:
            agents = [n.cluster.agent for n in nodes]
            vbmap = agents[0].vbmap if agents[0] is not None else None
            if vbmap is None or len(vbmap.servers) < 3 or vbmap.forward is not None:
                return False
            if any(a is None or a.revision != agents[0].revision for a in agents):
                return False
            held = [[n.bucket.vbucket(vb).state for n in nodes] for vb in range(nvb)]
            return all(
                s.count(VBucketState.ACTIVE) == 1 and s.count(VBucketState.REPLICA) == 1
                for s in held
            )

        await until(settled, "balanced map held by the nodes", timeout=45)
        vbmap = nodes[0].cluster.agent.vbmap  # type: ignore[union-attr]
        assert vbmap is not None
        counts = vbmap.counts()
        assert sorted(a for a, _ in counts.values()) == [2, 3, 3]
        by_name = {n.config.node_name: n for n in nodes}
        pairs = [tuple(by_name[x] for x in vbmap.names(vb) if x) for vb in range(nvb)]
        for vb, (active, _replica) in enumerate(pairs):
            assert active.bucket.vbucket(vb).state == VBucketState.ACTIVE
            async with client_of(active) as c:
                await c.set_many([(k, b"v") for k in keys_for_vb(vb, 5, nvb)])
        await until(
            lambda: all(
                r.bucket.vbucket(vb).high_seqno == a.bucket.vbucket(vb).high_seqno > 0
                for vb, (a, r) in enumerate(pairs)
            ),
            "every vbucket replicated",
        )
