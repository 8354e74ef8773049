"""``stable_only=True``: the SDK asks every connection for stable-only streams, fails
clearly when a server refuses, and against a real single node sees only persisted data
(a single node's stable seqno is its persisted seqno, dcp/producer/durability.py)."""

from __future__ import annotations

import pytest
import trio

from dcp.consumer import BlockingDcpClient, DcpClient, KvClient, SnapshotBatch, UsageError
from dcp.protocol.errors import StatusError

from .conftest import drain, make_client
from .fake_producer import FakeProducer
from .test_cluster_client import client as cluster_client
from .test_cluster_client import serve
from .test_e2e_server import NUM_VB, running_server


async def test_the_control_is_sent_only_when_asked(producer) -> None:
    producer.vb(0).add_mutations(3)
    async with make_client(producer, vbuckets=[0], to_latest=True, stable_only=True) as c:
        await drain(c)
    assert ("stable_only", "true") in producer.controls
    producer.controls.clear()
    async with make_client(producer, vbuckets=[0], to_latest=True) as c:
        await drain(c)
    assert [k for k, _ in producer.controls if k == "stable_only"] == []


async def test_a_server_that_refuses_it_fails_the_client_naming_the_option(producer) -> None:
    producer.vb(0).add_mutations(3)
    producer.refuse_controls.add("stable_only")
    with trio.fail_after(10):
        async with make_client(producer, vbuckets=[0], to_latest=True, stable_only=True) as c:
            with pytest.raises(StatusError, match="stable_only") as info:
                await drain(c)
    assert "cannot send stable-only streams" in str(info.value)
    assert producer.stream_requests == []  # never a normal stream instead


async def test_every_node_link_of_a_cluster_asks_for_it() -> None:
    async with FakeProducer() as a, FakeProducer() as b:
        a.vb(0).add_mutations(5)
        b.vb(1).add_mutations(5)
        serve([[0], [1]], 3, a, b)
        with trio.fail_after(20):
            async with cluster_client(f"127.0.0.1:{a.port}", to_latest=True, stable_only=True) as c:
                await drain(c)
    for p in (a, b):
        assert p.stream_requests, "the node streamed"
        assert ("stable_only", "true") in p.controls


def test_bad_values_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="stable_only must be True or False"):
        DcpClient("127.0.0.1", 11210, stable_only="yes")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="prefer_replica"):
        DcpClient("127.0.0.1", 11210, stable_only=True, prefer_replica=True)


def _seen(items: list) -> list[bytes]:  # type: ignore[type-arg]
    return sorted(bytes(e.key) for b in items if isinstance(b, SnapshotBatch) for e in b)


async def _read_until(client: DcpClient, seen: list, n: int, timeout: float) -> None:  # type: ignore[type-arg]
    """Append ``client``'s batches to ``seen`` until ``n`` keys were seen or ``timeout``."""
    with trio.move_on_after(timeout):
        async for b in client:
            seen.append(b)
            if len(_seen(seen)) >= n:
                return


async def test_against_a_single_node_it_sees_only_persisted_data(tmp_path) -> None:
    """A single node's stable seqno is its persisted seqno: with the flusher paused the
    stable-only client receives nothing new (a normal one does); resumed, it all arrives."""
    old = sorted(f"old{i}".encode() for i in range(20))
    new = sorted(f"new{i}".encode() for i in range(20))
    async with running_server(tmp_path / "d") as server:
        async with KvClient("127.0.0.1", server.port, num_vbuckets=NUM_VB) as kv:
            await kv.set_many({k.decode(): b"1" for k in old})
            await server.flush_all()
            seen: list = []  # type: ignore[type-arg]
            async with DcpClient(
                "127.0.0.1", server.port, noop_interval=1.0, stable_only=True
            ) as stable:
                await _read_until(stable, seen, 20, 10)
                assert _seen(seen) == old
                server.pause_persistence()
                await kv.set_many({k.decode(): b"2" for k in new})
                everything: list = []  # type: ignore[type-arg]
                async with DcpClient("127.0.0.1", server.port, noop_interval=1.0) as normal:
                    await _read_until(normal, everything, 40, 10)
                assert _seen(everything) == sorted(old + new)  # a normal client is not held
                await _read_until(stable, seen, 21, 1.5)
                assert _seen(seen) == old  # nothing that is not on disk
                server.resume_persistence()
                await _read_until(stable, seen, 40, 10)
                assert _seen(seen) == sorted(old + new)


async def test_the_blocking_client_passes_it_on(producer) -> None:
    producer.vb(0).add_mutations(4, per_snapshot=4)

    def app() -> int:
        with BlockingDcpClient(
            "127.0.0.1",
            producer.port,
            vbuckets=[0],
            to_latest=True,
            stable_only=True,
            noop_interval=None,
        ) as c:
            return sum(len(b) for b in c)

    assert await trio.to_thread.run_sync(app) == 4
    assert ("stable_only", "true") in producer.controls
