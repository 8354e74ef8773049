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
