"""Membership against a real etcd: registration under a live lease, the roster, and every
reason to refuse a join, each with its one-line message."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from dcp.producer.cluster.membership import JoinRefused, Membership, NodeRecord
from dcp.producer.cluster.store import EtcdStore

from .conftest import EtcdProcess
from .fakes import FakeHooks


@pytest.fixture
async def store(etcd_server: EtcdProcess) -> AsyncIterator[EtcdStore]:
    s = EtcdStore(etcd_server.endpoint, timeout=2.0)
    yield s
    await s.aclose()


def node(
    store: EtcdStore, cluster: str, name: str, data_dir: Path, vbs: int = 16, port: int = 11210
) -> Membership:
    return Membership(
        store,
        FakeHooks(),
        cluster=cluster,
        node_name=name,
        address=f"127.0.0.1:{port}",
        num_vbuckets=vbs,
        data_dir=data_dir,
        lease_ttl=2,
    )


async def test_registers_and_stays_alive(
    store: EtcdStore, cluster_name: str, tmp_path: Path
) -> None:
    m = node(store, cluster_name, "n1", tmp_path / "n1")
    rec = await m.join()
    key = f"/dcp/{cluster_name}/nodes/n1"
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        await trio.sleep(4.5)  # more than twice the TTL
        held = await store.get(key)
        assert held is not None and held.lease == m.lease
        assert NodeRecord.from_json(held.value) == rec
        assert m.writes_allowed() and m.hooks.events == []  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()
    roster = await store.get(f"/dcp/{cluster_name}/members/n1")
    assert roster is not None and roster.lease == 0 and NodeRecord.from_json(roster.value) == rec
    await m.leave()
    assert await store.get(key) is None
    assert (await store.get(f"/dcp/{cluster_name}/members/n1")) is not None


async def test_a_name_held_by_a_live_node_is_refused(
    store: EtcdStore, cluster_name: str, tmp_path: Path
) -> None:
    first = node(store, cluster_name, "n1", tmp_path / "a")
    await first.join()
    clash = node(store, cluster_name, "n1", tmp_path / "b", port=11211)
    with pytest.raises(
        JoinRefused, match=r"node name 'n1' is held by a live node at 127\.0\.0\.1:11210"
    ):
        await clash.join()
    # the same node restarted (same data dir, same uuid) takes its name over at once
    again = node(store, cluster_name, "n1", tmp_path / "a", port=11212)
    rec = await again.join()
    assert rec.uuid == first.record.uuid  # type: ignore[union-attr]
    held = await store.get(f"/dcp/{cluster_name}/nodes/n1")
    assert held is not None and held.lease == again.lease
    await again.leave()
    # gone, but still in the roster: the map may still name n1, and its data is in "a",
    # so another directory (here "b"; an empty one after a disk swap alike) is refused
    with pytest.raises(JoinRefused, match=r"'n1' is a member .* another data directory"):
        await clash.join()
    fresh = node(store, cluster_name, "n1", tmp_path / "empty", port=11213)
    with pytest.raises(JoinRefused, match=r"is an empty data directory: fail n1 over or eject"):
        await fresh.join()
    # once it left the roster (an eject or a manual failover), the name is free
    await store.delete(f"/dcp/{cluster_name}/members/n1")
    await clash.join()
    await clash.leave()


async def test_a_different_vbucket_count_is_refused(
    store: EtcdStore, cluster_name: str, tmp_path: Path
) -> None:
    await node(store, cluster_name, "n1", tmp_path / "a", vbs=16).join()
    with pytest.raises(JoinRefused, match=f"n2 has 64 vbuckets; cluster '{cluster_name}' has 16"):
        await node(store, cluster_name, "n2", tmp_path / "b", vbs=64).join()


async def test_another_clusters_data_dir_is_refused(
    store: EtcdStore, cluster_name: str, tmp_path: Path
) -> None:
    d = tmp_path / "n1"
    m = node(store, cluster_name, "n1", d)
    await m.join()
    await m.leave()
    with pytest.raises(JoinRefused, match=f"belongs to cluster '{cluster_name}', not 'other'"):
        await node(store, "other", "n1", d).join()
    with pytest.raises(JoinRefused, match="belongs to node 'n1', not 'n9'"):
        await node(store, cluster_name, "n9", d).join()
    # the cluster was wiped from etcd and made again under the same name: a new id
    await store.delete(f"/dcp/{cluster_name}/meta")
    await node(store, cluster_name, "n2", tmp_path / "n2").join()
    with pytest.raises(JoinRefused, match="belongs to another cluster named"):
        await node(store, cluster_name, "n1", d).join()


async def test_a_lapsed_node_leaves_nodes_but_keeps_its_name(
    store: EtcdStore, cluster_name: str, tmp_path: Path
) -> None:
    """A node that stops (no leave: killed) is gone from nodes/ when its lease expires,
    and only its own data directory may take the name again."""
    m = node(store, cluster_name, "n1", tmp_path / "a")
    await m.join()
    key = f"/dcp/{cluster_name}/nodes/n1"
    with trio.fail_after(10):
        while await store.get(key) is not None:
            await trio.sleep(0.2)
    # the name stays the roster's: only n1's own data directory may take it again
    with pytest.raises(JoinRefused, match="another data directory"):
        await node(store, cluster_name, "n1", tmp_path / "b").join()
    rec = await node(store, cluster_name, "n1", tmp_path / "a").join()
    assert rec.uuid == m.record.uuid  # type: ignore[union-attr]


async def test_malformed_records_in_etcd_are_refused_not_crashed_on(
    store: EtcdStore, cluster_name: str, tmp_path: Path
) -> None:
    await store.put(f"/dcp/{cluster_name}/meta", b"{not json")
    with pytest.raises(JoinRefused, match=f"/dcp/{cluster_name}/meta in etcd is malformed"):
        await node(store, cluster_name, "n1", tmp_path / "a").join()
    await store.put(f"/dcp/{cluster_name}/meta", b'{"cluster_id": "x", "num_vbuckets": 16}')
    await store.put(f"/dcp/{cluster_name}/nodes/n1", b'{"name": "n1"}')
    with pytest.raises(JoinRefused, match=f"/dcp/{cluster_name}/nodes/n1 in etcd is malformed"):
        await node(store, cluster_name, "n1", tmp_path / "b").join()
