"""KvClient against a cluster that misbehaves: a stale node answering NOT_MY_VBUCKET
forever, malformed maps, no node answering, a lost node, a vbucket without an active.

Rules of this module: fake nodes on loopback (``kv_cluster_fake.py``); real time with
short client timeouts (the fakes answer over real sockets) and generous upper bounds.
"""

from __future__ import annotations

import logging

import pytest
import trio

from dcp.consumer import (
    ConnectionLostError,
    KvClient,
    NoNodeAnsweredError,
    RetryTimeoutError,
    kv_nodes,
)
from dcp.consumer.errors import TransientError
from dcp.protocol.errors import NotMyVbucket
from dcp.protocol.opcodes import Opcode

from .kv_cluster_fake import HOST, config_json, fake_cluster, serve_map
from .test_kv_cluster import NVB, SPLIT, key_in


async def test_a_node_answering_not_my_vbucket_forever_gives_a_bounded_timeout(
    nursery: trio.Nursery,
) -> None:
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, [0] * NVB)
    nodes[0].owned = set()  # stale: its map says it holds everything, it holds nothing
    errors: list[BaseException] = []

    async def write(kv: KvClient, i: int) -> None:
        await trio.sleep(i * 0.007)  # out of step, so their retries do not coincide
        try:
            await kv.set(key_in(6, f"w{i}-"), b"x")
        except RetryTimeoutError as exc:
            errors.append(exc)

    t0 = trio.current_time()
    async with KvClient(f"{HOST}:{nodes[0].port}", timeout=1.5) as kv:
        async with trio.open_nursery() as writers:  # 20 callers share the refreshes
            for i in range(20):
                writers.start_soon(write, kv, i)
    took = trio.current_time() - t0
    assert len(errors) == 20
    err = errors[0]
    assert isinstance(err, RetryTimeoutError)
    assert err.vbucket == 6 and isinstance(err.last_error, NotMyVbucket)
    assert "vbucket 6" in str(err) and "NotMyVbucket" in str(err)
    assert 1.4 <= took < 5
    # each caller backs off (10 ms doubling to 0.5 s); the config is fetched at most once
    # per 100 ms (asking both nodes) whatever the number of callers: a busy loop would
    # have sent thousands
    assert 20 * 4 <= nodes[0].count(Opcode.SET) <= 20 * 20
    fetches = sum(n.count(Opcode.GET_CLUSTER_CONFIG) for n in nodes)
    assert fetches <= 2 * (1.5 / 0.1) + 2


@pytest.mark.parametrize(
    "body",
    [
        b'{"rev": 9, "vBucketServerMap": {"serverList": ["x"]}}',  # no port, no map
        # a chain naming a server index the serverList does not have
        b'{"rev": 9, "vBucketServerMap": {"serverList": ["127.0.0.1:1"], '
        b'"vBucketMap": [[0],[0],[0],[0],[0],[0],[0],[3]]}}',
        b'{"rev": 9, not json',
    ],
)
async def test_a_malformed_map_in_not_my_vbucket_is_ignored_and_logged(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, body: bytes
) -> None:
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, SPLIT)
    nodes[1].owned = set()  # refuses its vbuckets, with a malformed "map"
    nodes[1].nmvb_body = body
    caplog.set_level(logging.WARNING)
    async with KvClient(f"{HOST}:{nodes[0].port}", timeout=0.6) as kv:
        with pytest.raises(RetryTimeoutError):
            await kv.set(key_in(1), b"x")
        assert kv.config is not None and kv.config.rev == 1  # the old map kept
        assert kv.config.active(1) == (HOST, nodes[1].port)
        await kv.set(key_in(2), b"still routed")  # n1's vbuckets work on
    warned = [r for r in caplog.records if "malformed cluster config" in r.getMessage()]
    assert warned and all(r.levelno == logging.WARNING for r in warned)


async def test_no_node_answering_names_every_address_tried() -> None:
    ports = []
    for _ in range(2):  # ports nothing listens on
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        ports.append(listeners[0].socket.getsockname()[1])
        await listeners[0].aclose()
    with pytest.raises(RetryTimeoutError) as info:
        async with KvClient(f"{HOST}:{ports[0]},{HOST}:{ports[1]}", timeout=0.5):
            pass
    err = info.value
    assert err.operation == "connect" and isinstance(err.last_error, NoNodeAnsweredError)
    assert err.last_error.addresses == [f"{HOST}:{p}" for p in ports]
    assert all(isinstance(e, OSError) for e in err.last_error.errors)
    for p in ports:
        assert f"{HOST}:{p}" in str(err)


async def test_a_lost_node_resends_safe_requests_to_the_new_active_only(
    nursery: trio.Nursery,
) -> None:
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, SPLIT)
    n1, n2 = nodes
    k1 = key_in(1)
    async with KvClient(f"{HOST}:{n1.port}", timeout=5) as kv:
        await kv.set(k1, b"v1")
        # n2 dies with an ADD unanswered; the cluster fails its vbuckets over to n1
        n2.drop_on = Opcode.ADD
        with pytest.raises(ConnectionLostError, match="may or may not have been applied"):
            await kv.add(key_in(3), b"a")
        await n2.stop()
        serve_map(nodes, 2, [0] * NVB)
        assert (await kv.get(k1)).value == b"v1"  # re-sent after the map refresh
        await kv.set(key_in(3), b"s")  # plain SET: safe to repeat, lands on n1
        assert kv.config is not None and kv.config.rev == 2
    assert n2.keys(Opcode.ADD) == [key_in(3)]  # sent once, never repeated
    assert n1.keys(Opcode.GET) == [k1] and n1.keys(Opcode.SET) == [key_in(3)]


async def test_a_vbucket_without_an_active_waits_for_the_map(nursery: trio.Nursery) -> None:
    nodes = await fake_cluster(nursery, 2)
    owners = [-1 if vb == 3 else vb % 2 for vb in range(NVB)]
    serve_map(nodes, 1, owners)
    async with KvClient(f"{HOST}:{nodes[0].port}", timeout=5) as kv:
        async with trio.open_nursery() as inner:
            inner.start_soon(kv.set, key_in(3), b"x")
            await trio.sleep(0.4)
            assert all(n.count(Opcode.SET) == 0 for n in nodes)  # nowhere to send it
            serve_map(nodes, 2, SPLIT)  # vb 3 gets an active: n2
        assert nodes[1].keys(Opcode.SET) == [key_in(3)]
    for n in nodes:
        n.config = config_json(3, nodes, owners)
    async with KvClient(f"{HOST}:{nodes[0].port}", timeout=0.5) as kv:
        with pytest.raises(RetryTimeoutError) as info:
            await kv.set(key_in(3), b"x")
    assert info.value.vbucket == 3 and isinstance(info.value.last_error, TransientError)
    assert "no active node" in str(info.value)


async def test_a_silent_node_makes_the_client_look_for_a_newer_map(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen node sends no NOT_MY_VBUCKET; when an operation times out on it the map
    is refreshed at once, so the next one goes where the cluster failed it over."""
    # nothing else may find the new map: no poll, and no watch giving the unanswered
    # batch up (it would refresh the map too)
    monkeypatch.setattr(kv_nodes, "POLL_INTERVAL", 3600.0)
    monkeypatch.setattr(kv_nodes, "PATIENCE", 3600.0)
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, SPLIT)
    n1, n2 = nodes
    async with KvClient(f"{HOST}:{n1.port}", timeout=1.0) as kv:
        await kv.set(key_in(1), b"before")
        n2.silent = True
        serve_map(nodes, 2, [0] * NVB)  # the failover: nobody tells the client
        with pytest.raises(RetryTimeoutError):
            await kv.set(key_in(1), b"lost?")
        with trio.fail_after(30):  # a deadline for a loaded machine, not a measurement
            while kv.config is None or kv.config.rev < 2:
                await trio.sleep(0.02)
        await kv.set(key_in(1), b"after")
    assert n1.docs[key_in(1)] == b"after"


async def test_the_map_is_polled_in_cluster_mode(nursery: trio.Nursery) -> None:
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, SPLIT)
    async with KvClient(f"{HOST}:{nodes[0].port}", timeout=5) as kv:
        serve_map(nodes, 2, [0] * NVB)  # nothing the client does would find it but a poll
        with trio.fail_after(30):  # POLL_INTERVAL (2.5 s) with room for a loaded machine
            while kv.config is None or kv.config.rev < 2:
                await trio.sleep(0.05)
    single = nodes[1]
    single.config = config_json(1, [single], [0] * NVB, single)
    single.owned = set(range(NVB))
    async with KvClient(f"{HOST}:{single.port}", timeout=5) as kv:
        before = single.count(Opcode.GET_CLUSTER_CONFIG)
        await trio.sleep(kv_nodes.POLL_INTERVAL + 0.5)
        assert single.count(Opcode.GET_CLUSTER_CONFIG) == before  # a single server: never


async def test_safe_requests_left_on_a_silent_node_follow_the_map_within_their_deadline(
    nursery: trio.Nursery,
) -> None:
    """A GET or a plain SET unanswered for a second by a node the map no longer names is
    re-sent to the new active; an ADD (it may have been applied) is not."""
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, SPLIT)
    n1, n2 = nodes
    async with KvClient(f"{HOST}:{n1.port}", timeout=5) as kv:
        await kv.set(key_in(1), b"v1")
        n2.silent = True
        serve_map(nodes, 2, [0] * NVB)  # the failover: nobody tells the client
        t0 = trio.current_time()
        assert (await kv.get(key_in(1))).value == b"v1"
        await kv.set(key_in(3), b"s")
        assert trio.current_time() - t0 < 4
    assert n2.keys(Opcode.GET) == [key_in(1)] and n1.keys(Opcode.GET) == [key_in(1)]
    assert n1.keys(Opcode.SET) == [key_in(3)]  # went by the new map at once

    serve_map(nodes, 3, SPLIT)
    n2.silent = False
    async with KvClient(f"{HOST}:{n1.port}", timeout=2.5) as kv:
        await kv.set(key_in(7), b"x")  # the connection to n2 is open
        n2.silent = True
        serve_map(nodes, 4, [0] * NVB)
        with pytest.raises(RetryTimeoutError):
            await kv.add(key_in(5), b"a")
    assert n2.keys(Opcode.ADD) == [key_in(5)] and n1.keys(Opcode.ADD) == []


async def test_a_node_that_hangs_while_connecting_is_left_for_the_new_map(
    nursery: trio.Nursery,
) -> None:
    """Nothing was sent to a node whose HELLO hangs: even an ADD may go by the new map."""
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, SPLIT)
    n1, n2 = nodes
    n2.silent = True  # before the client ever connects to it
    async with KvClient(f"{HOST}:{n1.port}", timeout=5) as kv:
        serve_map(nodes, 2, [0] * NVB)
        t0 = trio.current_time()
        await kv.add(key_in(1), b"a")
        assert trio.current_time() - t0 < 4
    assert n2.count(Opcode.HELLO) >= 1 and n2.keys(Opcode.ADD) == []
    assert n1.keys(Opcode.ADD) == [key_in(1)]
