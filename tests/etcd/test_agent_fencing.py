"""The write gate of a cluster node against a real etcd of the test's own: a frozen event
loop, etcd stopped and restarted, a lease that lapsed while the node was failed over."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import trio

from dcp.producer.cluster.store import EtcdStore
from dcp.protocol import Opcode, Status, codec
from dcp.protocol.opcodes import VBucketState
from tests.producer.conftest import client_of
from tests.producer.wire import keys_for_vb

from .agent_support import NVB, node, states, until, write_map
from .conftest import EtcdProcess

A, R, D = (
    VBucketState.ACTIVE,
    VBucketState.REPLICA,
    VBucketState.DEAD,
)
KEY = keys_for_vb(0, 1, NVB)[0]


async def test_a_frozen_node_refuses_writes_before_its_watchdog_runs(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    async with node(tmp_path, ep, cluster_name, "n1", cluster_lease_ttl=2) as n1:
        await write_map(ep, cluster_name, [["n1"]] * NVB, num_replicas=0)
        agent = n1.cluster.agent
        assert agent is not None
        await until(agent.writes_allowed, "the map names n1")
        gate = n1.write_gate
        assert gate is not None and gate()
        # freeze the whole event loop past the fence point (as SIGSTOP would): no task of
        # the node runs, yet the gate it answers with is already closed
        time.sleep(agent.membership.lease_ttl - agent.membership.fence_margin + 0.3)
        assert not agent.membership.fenced  # the watchdog has not run...
        assert not gate()  # ...but a request served now would be refused
        # once the loop runs: the lease was still alive at etcd, so writes come back
        await until(gate, "gate open again", timeout=20)
        await until(lambda: states(n1) == [A] * NVB, "active again")
        async with client_of(n1) as c:
            await c.set(KEY, b"after")


async def test_etcd_away_fences_keeps_the_map_and_recovers(
    etcd_factory: Callable[[], EtcdProcess], tmp_path: Path
) -> None:
    etcd = etcd_factory()
    ep = etcd.endpoint
    async with node(tmp_path, ep, "c", "n1", cluster_lease_ttl=2) as n1:
        rev = await write_map(ep, "c", [["n1"]] * NVB, num_replicas=0)
        agent = n1.cluster.agent
        assert agent is not None
        await until(lambda: agent.revision == rev and agent.writes_allowed(), "map read")
        async with client_of(n1) as c:
            await c.set(KEY, b"before")
            branches = list(n1.bucket.vbucket(0).failover_log.entries)
            etcd.stop()
            t0 = trio.current_time()
            await until(lambda: agent.fenced, "fenced", timeout=10)
            # before the lease could have expired at etcd (TTL >= 2 s after the last keepalive)
            assert trio.current_time() - t0 < agent.membership.lease_ttl
            # a fence is the gate only: states, streams and history stay as they are
            assert states(n1) == [A] * NVB
            assert n1.bucket.vbucket(0).failover_log.entries == branches
            r = await c.store(Opcode.SET, KEY, b"during")
            assert r.status == Status.ETMPFAIL
            r = await c.delete(KEY)
            assert r.status == Status.ETMPFAIL
            # the last map still answers clients; reads of the data still work
            r = await c.call(codec.request(Opcode.GET_CLUSTER_CONFIG, opaque=4), 4)
            assert r.status == Status.SUCCESS and b'"rev":%d' % rev in bytes(r.value)
            stats = await c.stats("cluster")
            assert (stats["fenced"], stats["writes_allowed"], stats["map_rev"]) == (
                "true",
                "false",
                str(rev),
            )
            await until(lambda: not agent.etcd_reachable, "etcd seen away")
            await trio.to_thread.run_sync(etcd.start)
            await until(lambda: agent.writes_allowed() and states(n1) == [A] * NVB, "back", 30)
            # the lease was kept: no new history branch, so no consumer is sent to roll back
            assert n1.bucket.vbucket(0).failover_log.entries == branches
            await c.set(KEY, b"after")
            r = await c.get(KEY)
            assert bytes(r.value) == b"after"


async def test_a_lapsed_lease_waits_for_the_map_and_never_reactivates_failed_over_vbuckets(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    async with (
        node(tmp_path, ep, cluster_name, "n1", cluster_lease_ttl=2) as n1,
        node(tmp_path, ep, cluster_name, "n2", cluster_lease_ttl=2) as n2,
    ):
        await write_map(ep, cluster_name, [["n1", "n2"]] * NVB)
        await until(lambda: states(n1) == [A] * NVB and states(n2) == [R] * NVB, "first map")
        agent = n1.cluster.agent
        assert agent is not None
        # n1's lease goes (as if it had been away past its TTL) and, at once, the map fails
        # it over: n2 active, n1 in no chain
        store = EtcdStore(ep)
        try:
            await store.revoke_lease(agent.membership.lease)
            rev = await write_map(ep, cluster_name, [["n2", None]] * NVB, servers=["n1", "n2"])
        finally:
            await store.aclose()
        old_lease = agent.membership.lease
        seen: list[tuple[bool, list[VBucketState]]] = []
        gate = n1.write_gate
        assert gate is not None
        with trio.fail_after(20):  # registered again, resumed with the failover map
            while not (
                agent.membership.lease != old_lease
                and agent.revision == rev
                and agent.writes_allowed()
            ):
                seen.append((gate(), states(n1)))
                await trio.sleep(0.005)
        assert states(n1) == [D] * NVB and states(n2) == [A] * NVB
        # from the moment n1 noticed, its gate was never open while it held an active
        # vbucket: no write could land on a vbucket the map had given to n2
        first_fenced = next((i for i, (open_, _) in enumerate(seen) if not open_), 0)
        assert not [s for open_, s in seen[first_fenced:] if open_ and A in s], seen
        async with client_of(n1) as c:
            r = await c.store(Opcode.SET, KEY, b"v")
            assert r.status == Status.NOT_MY_VBUCKET and b'"rev":%d' % rev in bytes(r.value)


async def test_a_state_changed_outside_the_map_is_put_back_without_a_map_change(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    """A stale SET_VBUCKET_STATE (say, from an orchestrator deposed mid-command) is undone
    by the node's periodic reconcile, not left until the next map change."""
    ep = etcd_server.endpoint
    async with node(tmp_path, ep, cluster_name, "n1") as n1:
        rev = await write_map(ep, cluster_name, [["n1"]] * NVB, num_replicas=0)
        agent = n1.cluster.agent
        assert agent is not None
        await until(lambda: agent.revision == rev and states(n1) == [A] * NVB, "map applied")
        n1.vbucket_states.set(0, VBucketState.DEAD, {})
        assert states(n1)[0] == D
        await until(lambda: states(n1) == [A] * NVB, "vb 0 active again", timeout=10)
        assert agent.revision == rev  # no map change was needed
