"""EtcdStore against a real etcd: reads, conditional writes, leases, following a prefix,
and every way of not getting an answer turned into StoreUnavailable."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable

import pytest
import trio

from dcp.producer.cluster.store import (
    EtcdStore,
    Guard,
    LeaseExpired,
    StoreUnavailable,
    prefix_end,
)

from .conftest import EtcdProcess


@pytest.fixture
async def store(etcd_server: EtcdProcess) -> AsyncIterator[EtcdStore]:
    s = EtcdStore(etcd_server.endpoint, timeout=2.0)
    yield s
    await s.aclose()


def test_prefix_end() -> None:
    assert prefix_end("/dcp/a/") == b"/dcp/a0"
    assert prefix_end("a") == b"b"


def test_endpoint_must_be_http() -> None:
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        EtcdStore("127.0.0.1:2379")


async def test_get_put_prefix_delete(store: EtcdStore, cluster_name: str) -> None:
    p = f"/{cluster_name}/"
    assert await store.get(p + "a") is None
    r1 = await store.put(p + "a", b"1")
    r2 = await store.put(p + "b", b"\x00\xff")
    await store.put(f"/{cluster_name}x", b"outside the prefix")
    a = await store.get(p + "a")
    assert a is not None and (a.value, a.mod_revision, a.create_revision) == (b"1", r1, r1)
    snap = await store.get_prefix(p)
    assert snap.revision >= r2
    assert {k: e.value for k, e in snap.entries.items()} == {p + "a": b"1", p + "b": b"\x00\xff"}
    assert await store.delete(p + "a") is True
    assert await store.delete(p + "a") is False
    assert list((await store.get_prefix(p)).entries) == [p + "b"]


async def test_compare_and_put(store: EtcdStore, cluster_name: str) -> None:
    k = f"/{cluster_name}/map"
    first = await store.compare_and_put(k, b"v1", mod_revision=0)
    assert first is not None
    assert await store.compare_and_put(k, b"again", mod_revision=0) is None  # exists now
    second = await store.compare_and_put(k, b"v2", mod_revision=first)
    assert second is not None and second > first
    assert await store.compare_and_put(k, b"stale", mod_revision=first) is None
    got = await store.get(k)
    assert got is not None and got.value == b"v2" and got.mod_revision == second


async def test_guard_is_part_of_the_comparison(store: EtcdStore, cluster_name: str) -> None:
    leader, k = f"/{cluster_name}/leader", f"/{cluster_name}/map"
    term = await store.compare_and_put(leader, b"n1", mod_revision=0)
    assert term is not None
    ok = await store.compare_and_put(k, b"v1", mod_revision=0, guard=Guard(leader, term))
    assert ok is not None
    # the leader key is re-created (a new term): the old term's writes are refused
    assert await store.delete(leader)
    assert await store.compare_and_put(leader, b"n2", mod_revision=0) is not None
    assert await store.compare_and_put(k, b"v2", mod_revision=ok, guard=Guard(leader, term)) is None
    got = await store.get(k)
    assert got is not None and got.value == b"v1"


async def test_delete_if_revision(store: EtcdStore, cluster_name: str) -> None:
    k = f"/{cluster_name}/k"
    r = await store.put(k, b"x")
    assert await store.delete(k, mod_revision=r - 1) is False
    assert await store.get(k) is not None
    assert await store.delete(k, mod_revision=r) is True
    assert await store.get(k) is None


async def test_leases(store: EtcdStore, cluster_name: str) -> None:
    k = f"/{cluster_name}/node"
    lease, ttl = await store.grant_lease(5)
    assert lease > 0 and ttl >= 5
    await store.put(k, b"alive", lease=lease)
    got = await store.get(k)
    assert got is not None and got.lease == lease
    assert 0 < await store.refresh_lease(lease) <= ttl
    await store.revoke_lease(lease)
    assert await store.get(k) is None  # a revoked lease takes its keys along
    with pytest.raises(LeaseExpired):
        await store.refresh_lease(lease)
    with pytest.raises(LeaseExpired):
        await store.put(k, b"late", lease=lease)
    with pytest.raises(LeaseExpired):
        await store.compare_and_put(k, b"late", mod_revision=0, lease=lease)
    await store.revoke_lease(lease)  # twice: not an error


async def test_lease_expires_by_itself(store: EtcdStore, cluster_name: str) -> None:
    k = f"/{cluster_name}/node"
    lease, ttl = await store.grant_lease(2)
    await store.put(k, b"x", lease=lease)
    with trio.fail_after(ttl + 5):
        while await store.get(k) is not None:
            await trio.sleep(0.1)
    with pytest.raises(LeaseExpired):
        await store.refresh_lease(lease)


async def test_follow_sees_puts_and_deletes(store: EtcdStore, cluster_name: str) -> None:
    p = f"/{cluster_name}/nodes/"
    await store.put(p + "n1", b"1")
    seen: list[dict[str, bytes]] = []
    async with trio.open_nursery() as nursery:

        async def follower() -> None:
            async for snap in store.follow(p, interval=0.05):
                seen.append({k: e.value for k, e in snap.entries.items()})
                if len(seen) == 3:
                    nursery.cancel_scope.cancel()

        nursery.start_soon(follower)
        with trio.fail_after(10):
            while not seen:
                await trio.sleep(0.01)
            await store.put(p + "n2", b"2")
            while len(seen) < 2:
                await trio.sleep(0.01)
            await store.delete(p + "n1")
    assert seen == [{p + "n1": b"1"}, {p + "n1": b"1", p + "n2": b"2"}, {p + "n2": b"2"}]


async def test_unreachable_etcd_is_store_unavailable(
    etcd_factory: Callable[[], EtcdProcess],
) -> None:
    e = etcd_factory()
    store = EtcdStore(e.endpoint, timeout=1.0)
    await store.put("/k", b"v")
    e.stop()
    with trio.fail_after(5):
        with pytest.raises(StoreUnavailable, match=e.endpoint) as info:
            await store.get("/k")
    assert "get /k" in str(info.value)
    with pytest.raises(StoreUnavailable):
        await store.grant_lease(5)
    e.start()  # back on the same port and data: the same store object works again
    got = await store.get("/k")
    assert got is not None and got.value == b"v"
    await store.aclose()


async def test_silent_etcd_times_out() -> None:
    """A peer that accepts the connection and never answers: StoreUnavailable within
    the timeout (plus the trio side's second), not a hang."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        store = EtcdStore(f"http://127.0.0.1:{port}", timeout=0.5)
        start = trio.current_time()
        with pytest.raises(StoreUnavailable, match="get /k"):
            await store.get("/k")
        assert trio.current_time() - start < 3.0
        await store.aclose()


async def test_several_guards_must_all_hold(store: EtcdStore, cluster_name: str) -> None:
    """``guards``: every one is compared; create revision 0 means "absent"."""
    leader, node, k = (f"/{cluster_name}/{n}" for n in ("leader", "nodes/n1", "map"))
    term = await store.compare_and_put(leader, b"a", mod_revision=0)
    assert term is not None
    absent = Guard(node, 0)
    rev = await store.compare_and_put(
        k, b"v1", mod_revision=0, guard=Guard(leader, term), guards=[absent]
    )
    assert rev is not None
    await store.put(node, b"back")  # the node came back: the absent-guard fails
    assert (
        await store.compare_and_put(
            k, b"v2", mod_revision=rev, guards=[Guard(leader, term), absent]
        )
        is None
    )
    # the leader guard alone still holds: the failure above was the second guard's
    assert await store.compare_and_put(k, b"v2", mod_revision=rev, guards=[Guard(leader, term)])
    got = await store.get(k)
    assert got is not None and got.value == b"v2"
