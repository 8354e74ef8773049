"""F1 (docs/reliability.md section 6): an active resumed past its fence point must not
count what its replicas acknowledge until its lease is sure again.

The chaos run's round: n1 (active of vb 0, chain n1 n2 n3) was SIGSTOPped with seqno
1393 written but not yet replicated. n1 was failed over; the orchestrator read the
replicas' seqnos (n2 1392, n3 1392) and promoted n2. n1 was resumed before it read the
new map and sent 1393 to n3, which had not read it either; n3 acknowledged it, n1 counted
n1 + n3 as a majority and released 1393 to a stable-only consumer, which n2's branch
then rolled back. The monitor (dcp/producer/durability.py) now holds back acks that
arrive while ``trusted()`` (the server's cluster write gate) is false.

First the monitor alone, then the same round over the wire against a running server
whose write gate a test controls (the stand-in of a cluster node's lease)."""

from __future__ import annotations

from pathlib import Path

from dcp.protocol import DurabilityLevel, HelloFeature, Status, VBucketState, codec

from .conftest import client_of, running_server
from .test_durability_monitor import Node, _topo
from .test_stable_only import data_seqnos, open_dcp, quiet
from .test_sync_writes import NVB, durable_set, read_mutation, replica_of
from .wire import WireClient, keys_for_vb

L = DurabilityLevel


class Gate:
    """The lease as the monitor asks about it (``trusted``)."""

    def __init__(self) -> None:
        self.open = True

    def __call__(self) -> bool:
        return self.open


def test_acks_while_not_trusted_are_held_back_and_count_once_trusted() -> None:
    node = Node()
    m = node.monitor()
    gate = Gate()
    m.trusted = gate
    _topo(m, "A", "B", "C")
    node.high[0] = 1393
    assert m.acknowledge(0, "B", 1392, 1392, sent=1392) == ""
    assert m.majority_seqno(0) == m.stable_seqno(0) == 1392
    woken: list[int] = []
    m.wait_stable(0, 1393, lambda: woken.append(1393))
    gate.open = False  # frozen past the fence point, resumed
    why = m.acknowledge(0, "C", 1393, 1393, sent=1393)
    assert "lease may have lapsed" in why
    assert m.majority_seqno(0) == m.stable_seqno(0) == 1392, "counted while fenced"
    assert not m.satisfied(0, 1393, L.MAJORITY)
    assert woken == []
    assert m.held_back(0) == {"C": (1393, 1393)}
    m.recheck()  # still not trusted: nothing moves
    m.flushed()
    assert m.majority_seqno(0) == 1392 and woken == []
    # the lease was kept after all (or the map read after rejoining keeps vb 0 here)
    gate.open = True
    m.recheck()
    assert m.majority_seqno(0) == m.stable_seqno(0) == 1393
    assert woken == [1393]
    assert m.held_back(0) == {}


def test_held_back_acks_go_when_the_vbucket_stops_being_active_here() -> None:
    """Failed over meanwhile: the map makes the vbucket dead here before the gate opens
    again, and what was held back never counts, in this term or a later one."""
    node = Node()
    m = node.monitor()
    gate = Gate()
    m.trusted = gate
    _topo(m, "A", "B", "C")
    node.high[0] = node.high[1] = 10
    gate.open = False
    m.acknowledge(0, "C", 10, 10, sent=10)
    m.acknowledge(1, "C", 10, 10, sent=10)
    node.active[0] = False
    m.state_changed(0)
    node.active[0] = True  # active again later (a takeover back)
    m.state_changed(0)
    gate.open = True
    m.recheck()
    assert m.majority_seqno(0) == 0, "an ack of the old term counted"
    assert m.majority_seqno(1) == 10  # the other vbucket stayed active: its ack counts


def test_held_back_acks_follow_forget_and_the_chain() -> None:
    node = Node()
    m = node.monitor()
    gate = Gate()
    m.trusted = gate
    _topo(m, "A", "B", "C")
    node.high[0] = 10
    gate.open = False
    m.acknowledge(0, "B", 9, 9, sent=10)
    m.acknowledge(0, "C", 8, None, sent=10)  # no persisted seqno said: 0
    assert m.held_back(0) == {"B": (9, 9), "C": (8, 0)}
    m.forget(0, "B")  # its stream ended
    _topo(m, "A", "D", "E")  # C left the chain: kept (its stream lives), never counted
    assert m.held_back(0) == {"C": (8, 0)}
    gate.open = True
    m.recheck()
    assert m.majority_seqno(0) == 0
    # an ack once trusted also releases what another replica's ack held back
    gate.open = False
    m.acknowledge(0, "D", 7, 7, sent=10)
    gate.open = True
    assert m.acknowledge(0, "E", 5, 5, sent=10) == ""
    assert m.majority_seqno(0) == 7


def test_without_a_gate_every_ack_counts_at_once() -> None:
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B")
    node.high[0] = 3
    assert m.acknowledge(0, "B", 3, 3, sent=3) == ""
    assert m.majority_seqno(0) == 3


async def test_a_fenced_active_releases_nothing_its_replica_acks(tmp_path: Path) -> None:
    """F1 over the wire. The node is the active of every vbucket with the chain
    (self, B, C); B and C are DCP connections that say they are those nodes. The write
    gate closes (the lease may have lapsed) after a MAJORITY write is applied and before
    C acknowledges it: neither the write's answer nor a stable-only stream may move.
    Once the gate opens again (the lease was kept) the held-back ack counts."""
    async with running_server(tmp_path / "d") as server, client_of(server) as w:
        server.durability.set_topology([("self", "B", "C")] * NVB)
        await w.hello([HelloFeature.XERROR, HelloFeature.MUTATION_SEQNO])
        vb = 0
        k0, k1 = keys_for_vb(vb, 2, NVB)
        gate = Gate()
        server.write_gate = gate
        b, b_opaque = await replica_of(server, vb, name="B")
        c, c_opaque = await replica_of(server, vb, name="C")
        reader = await WireClient.connect(server.port, NVB)
        try:
            await open_dcp(reader, "stable-reader", stable_only=True)
            assert (await reader.stream_req(vb, opaque=9)).status == Status.SUCCESS
            assert (await w.set(k0, b"1")).status == Status.SUCCESS  # seqno 1
            for replica, opaque in ((b, b_opaque), (c, c_opaque)):
                await read_mutation(replica, 1)
                await replica.send(codec.seqno_acknowledged(vb, opaque, 1, 1))
            assert data_seqnos(await quiet(reader)) == [1]  # stable: n1 + B + C
            op, frame = durable_set(w, k1, L.MAJORITY, 30_000, value=b"2")
            await w.send(frame)  # seqno 2: applied, its answer waits
            await read_mutation(c, 2)
            gate.open = False  # frozen past the fence point; failed over meanwhile
            await c.send(codec.seqno_acknowledged(vb, c_opaque, 2, 2))
            assert not await w.frames_for(0.5), "a fenced node answered a MAJORITY write"
            assert server.durability.majority_seqno(vb) == 1
            assert server.durability.stable_seqno(vb) == 1
            assert data_seqnos(await quiet(reader)) == [], "sent above what failover keeps"
            assert server.durability.held_back(vb) == {"C": (2, 2)}
            # the lease turned out kept: the next event counts the ack held back
            gate.open = True
            server.durability.recheck()
            r = await w.next_frame(5)
            assert (r.opaque, r.status) == (op, Status.SUCCESS)
            assert data_seqnos(await quiet(reader)) == [2]
            assert server.durability.stable_seqno(vb) == 2
        finally:
            for client in (b, c, reader):
                await client.aclose()
            server.write_gate = None


async def test_a_fenced_active_answers_a_waiting_write_ambiguous_when_failed_over(
    tmp_path: Path,
) -> None:
    """The same round to its end: the map then makes the vbucket a replica here; the
    write is ambiguous (never ok), and the ack held back never counts."""
    async with running_server(tmp_path / "d") as server, client_of(server) as w:
        server.durability.set_topology([("self", "B", "C")] * NVB)
        await w.hello([HelloFeature.XERROR, HelloFeature.MUTATION_SEQNO])
        vb = 1
        (k,) = keys_for_vb(vb, 1, NVB)
        gate = Gate()
        server.write_gate = gate
        c, c_opaque = await replica_of(server, vb, name="C")
        try:
            op, frame = durable_set(w, k, L.MAJORITY, 30_000)
            await w.send(frame)
            await read_mutation(c, 1)
            gate.open = False
            await c.send(codec.seqno_acknowledged(vb, c_opaque, 1, 1))
            assert not await w.frames_for(0.4)
            server.vbucket_states.set(vb, VBucketState.REPLICA, {})  # the new map
            r = await w.next_frame(5)
            assert (r.opaque, r.status) == (op, Status.SYNC_WRITE_AMBIGUOUS), r
            assert server.durability.held_back(vb) == {}
            server.vbucket_states.set(vb, VBucketState.ACTIVE, {})  # given back later
            gate.open = True
            server.durability.recheck()
            assert server.durability.majority_seqno(vb) == 0
        finally:
            await c.aclose()
            server.write_gate = None
