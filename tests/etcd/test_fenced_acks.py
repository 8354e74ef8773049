"""F1 end to end (docs/reliability.md section 6) against a real etcd and a real cluster
agent: an active frozen past its fence point (as by SIGSTOP) and failed over meanwhile
must not count the acks that reach it once it runs again, before it reads the map.

The node n1 is the active of every vbucket with the chain (n1, B, C); B and C are DCP
connections that say they are those nodes (as a replica's replication connection does),
and a stable-only stream reads vb 0. A MAJORITY write reaches C only; C's ack of it is
put in n1's socket just before the freeze, so n1 reads it when it runs again, exactly as
in the chaos round, while etcd already holds the map that failed n1 over."""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.request
from pathlib import Path

import trio

from dcp.producer.cluster.election import map_key
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.protocol import DurabilityLevel, HelloFeature, Status, codec
from dcp.protocol.opcodes import VBucketState
from tests.producer.conftest import client_of
from tests.producer.test_stable_only import data_seqnos, open_dcp, quiet
from tests.producer.test_sync_writes import durable_set, read_mutation, replica_of
from tests.producer.wire import WireClient, keys_for_vb

from .agent_support import NVB, node, states, until, write_map
from .conftest import EtcdProcess

SERVERS = ["n1", "B", "C"]
VB = 0


def put_now(endpoint: str, key: str, value: bytes) -> None:
    """A blocking etcd put: made while the event loop is frozen, as an orchestrator
    elsewhere writes while the node is stopped."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    body = json.dumps({"key": b64(key.encode()), "value": b64(value)}).encode()
    req = urllib.request.Request(f"{endpoint}/v3/kv/put", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as answer:
        assert answer.status == 200


def send_now(client: WireClient, data: bytes) -> None:
    """Put ``data`` in the connection's socket without a trio checkpoint: the node cannot
    read it before the loop is frozen (a small write to a fresh loopback socket never
    blocks)."""
    assert os.write(client.stream.socket.fileno(), data) == len(data)


async def setup(n1, w: WireClient):  # type: ignore[no-untyped-def]
    """B and C streaming vb 0, a stable-only reader at seqno 1, a MAJORITY write at seqno 2
    applied and sent to C only; returns (b, c, c_opaque, reader, write opaque)."""
    await w.hello([HelloFeature.XERROR, HelloFeature.MUTATION_SEQNO])
    k1, k2 = keys_for_vb(VB, 2, NVB)
    b, b_opaque = await replica_of(n1, VB, name="B")
    c, c_opaque = await replica_of(n1, VB, name="C")
    reader = await WireClient.connect(n1.port, NVB)
    await open_dcp(reader, "stable-reader", stable_only=True)
    assert (await reader.stream_req(VB, opaque=9)).status == Status.SUCCESS
    assert (await w.set(k1, b"1")).status == Status.SUCCESS
    for replica, opaque in ((b, b_opaque), (c, c_opaque)):
        await read_mutation(replica, 1)
        await replica.send(codec.seqno_acknowledged(VB, opaque, 1, 1))
    assert data_seqnos(await quiet(reader)) == [1]
    op, frame = durable_set(w, k2, DurabilityLevel.MAJORITY, 30_000, value=b"2")
    await w.send(frame)
    await read_mutation(c, 2)
    assert not await w.frames_for(0.2)  # B has not acked: no majority yet
    return b, c, c_opaque, reader, op


def freeze_past_fence(agent, extra: float) -> None:  # type: ignore[no-untyped-def]
    """Block the whole event loop until ``extra`` seconds past the fence point."""
    time.sleep(max(0.0, agent.membership.fence_at - trio.current_time()) + extra)


async def test_acks_reaching_a_resumed_failed_over_active_release_nothing(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    async with node(tmp_path, ep, cluster_name, "n1", cluster_lease_ttl=2) as n1:
        await write_map(ep, cluster_name, [SERVERS] * NVB, num_replicas=2, servers=SERVERS)
        agent = n1.cluster.agent
        assert agent is not None
        await until(agent.writes_allowed, "the map names n1")
        async with client_of(n1) as w:
            b, c, c_opaque, reader, op = await setup(n1, w)
            try:
                failed_over = VBucketMap.from_names(2, [["C", "B", None]] * NVB, servers=["B", "C"])
                send_now(c, codec.seqno_acknowledged(VB, c_opaque, 2, 2))
                # frozen until the lease has expired at etcd; the orchestrator (elsewhere)
                # read B and C at seqno 1 and promoted C... as far as n1 can know
                freeze_past_fence(agent, agent.membership.fence_margin + 1.0)
                put_now(ep, map_key(cluster_name), failed_over.to_json())
                # n1 runs again: it reads C's ack before it learns it was failed over
                r = await w.next_frame(20)
                assert r.opaque == op
                assert r.status == Status.SYNC_WRITE_AMBIGUOUS, "a MAJORITY write answered ok"
                assert 2 not in data_seqnos(await quiet(reader, 0.5)), "a stable-only read of 2"
                await until(lambda: states(n1) == [VBucketState.DEAD] * NVB, "failed over")
            finally:
                for client in (b, c, reader):
                    await client.aclose()


async def test_acks_held_back_while_frozen_count_once_the_lease_is_sure(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    """No failover this time: frozen just past the fence point, the node keeps its
    lease (or registers again and reads a map that still makes it active), and the ack
    held back answers the write, with nothing more from any replica."""
    ep = etcd_server.endpoint
    async with node(tmp_path, ep, cluster_name, "n1", cluster_lease_ttl=2) as n1:
        await write_map(ep, cluster_name, [SERVERS] * NVB, num_replicas=2, servers=SERVERS)
        agent = n1.cluster.agent
        assert agent is not None
        await until(agent.writes_allowed, "the map names n1")
        async with client_of(n1) as w:
            b, c, c_opaque, reader, op = await setup(n1, w)
            try:
                send_now(c, codec.seqno_acknowledged(VB, c_opaque, 2, 2))
                freeze_past_fence(agent, 0.2)
                r = await w.next_frame(20)
                assert (r.opaque, r.status) == (op, Status.SUCCESS)
                assert n1.durability.held_back(VB) == {}
                assert data_seqnos(await quiet(reader)) == [2]
            finally:
                for client in (b, c, reader):
                    await client.aclose()
