"""Replication from a real in-process source server into an in-memory target: exact
items and snapshots, failover log adopted, resume, rollback, reconnect mid-snapshot."""

from __future__ import annotations

import logging
import time

import trio

from dcp.producer.engine.item import Item
from dcp.producer.replication import Assignment, ReplicationManager
from dcp.producer.server import DcpServer
from dcp.protocol.opcodes import VBucketState

from .support import (
    FakeTarget,
    Proxy,
    address,
    item_row,
    latest,
    oracle,
    source_server,
    wait_until,
)

NUM_VB = 4
VBS = list(range(NUM_VB))
REPLICA = VBucketState.REPLICA


def write_mix(server: DcpServer, tag: bytes, n: int = 40) -> None:
    """Sets with flags, expiry and JSON, overwrites, deletions and one expiration per vb."""
    b = server.bucket
    far = int(time.time()) + 3600
    for vb in VBS:
        for i in range(n):
            b.set(vb, b"k%d-%d" % (vb, i), tag + b"-%d" % i, flags=i, expiry=far if i % 3 else 0)
        b.set(vb, b"json%d" % vb, b'{"a":%d}' % vb, datatype=1)
        b.delete(vb, b"k%d-1" % vb)
        b.set(vb, b"k%d-2" % vb, tag + b"-again", flags=77)
        b.set(vb, b"short%d" % vb, b"gone soon", expiry=int(time.time()) + 1)
    assert b.expire(time.time() + 10) >= NUM_VB


def caught_up(target: FakeTarget, server: DcpServer) -> bool:
    return all(target.high[vb] == server.bucket.vbucket(vb).high_seqno for vb in VBS)


def assert_whole_snapshots(target: FakeTarget, expected: dict[int, list[tuple]]) -> None:
    """Each applied snapshot holds exactly the source's changes in its range: nothing
    missing, nothing half, nothing twice."""
    for vb in VBS:
        prev = 0
        for start, end, _flags, items in target.snapshots[vb]:
            want = [r for r in expected[vb] if max(prev, start - 1) < r[0] <= end]
            assert [item_row(i) for i in items] == want, (vb, start, end)
            prev = end


def manager(target: FakeTarget, **kw: object) -> ReplicationManager:
    kw.setdefault("backoff_initial", 0.05)
    kw.setdefault("backoff_max", 0.5)
    return ReplicationManager(target, **kw)  # type: ignore[arg-type]


def all_replicas(server: DcpServer) -> dict[int, Assignment]:
    return {vb: Assignment(REPLICA, address(server)) for vb in VBS}


async def test_replica_gets_the_sources_exact_items_in_whole_snapshots(tmp_path):
    async with source_server(tmp_path / "src") as server:
        write_mix(server, b"one")
        target = FakeTarget(NUM_VB)
        mgr = manager(target)
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            mgr.reconcile(all_replicas(server))
            await wait_until(lambda: caught_up(target, server))
            expected = await oracle(server, VBS)
            for vb in VBS:
                assert target.rows(vb) == expected[vb]
                assert target.failover[vb] == server.bucket.vbucket(vb).failover_log.entries
            assert_whole_snapshots(target, expected)
            kinds = {r[1] for vb in VBS for r in target.rows(vb)}
            assert kinds == {0x57, 0x58, 0x59}  # mutations, deletions, expirations
            assert target.set_calls() == [("set_state", vb, REPLICA, False) for vb in VBS]
            assert not target.refused
            # the connection's name, as ns_server names replication connections
            names = {c.dcp_name for c in server.connections}
            assert f"replication:{address(server)}->{target.node_name}:default" in names
            st = mgr.stats()
            src = st["sources"][address(server)]
            assert src["connected"] is True
            assert src["items_applied"] == sum(len(target.items[vb]) for vb in VBS)
            assert src["snapshots_applied"] == sum(len(target.snapshots[vb]) for vb in VBS)
            assert src["bytes_received"] > 0 and src["reconnects"] == 0
            info = mgr.vbucket_info(0)
            assert info is not None and info["lag"] == 0 and info["stream"] == "streaming"
            assert info["source_seqno"] == info["high_seqno"] == target.high[0]
            # live: later writes follow, the latest version of every key matches
            write_mix(server, b"two", n=60)
            await wait_until(lambda: caught_up(target, server))
            expected = await oracle(server, VBS)
            for vb in VBS:
                assert latest(target.rows(vb)) == latest(expected[vb])
            n.cancel_scope.cancel()


async def test_resume_from_the_replicas_position_without_duplicates(tmp_path):
    async with source_server(tmp_path / "src") as server:
        write_mix(server, b"one")
        target = FakeTarget(NUM_VB)
        async with trio.open_nursery() as n:
            mgr = manager(target)
            await n.start(mgr.run)
            mgr.reconcile(all_replicas(server))
            await wait_until(lambda: caught_up(target, server))
            n.cancel_scope.cancel()
        before = {vb: target.high[vb] for vb in VBS}
        write_mix(server, b"two", n=10)
        async with trio.open_nursery() as n:
            mgr = manager(target)
            await n.start(mgr.run)
            mgr.reconcile(all_replicas(server))
            await wait_until(lambda: caught_up(target, server))
            n.cancel_scope.cancel()
        for vb in VBS:
            seqnos = [r[0] for r in target.rows(vb)]
            assert seqnos == sorted(set(seqnos))  # nothing twice
            # the second run started where the first ended
            later = [s for s in target.snapshots[vb] if s[1] > before[vb]]
            assert later and all(i.seqno > before[vb] for s in later for i in s[3])
        expected = await oracle(server, VBS)
        for vb in VBS:
            assert latest(target.rows(vb)) == latest(expected[vb])
        assert not [c for c in target.calls if c[0] == "rollback"]


async def test_rollback_to_the_sources_answer_then_stream_again(tmp_path):
    async with source_server(tmp_path / "src") as server:
        write_mix(server, b"one", n=10)
        target = FakeTarget(NUM_VB)
        async with trio.open_nursery() as n:
            mgr = manager(target)
            await n.start(mgr.run)
            mgr.reconcile(all_replicas(server))
            await wait_until(lambda: caught_up(target, server))
            n.cancel_scope.cancel()
        h0 = target.high[0]
        # vb 0: a tail the source never had (same uuid: the source answers ROLLBACK to
        # its high seqno); vb 1: a history the source does not know (ROLLBACK to 0)
        tail = [target.items[0][-1]]
        target.apply_snapshot(0, h0 + 1, h0 + 3, 1, [_moved(tail[0], h0 + 1)])
        target.apply_snapshot(0, h0 + 4, h0 + 4, 1, [_moved(tail[0], h0 + 4)])
        target.failover[1] = [(0x1234, 0)]
        async with trio.open_nursery() as n:
            mgr = manager(target)
            await n.start(mgr.run)
            mgr.reconcile(all_replicas(server))
            await wait_until(lambda: caught_up(target, server))
            write_mix(server, b"two", n=5)
            await wait_until(lambda: caught_up(target, server))
            stats = mgr.stats()["sources"][address(server)]
            n.cancel_scope.cancel()
        rollbacks = [c for c in target.calls if c[0] == "rollback"]
        assert sorted(rollbacks) == [("rollback", 0, h0), ("rollback", 1, 0)]
        assert stats["rollbacks"] == 2
        expected = await oracle(server, VBS)
        for vb in VBS:
            assert latest(target.rows(vb)) == latest(expected[vb])
            assert target.failover[vb] == server.bucket.vbucket(vb).failover_log.entries
        assert all(r[0] <= server.bucket.vbucket(0).high_seqno for r in target.rows(0))


def _moved(it: Item, seqno: int) -> Item:
    """A made-up change at ``seqno`` (a tail the source never had)."""
    return Item(it.vbucket, seqno, it.rev_seqno, it.cas, 0, 0, 0, b"ghost", b"x", 0x57, 0, b"")


async def test_a_connection_cut_mid_snapshot_applies_nothing_of_it_and_resumes(tmp_path, caplog):
    async with source_server(tmp_path / "src", num_vbuckets=1) as server:
        b = server.bucket
        for i in range(3000):
            b.set(0, b"key-%05d" % i, b"v" * 50, flags=i)
        target = FakeTarget(1)
        async with Proxy(server.port).running() as proxy:
            proxy.cut_after = 40_000  # well inside the first snapshot (~250 KB)
            mgr = manager(target, open_stream=proxy.open_stream)
            async with trio.open_nursery() as n:
                await n.start(mgr.run)
                mgr.reconcile({0: Assignment(REPLICA, address(server))})
                await wait_until(lambda: target.high[0] == b.vbucket(0).high_seqno)
                stats = mgr.stats()["sources"][address(server)]
                n.cancel_scope.cancel()
        assert proxy.cuts == 1 and proxy.connections >= 2
        assert stats["reconnects"] >= 1
        expected = await oracle(server, [0])
        assert target.rows(0) == expected[0]
        prev = 0
        for start, end, _f, items in target.snapshots[0]:
            want = [r for r in expected[0] if max(prev, start - 1) < r[0] <= end]
            assert [item_row(i) for i in items] == want
            prev = end
        assert not target.refused
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
