"""The cluster-aware DcpClient against scripted nodes (``fake_producer.py``): one
connection per node, buffer acks per connection, moves on NOT_MY_VBUCKET (with the answer's
config), on a config poll and on a lost node, rollbacks only where a branch diverged,
bounded retries against a stale node, and one error naming every address when no node
answers."""

from __future__ import annotations

import logging

import pytest
import trio

from dcp.consumer import (
    DcpClient,
    NoNodeAnsweredError,
    Offset,
    RetryTimeoutError,
    RollbackEvent,
    SnapshotBatch,
)
from dcp.protocol.errors import StatusError
from dcp.protocol.opcodes import Status

from .conftest import drain
from .fake_producer import FakeProducer
from .test_cluster_routing import config_json

HOST = "127.0.0.1"


def nodes(*ps: FakeProducer) -> list[tuple[str, int]]:
    return [(HOST, p.port) for p in ps]


def serve(chains: list[list[int]], rev: int, *ps: FakeProducer) -> bytes:
    """Every node of ``ps`` answers this config (servers in that order)."""
    doc = config_json(rev, nodes(*ps), chains)
    for p in ps:
        p.cluster_config = doc
    return doc


def client(host, **kw) -> DcpClient:
    kw.setdefault("noop_interval", None)
    kw.setdefault("retry_timeout", 10.0)
    kw.setdefault("config_poll_interval", 0.2)
    return DcpClient(host, **kw)


def keys(items: list, vb: int) -> list[bytes]:
    return [
        bytes(e.key) for b in items if isinstance(b, SnapshotBatch) and b.vbucket == vb for e in b
    ]


@pytest.fixture
async def two():
    async with FakeProducer() as a, FakeProducer() as b:
        yield a, b


async def test_each_node_streams_its_vbuckets_and_gets_its_own_buffer_acks(two) -> None:
    a, b = two
    for p, vb in ((a, 0), (b, 1)):
        p.vb(vb).add_mutations(300, per_snapshot=10, value=b"x" * 200)
    serve([[0], [1]], 5, a, b)
    # a window of 8 KB: each node stops until that connection acknowledges; an ack sent
    # to the other connection (or none) stalls the stream
    with trio.fail_after(20):
        async with client(f"{HOST}:{a.port}", to_latest=True, buffer_size=8192) as c:
            items = await drain(c)
            stats = c.statistics()
    assert len(keys(items, 0)) == 300 and len(keys(items, 1)) == 300
    assert a.acks and b.acks, "each node got buffer acks on its own connection"
    assert a.max_outstanding < 8192 + 4096 and b.max_outstanding < 8192 + 4096
    assert [r.vbucket for r in a.stream_requests] == [0]
    assert [r.vbucket for r in b.stream_requests] == [1]
    assert stats["config_rev"] == 5
    assert set(stats["nodes"]) == {f"{HOST}:{a.port}", f"{HOST}:{b.port}"}


async def test_not_my_vbucket_moves_the_stream_with_the_same_resume_fields(two) -> None:
    a, b = two
    a.vb(0).add_mutations(4)
    hb = b.vb(1, uuid=0xB1)
    hb.add_mutations(10, per_snapshot=5)
    serve([[0], [0]], 5, a, b)  # the client's first map: vb 1 on a (stale)
    a.nmvb_value = config_json(6, nodes(a, b), [[0], [1]])  # a's answer: now on b
    start = {1: Offset(1, 0xB1, 5, 5, 5, ((0xB1, 0),))}
    with trio.fail_after(20):
        async with client([(HOST, a.port)], offsets=start) as c:
            items = []
            while len(keys(items, 1)) < 5:
                items.append(await c.__anext__())
            stats = c.statistics()
    assert not any(isinstance(i, RollbackEvent) for i in items)
    assert keys(items, 1) == [f"k1-{s}".encode() for s in range(6, 11)]
    assert [r.vbucket for r in a.stream_requests] == [0, 1]
    (rb,) = b.stream_requests
    assert (rb.vbucket, rb.start, rb.vb_uuid, rb.snap_start, rb.snap_end) == (1, 5, 0xB1, 5, 5)
    assert stats["config_rev"] == 6


async def test_a_diverged_branch_on_the_new_node_is_a_rollback_event(two) -> None:
    a, b = two
    hb = b.vb(0, uuid=0xA0)
    hb.add_mutations(4)
    hb.failover(0xB0, at=3)  # b's branch lost 4 and went on from 3
    hb.add_snapshot(["y"])
    serve([[0]] * 2, 5, a, b)
    a.vb(1).add_mutations(1)
    a.nmvb_value = config_json(6, nodes(a, b), [[1], [0]])
    start = {0: Offset(0, 0xA0, 4, 4, 4, ((0xA0, 0),))}
    with trio.fail_after(20):
        async with client(nodes(a, b), offsets=start) as c:
            items = []
            while b"y" not in keys(items, 0):
                items.append(await c.__anext__())
    rollbacks = [i for i in items if isinstance(i, RollbackEvent)]
    assert [(r.vbucket, r.seqno, r.rollback_seqno) for r in rollbacks] == [(0, 4, 3)]
    assert keys(items, 0) == [b"y"]


async def test_a_poll_follows_a_move_and_a_malformed_config_is_ignored(two, caplog) -> None:
    a, b = two
    a.vb(0).add_mutations(3)
    a.vb(1).add_mutations(3)
    b.vb(1).add_mutations(3)  # b's copy of vb 1 (same history: the fake's default uuid)
    serve([[0], [0]], 5, a, b)
    with trio.fail_after(20), caplog.at_level(logging.WARNING):
        async with client(f"{HOST}:{a.port},{HOST}:{b.port}") as c:
            got: list = []
            while len(keys(got, 0) + keys(got, 1)) < 6:
                got.append(await c.__anext__())
            await c.commit()
            for p in (a, b):
                p.cluster_config = b'{"rev": 9, "vBucketServerMap": {"serverList": 3}}'
            refreshes = c.statistics()["config_refreshes"]
            while c.statistics()["config_refreshes"] < refreshes + 2:
                await trio.sleep(0.05)
            assert c.statistics()["config_rev"] == 5  # the old map kept
            assert [r.vbucket for r in b.stream_requests] == []
            serve([[0], [1]], 7, a, b)  # vb 1 moves; nothing ends its stream on a
            while not b.stream_requests:
                await trio.sleep(0.05)
            b.vb(1).add_snapshot(["z"])
            b.wake_all()
            while b"z" not in keys(got, 1):
                got.append(await c.__anext__())
            stats = c.statistics()
    assert "malformed cluster config" in caplog.text
    (rb,) = b.stream_requests
    assert (rb.vbucket, rb.start, rb.vb_uuid) == (1, 3, 0xA001)  # the committed position
    assert stats["config_rev"] == 7
    assert stats["nodes"][f"{HOST}:{b.port}"]["vbuckets"] == 1


async def test_a_lost_node_vbuckets_go_to_the_node_the_map_names(two) -> None:
    a, b = two
    a.vb(0).add_mutations(3)
    b.vb(0).add_mutations(5)  # the replica b holds the same branch, further on
    b.vb(1).add_mutations(1)
    serve([[0], [1]], 5, a, b)
    with trio.fail_after(20):
        async with client(nodes(a, b), to_latest=False) as c:
            got: list = []
            while len(keys(got, 0)) < 3:
                got.append(await c.__anext__())
            await c.commit()
            b.cluster_config = config_json(6, nodes(a, b), [[1], [1]])  # failed over to b
            a.cluster_config = None
            await a.drop_connections()
            a.vbs.clear()  # a comes back empty-handed: NOT_MY_VBUCKET
            while len(keys(got, 0)) < 5:
                got.append(await c.__anext__())
            stats = c.statistics()
    assert keys(got, 0)[3:] == [b"k0-4", b"k0-5"]
    assert [(r.vbucket, r.start) for r in b.stream_requests if r.vbucket == 0] == [(0, 3)]
    assert stats["config_rev"] == 6 and stats["reconnects"] >= 1


async def test_a_stale_node_answering_not_my_vbucket_forever_ends_in_a_clear_error(two) -> None:
    a, b = two
    serve([[0], [0]], 5, a, b)
    a.vb(1).add_mutations(1)
    a.nmvb_value = a.cluster_config  # "still mine", forever
    t0 = trio.current_time()
    with trio.fail_after(20):
        async with client(nodes(a, b), retry_timeout=1.5) as c:
            with pytest.raises(RetryTimeoutError) as info:
                await drain(c)
            refreshes = c.statistics()["config_refreshes"]
    elapsed = trio.current_time() - t0
    err = info.value
    assert err.vbucket == 0 and isinstance(err.last_error, StatusError)
    assert err.last_error.status == Status.NOT_MY_VBUCKET
    assert 1.5 <= elapsed < 10
    # backoff, not a busy loop: requests and config fetches stay few
    assert len(a.requests_for(0)) <= 20
    assert refreshes <= 1.5 / 0.1 + 3
    # a refresh asks each node at most once (on until one has a newer map: none has)
    assert a.config_requests + b.config_requests <= 2 * (refreshes + 1)


async def test_no_node_answering_names_every_address_tried() -> None:
    ports = []
    for _ in range(2):  # loopback ports nobody listens on
        ls = await trio.open_tcp_listeners(0, host=HOST)
        ports.append(ls[0].socket.getsockname()[1])
        await ls[0].aclose()
    addrs = [f"{HOST}:{p}" for p in ports]
    with trio.fail_after(20):
        async with client(",".join(addrs), retry_timeout=0.5, connect_timeout=1.0) as c:
            with pytest.raises(RetryTimeoutError) as info:
                await c.getone()
    last = info.value.last_error
    assert isinstance(last, NoNodeAnsweredError)
    assert last.addresses == addrs
    assert all(a in str(info.value) for a in addrs)


@pytest.mark.parametrize(("lag", "behind", "node"), [(1000, 5, "b"), (2, 5, "a")])
async def test_prefer_replica_streams_from_a_replica_within_the_lag(two, lag, behind, node):
    a, b = two
    a.vb(0).add_mutations(20)
    b.vb(0).add_mutations(20 - behind)  # b's replica copy, ``behind`` seqnos behind
    serve([[0, 1]], 5, a, b)
    with trio.fail_after(20):
        async with client(nodes(a, b), prefer_replica=True, max_replica_lag=lag) as c:
            got: list = []
            while len(keys(got, 0)) < 20 - behind:
                got.append(await c.__anext__())
    served = {"a": a, "b": b}[node]
    other = {"a": b, "b": a}[node]
    assert [r.vbucket for r in served.stream_requests] == [0]
    assert other.stream_requests == []
