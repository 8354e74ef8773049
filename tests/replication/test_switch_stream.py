"""A vbucket's stream replaced on the same replication connection (a replica stream turned
into a TAKEOVER stream, as a rebalance or a graceful failover does): the old stream is
closed at the source before the new one is asked for, so the source never refuses it
(KEY_EEXISTS: a stream for that vbucket is still open on the connection)."""

from __future__ import annotations

import logging

import pytest
import trio

from dcp.producer.replication import Assignment, ReplicationManager
from dcp.producer.server import DcpServer
from dcp.protocol.opcodes import VBucketState

from .support import FakeTarget, address, source_server, wait_until

NUM_VB = 4
VBS = list(range(NUM_VB))
REPLICA, ACTIVE, DEAD = VBucketState.REPLICA, VBucketState.ACTIVE, VBucketState.DEAD


def _write(server: DcpServer, tag: bytes, n: int = 30) -> None:
    for vb in VBS:
        for i in range(n):
            server.bucket.set(vb, b"k%d-%d" % (vb, i), tag + b"-%d" % i)


def _caught_up(target: FakeTarget, server: DcpServer) -> bool:
    return all(target.high[vb] == server.bucket.vbucket(vb).high_seqno for vb in VBS)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]


async def test_a_replica_stream_turned_takeover_is_closed_first_never_refused(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dcp.replication")
    async with source_server(tmp_path / "src") as server:
        _write(server, b"one")
        target = FakeTarget(NUM_VB)
        mgr = ReplicationManager(target, backoff_initial=0.5, backoff_max=2.0)  # type: ignore[arg-type]
        src = address(server)
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            mgr.reconcile({vb: Assignment(REPLICA, src) for vb in VBS})
            await wait_until(lambda: _caught_up(target, server))
            _write(server, b"two")  # more to stream while the streams are switched
            mgr.reconcile({vb: Assignment(REPLICA, src, True) for vb in VBS})
            await wait_until(
                lambda: all(target.states[vb] == ACTIVE for vb in VBS), what="the takeovers"
            )
            n.cancel_scope.cancel()
        assert _refusals(caplog) == []
        for vb in VBS:
            assert server.bucket.vbucket(vb).state == DEAD
            # every change reached the new active (distinct keys: one seqno each)
            high = server.bucket.vbucket(vb).high_seqno
            assert [r[0] for r in target.rows(vb)] == list(range(1, high + 1))


async def test_a_stream_switched_back_and_forth_settles_on_the_last_wish(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Replica -> takeover -> replica at once (a takeover called off before it began):
    each close is waited for; the last wish is what streams, and nothing is refused."""
    caplog.set_level(logging.INFO, logger="dcp.replication")
    async with source_server(tmp_path / "src") as server:
        _write(server, b"one")
        target = FakeTarget(NUM_VB)
        mgr = ReplicationManager(target, backoff_initial=0.5, backoff_max=2.0)  # type: ignore[arg-type]
        src = address(server)
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            mgr.reconcile({vb: Assignment(REPLICA, src) for vb in VBS})
            await wait_until(lambda: _caught_up(target, server))
            mgr.reconcile({vb: Assignment(REPLICA, src, True) for vb in VBS})
            mgr.reconcile({vb: Assignment(REPLICA, src) for vb in VBS})
            _write(server, b"two")
            await wait_until(lambda: _caught_up(target, server), what="the replicas")
            info = [mgr.vbucket_info(vb) for vb in VBS]
            n.cancel_scope.cancel()
        assert _refusals(caplog) == []
        assert all(i is not None and i["stream"] == "streaming" for i in info), info
        for vb in VBS:
            assert server.bucket.vbucket(vb).state == ACTIVE
            assert target.states[vb] == REPLICA
