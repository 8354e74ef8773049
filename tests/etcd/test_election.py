"""The election against a real etcd: contenders racing never both hold the office, and
never both write the map; a deposed orchestrator cannot write it even before it knows."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from dcp.producer.cluster.election import Election, Leadership, read_map
from dcp.producer.cluster.placement import compute_map
from dcp.producer.cluster.store import EtcdStore, Guard

from .conftest import EtcdProcess


@pytest.fixture
async def stores(etcd_server: EtcdProcess) -> AsyncIterator[list[EtcdStore]]:
    """One store per contender, as separate processes would have."""
    made = [EtcdStore(etcd_server.endpoint, timeout=2.0) for _ in range(3)]
    yield made
    for s in made:
        await s.aclose()


async def test_racing_contenders_hold_the_office_one_at_a_time(
    stores: list[EtcdStore], cluster_name: str
) -> None:
    """Three contenders campaign at once, each holder writes the map (read, compute,
    CAS) and resigns; rounds repeat. Never two holders at once, every write lands on the
    revision its holder read, and the map's history is exactly the holders' writes."""
    holders: list[str] = []
    writes: list[tuple[str, int, int]] = []  # (node, term, revision written)
    rounds = 4

    async def contender(i: int) -> None:
        store = stores[i]
        name = f"n{i}"
        election = Election(store, cluster_name, name, f"uuid{i}")
        for _ in range(rounds):
            lease, _ttl = await store.grant_lease(10)
            lead = await election.campaign(lease, interval=0.02)
            holders.append(name)
            assert len(holders) == 1, f"two orchestrators at once: {holders}"
            current, rev = await read_map(store, cluster_name)
            await trio.sleep(0.05)  # decide slowly: the others keep trying meanwhile
            new = compute_map(["n0", "n1", "n2", name + "x"], 64, 1, current)
            written = await lead.write_map(new, rev)
            assert written is not None, "the holder's CAS failed: someone else wrote"
            writes.append((name, lead.term, written))
            holders.remove(name)
            await lead.resign()
            await store.revoke_lease(lease)

    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(contender, i)
    assert len(writes) == 3 * rounds
    terms = [t for _, t, _ in writes]
    assert terms == sorted(terms) and len(set(terms)) == len(terms)


async def test_a_deposed_orchestrator_cannot_write_the_map(
    stores: list[EtcdStore], cluster_name: str
) -> None:
    a, b = stores[0], stores[1]
    ea = Election(a, cluster_name, "a", "ua")
    eb = Election(b, cluster_name, "b", "ub")
    lease_a, _ = await a.grant_lease(5)
    lead_a = await ea.campaign(lease_a)
    m1 = compute_map(["a", "b"], 16, 1)
    rev1 = await lead_a.write_map(m1, 0)
    assert rev1 is not None
    lease_b, _ = await b.grant_lease(5)
    async with trio.open_nursery() as nursery:
        won: list[Leadership] = []

        async def campaign_b() -> None:
            won.append(await eb.campaign(lease_b, interval=0.05))

        nursery.start_soon(campaign_b)
        await trio.sleep(0.5)
        assert won == [] and await ea.leader() == "a"  # b waits while a holds it
        await a.revoke_lease(lease_a)  # a's lease lapses (a frozen, cut off...)
        with trio.fail_after(5):
            await lead_a.wait_lost(interval=0.05)
    lead_b = won[0]
    assert lead_b.term > lead_a.term and await eb.leader() == "b"
    # a still believes it leads and writes on the revision it read: refused
    assert await lead_a.write_map(compute_map(["a"], 16, 1, m1), rev1) is None
    # b writes on the same revision: accepted; then a stale CAS of b's own fails too
    rev2 = await lead_b.write_map(compute_map(["b"], 16, 1, m1), rev1)
    assert rev2 is not None
    assert await lead_b.write_map(m1, rev1) is None
    stored, rev = await read_map(b, cluster_name)
    assert rev == rev2 and stored is not None and stored.servers == ("b",)
    assert not await lead_a.holds() and await lead_b.holds()
    await b.revoke_lease(lease_b)


async def test_two_holders_writing_concurrently_cannot_both_win(
    stores: list[EtcdStore], cluster_name: str
) -> None:
    """Even with the same term (a holder racing itself, two tasks): one CAS per revision."""
    store = stores[0]
    lease, _ = await store.grant_lease(5)
    lead = await Election(store, cluster_name, "a", "ua").campaign(lease)
    results: list[int | None] = []

    async def write(nodes: list[str]) -> None:
        results.append(await lead.write_map(compute_map(nodes, 16, 1), 0))

    async with trio.open_nursery() as nursery:
        for nodes in (["a"], ["a", "b"], ["a", "c"], ["a", "b", "c"]):
            nursery.start_soon(write, nodes)
    assert sum(r is not None for r in results) == 1
    await store.revoke_lease(lease)


async def test_two_orchestrators_racing_on_one_revision(
    stores: list[EtcdStore], cluster_name: str
) -> None:
    """Two orchestrators (separate stores) both read revision r and both write: exactly
    one write lands; after the office changes hands, the deposed term cannot write even
    with the current revision; a guard on a failed node's key makes a failover's write
    fail once the node is back."""
    a, b = stores[0], stores[1]
    lease_a, _ = await a.grant_lease(10)
    lead_a = await Election(a, cluster_name, "a", "ua").campaign(lease_a)
    rev = await lead_a.write_map(compute_map(["a", "b"], 16, 1), 0)
    assert rev is not None
    # a second Leadership object for the same term: what a stale copy would hold
    twin = Leadership(b, cluster_name, "a", lead_a.term)
    results: list[int | None] = []

    async def write(lead: Leadership, nodes: list[str]) -> None:
        current, r = await read_map(lead.store, cluster_name)
        assert r == rev
        await trio.sleep(0.05)  # both have read r before either writes
        results.append(await lead.write_map(compute_map(nodes, 16, 1, current), r))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write, lead_a, ["a"])
        nursery.start_soon(write, twin, ["b"])
    assert sorted(r is not None for r in results) == [False, True]
    # a new term: the old one cannot write on the revision now current
    await a.revoke_lease(lease_a)
    lease_b, _ = await b.grant_lease(10)
    lead_b = await Election(b, cluster_name, "b", "ub").campaign(lease_b)
    _, now = await read_map(b, cluster_name)
    assert await lead_a.write_map(compute_map(["a"], 16, 1), now) is None
    node_key = f"/dcp/{cluster_name}/nodes/a"
    await b.put(node_key, b"{}")  # the failed node is back before the failover's write
    gone = Guard(node_key, 0)
    assert await lead_b.write_map(compute_map(["b"], 16, 1), now, guards=[gone]) is None
    await b.delete(node_key)
    assert await lead_b.write_map(compute_map(["b"], 16, 1), now, guards=[gone]) is not None
    await b.revoke_lease(lease_b)
