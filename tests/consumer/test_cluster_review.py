"""Regressions of the cluster-aware DcpClient (issue 16 review): a replica is chosen only
when it has the client's resume point and is kept while it still qualifies; ``to_latest``
ends where the surviving history ends after a failover lost the tail; purged batches are
acknowledged on the connection that sent them; a refresh asks on until a node has a newer
map; a timed-out request leaves nothing behind; the "refresh failed" warning is
rate-limited."""

from __future__ import annotations

import logging

import trio
import trio.testing

from dcp.consumer import DcpClient, Offset, RollbackEvent, SnapshotBatch
from dcp.consumer.connection import DcpConnection
from dcp.consumer.delivery import Delivery
from dcp.consumer.positions import Session
from dcp.consumer.routing import pick
from dcp.protocol.cluster_config import ClusterConfig

from .fake_producer import FakeProducer
from .test_cluster_client import client, keys, nodes, serve
from .test_cluster_routing import A, B, C, config_json

HOST = "127.0.0.1"


# ---------------------------------------------------------------- replicas and resume points


def test_a_replica_below_the_resume_point_is_not_picked() -> None:
    c = ClusterConfig.from_json(config_json(3, [A, B, C], [[0, 1, 2]]))
    active, replica = {0: 20}, {B: {0: 15}, C: {0: 19}}
    kw = {"prefer_replica": True, "max_lag": 1000, "active_high": active}
    assert pick(c, 0, replica_high=replica, resume=10, **kw) == C  # both have 10
    assert pick(c, 0, replica_high=replica, resume=18, **kw) == C  # only C has 18
    # neither has 20: the active (a replica would answer ROLLBACK though nothing was lost)
    assert pick(c, 0, replica_high=replica, resume=20, **kw) == A
    assert pick(c, 0, replica_high=replica, resume=16, current=B, **kw) == C


def test_the_replica_streaming_is_kept_while_it_qualifies() -> None:
    c = ClusterConfig.from_json(config_json(3, [A, B, C], [[0, 1, 2]]))
    active = {0: 5000}
    kw = {"prefer_replica": True, "max_lag": 1000, "active_high": active, "resume": 100}
    # C is more current, but B (streaming) is still within the lag and has the resume point
    assert pick(c, 0, current=B, replica_high={B: {0: 4200}, C: {0: 4990}}, **kw) == B
    # B fell out of the lag: the most current qualifying one
    assert pick(c, 0, current=B, replica_high={B: {0: 3000}, C: {0: 4990}}, **kw) == C


async def test_a_replica_behind_the_committed_position_causes_no_rollback() -> None:
    async with FakeProducer() as a, FakeProducer() as b:
        a.vb(0).add_mutations(20)
        b.vb(0).add_mutations(15)  # the replica copy, 5 behind (same branch)
        serve([[0, 1]], 5, a, b)
        # the application committed seqno 18, read from the active earlier
        saved = {0: Offset(0, 0xA000, 18, 18, 18, ((0xA000, 0),))}
        got: list = []
        with trio.fail_after(20):
            async with client(nodes(a, b), offsets=saved, prefer_replica=True) as c:
                while len(keys(got, 0)) < 2:
                    got.append(await c.__anext__())
                await trio.sleep(0.5)  # a few polls: nothing moves to the replica
        assert not any(isinstance(i, RollbackEvent) for i in got)
        assert b.stream_requests == []
        assert [(r.vbucket, r.start) for r in a.stream_requests] == [(0, 18)]


# ---------------------------------------------------------------- flow control after a move


async def test_purged_bytes_of_a_moved_vbucket_are_acked_on_their_connection() -> None:
    """vb 1 moves from c to b while c's window is full of vb 1's queued batches: the new
    stream purges them, and c must get their ack at once, or vb 2 (still on c) stalls
    until c's next receive (a noop: up to 120 s)."""
    async with FakeProducer() as a, FakeProducer() as b, FakeProducer() as c:
        a.vb(0)
        c.vb(1).add_mutations(300, per_snapshot=10, value=b"x" * 200)  # fills c's window
        c.vb(2)  # idle for now
        b.vb(1).add_mutations(300, per_snapshot=10, value=b"x" * 200)
        serve([[0], [2], [2], [0]], 5, a, b, c)
        got: list = []
        async with client(nodes(a, b, c), buffer_size=8192) as cl:
            with trio.fail_after(10):
                while c.max_outstanding < 8192:  # the application reads nothing yet
                    await trio.sleep(0.05)
                await trio.sleep(0.3)
                serve([[0], [1], [2], [0]], 6, a, b, c)  # vb 1: c -> b (a poll finds it)
                while not b.requests_for(1):
                    await trio.sleep(0.05)
            await trio.sleep(0.3)
            c.vb(2).add_mutations(5)
            c.wake_all()
            with trio.fail_after(5):
                while len(keys(got, 2)) < 5:
                    got.append(await cl.__anext__())
        assert sum(c.acks) >= 8192 * 0.8  # the purged bytes, acked on c


# ---------------------------------------------------------------- to_latest after a failover


def test_the_end_is_lowered_to_where_a_copy_branched_off() -> None:
    s = Session({0: Offset.beginning(0), 1: Offset.beginning(1)})
    for vb in (0, 1):
        s[vb].end_seqno, s[vb].end_log = 20, ((0xA0, 0),)
    assert s.clamp_end(0, [(0xA0, 0)]) == 20  # the same history
    assert s.clamp_end(0, [(0xB0, 25), (0xA0, 0)]) == 20  # a failover above the end
    assert s.clamp_end(0, [(0xC0, 30), (0xB0, 15), (0xA0, 0)]) == 15  # lost 16..20
    assert s.clamp_end(1, [(0xD0, 0)]) == 0  # nothing survived
    plain = Session({0: Offset.beginning(0)})  # no reference log: never lowered
    plain[0].end_seqno = 20
    assert plain.clamp_end(0, [(0xB0, 15)]) == 20


async def test_to_latest_ends_after_a_failover_that_lost_the_tail() -> None:
    """The end (20) was read from a; a fails over to b, whose branch (0xB0 at 15) lost
    16..20: the stream on b must end at 15 instead of waiting for seqnos that never come."""
    async with FakeProducer() as a, FakeProducer() as b:
        a.vb(0).add_mutations(20, per_snapshot=5)
        hb = b.vb(0)
        hb.add_mutations(15, per_snapshot=5)
        hb.failover(0xB0, at=15)
        serve([[0, 1]], 5, a, b)
        a.fault(0, 6, "silence")  # a sends 1..5 and then nothing
        got: list = []
        with trio.fail_after(10):
            async with client(nodes(a, b), to_latest=True, retry_timeout=30) as c:
                async for item in c:
                    got.append(item)
                    if len(got) == 1:  # the failover: b is the active now
                        serve([[1, 0]], 6, a, b)
                        a.vbs.clear()
                        await a.drop_connections()
        got_keys = keys(got, 0)
        assert b"k0-15" in got_keys and b"k0-16" not in got_keys
        assert [x.end for x in got if isinstance(x, SnapshotBatch)][-1] == 15
        assert b.stream_requests[-1].end == 15  # asked again with the lowered end


async def test_to_latest_ends_after_a_rollback_to_the_surviving_history() -> None:
    """The client committed 18 from a; b (the new active) lost 16..20: ROLLBACK to 15,
    then the stream on b ends there (end lowered from 20 to b's branch point)."""
    async with FakeProducer() as a, FakeProducer() as b:
        a.vb(0).add_mutations(20, per_snapshot=1)
        hb = b.vb(0)
        hb.add_mutations(15, per_snapshot=1)
        hb.failover(0xB0, at=15)
        serve([[0, 1]], 5, a, b)
        a.fault(0, 19, "silence")
        got: list = []
        with trio.fail_after(10):
            async with client(nodes(a, b), to_latest=True, retry_timeout=30) as c:
                async for item in c:
                    got.append(item)
                    await c.commit(item)
                    if isinstance(item, SnapshotBatch) and item.end == 18:
                        serve([[1, 0]], 6, a, b)
                        a.vbs.clear()
                        await a.drop_connections()
        rollbacks = [x for x in got if isinstance(x, RollbackEvent)]
        assert [(r.seqno, r.rollback_seqno) for r in rollbacks] == [(18, 15)]
        assert b.stream_requests[-1].end == 15


# ---------------------------------------------------------------- config refresh


async def test_a_refresh_asks_past_a_stale_and_a_silent_node_for_a_newer_map() -> None:
    """a (linked, answers first) still has rev 5; the map's second server accepts and never
    answers; b has rev 6, which moves vb 0 to b. The poll must reach b, each node bounded
    by a short limit (not connect_timeout, 10 s)."""
    silent = (await trio.open_tcp_listeners(0, host=HOST))[0]  # never accepts: HELLO hangs
    silent_addr = (HOST, silent.socket.getsockname()[1])
    async with FakeProducer() as a, FakeProducer() as b, silent:
        a.vb(0).add_mutations(3)
        b.vb(0).add_mutations(3)
        servers = [(HOST, a.port), silent_addr, (HOST, b.port)]
        a.cluster_config = config_json(5, servers, [[0]])
        got: list = []
        async with client(nodes(a), cluster=True, connect_timeout=10) as c:
            with trio.fail_after(5):
                while len(keys(got, 0)) < 3:
                    got.append(await c.__anext__())
            b.cluster_config = config_json(6, servers, [[2]])
            with trio.fail_after(4):  # one refresh: a (stale), silent (<= 1 s), b
                while not b.requests_for(0):
                    await trio.sleep(0.05)
            assert c.statistics()["config_rev"] == 6


async def test_a_request_that_timed_out_leaves_no_waiter_behind() -> None:
    ours, _theirs = trio.testing.memory_stream_pair()  # the peer never answers
    cfg = DcpClient(HOST, 1)._cfg
    conn = DcpConnection(ours, cfg, Delivery(), DcpClient(HOST, 1).commit, {}, {})
    with trio.move_on_after(0.1) as cs:
        await conn.get_cluster_config()
    assert cs.cancelled_caught
    assert conn.pending_requests == 0


async def _serve_until_cancelled(
    p: FakeProducer, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.CancelScope() as scope:
        async with p:
            task_status.started(scope)
            await trio.sleep_forever()


async def test_the_refresh_failed_warning_is_rate_limited(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="dcp.consumer.cluster")
    a, b = FakeProducer(), FakeProducer()
    async with trio.open_nursery() as nursery:
        scopes = [await nursery.start(_serve_until_cancelled, p) for p in (a, b)]
        a.vb(0).add_mutations(2)
        b.vb(1).add_mutations(2)
        serve([[0], [1]], 5, a, b)
        got: list = []
        async with client(nodes(a, b), retry_timeout=30) as c:
            with trio.fail_after(5):
                while len(keys(got, 0)) + len(keys(got, 1)) < 4:
                    got.append(await c.__anext__())
            for p, scope in zip((a, b), scopes, strict=True):
                await p.drop_connections()  # every node gone: each refresh fails
                scope.cancel()
            await trio.sleep(2)
            fetches = c.statistics()["config_refreshes"]
    warnings = [r for r in caplog.records if "refresh failed" in r.getMessage()]
    assert fetches >= 5  # it did try again and again
    assert len(warnings) == 1
