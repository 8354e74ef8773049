"""A takeover the orchestrator starts races the old active's own reconcile: the node reads
the forward map (or reconciles on its periodic tick) while its vbucket is being handed
over. That reconcile must leave the hand-over alone; re-activating the vbucket ended the
takeover stream after the source had gone DEAD, and the vbucket had no active copy
anywhere until the move timed out (a graceful failover of 1024 vbuckets took minutes
and failed with "moves did not finish").

Two in-process nodes on a real etcd (agent_support.py); the map is written by the test
as the orchestrator would, and the race is forced: the old active reconciles at the
moment the new one applies the hand-over's PENDING state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcp.producer.server import DcpServer
from dcp.protocol.opcodes import VBucketState
from tests.producer.conftest import client_of
from tests.producer.wire import keys_for_vb

from .agent_support import NVB, address, node, states, until, write_map
from .conftest import EtcdProcess

A, R, D, P = VBucketState.ACTIVE, VBucketState.REPLICA, VBucketState.DEAD, VBucketState.PENDING


async def _fill(server: DcpServer, vb: int, n: int) -> None:
    # the write gate closes for a moment whenever a lease keepalive is late (a loaded
    # machine): that is ETMPFAIL by design, so wait for it to be open
    agent = server.cluster.agent
    assert agent is not None
    await until(agent.writes_allowed, "the node takes writes")
    async with client_of(server) as c:
        await c.set_many([(k, b"v-" + k) for k in keys_for_vb(vb, n, NVB, "gf")])


async def test_the_old_actives_reconcile_during_a_hand_over_leaves_it_alone(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    async with (
        node(tmp_path, ep, cluster_name, "n1") as n1,
        node(tmp_path, ep, cluster_name, "n2") as n2,
    ):
        chains = [["n1", "n2"]] * NVB
        await write_map(ep, cluster_name, chains)
        await until(lambda: states(n1) == [A] * NVB and states(n2) == [R] * NVB, "first map")
        for vb in range(NVB):
            await _fill(n1, vb, 8)
        await until(
            lambda: all(n2.bucket.vbucket(vb).high_seqno == 8 for vb in range(NVB)), "replicas"
        )
        # a graceful failover of n1: every vbucket goes to its replica, n1 leaves the chains
        forward = [["n2", None]] * NVB
        rev = await write_map(ep, cluster_name, chains, forward=forward, servers=["n1", "n2"])
        agent1, agent2 = n1.cluster.agent, n2.cluster.agent
        assert agent1 is not None and agent2 is not None
        await until(lambda: agent1.revision == rev and agent2.revision == rev, "both read it")

        raced: list[int] = []
        target = n2.vbucket_states
        applied = target.set_state

        def set_state(vb: int, state: VBucketState, *, takeover: bool = False) -> Any:
            applied(vb, state, takeover=takeover)
            if takeover and state == P:  # the source is PENDING, waiting for our ack
                raced.append(vb)
                agent1.reconcile()

        target.set_state = set_state  # type: ignore[method-assign]
        for vb in range(NVB):  # the orchestrator's takeover, as rebalance.py sends it
            target.set(vb, R, {"source": address(n1), "takeover": True})
        await until(
            lambda: states(n2) == [A] * NVB and states(n1) == [D] * NVB,
            f"every vbucket handed over (n1 {states(n1)}, n2 {states(n2)})",
            timeout=10,
        )
        assert sorted(raced) == list(range(NVB))
        # a later reconcile on the same forward map keeps the handed-over copies dead
        agent1.reconcile()
        assert states(n1) == [D] * NVB
        assert all(n2.bucket.vbucket(vb).high_seqno == 8 for vb in range(NVB))
