"""The orchestrator against a real etcd and fake nodes (tests/etcd/orchestrator_fakes.py):
the first map, rebalance on a join (one active per vbucket throughout), failover by the
highest seqno, every refusal, the failover's guard, and the status document."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import trio

from dcp.producer.cluster.election import Election, Leadership, read_map
from dcp.producer.cluster.membership import NodeRecord, cluster_prefix
from dcp.producer.cluster.orchestrator import Orchestrator, OrchestratorSettings
from dcp.producer.cluster.placement import compute_map
from dcp.producer.cluster.store import EtcdStore
from dcp.producer.cluster.vbmap import VBucketMap

from .conftest import EtcdProcess
from .orchestrator_fakes import FakeNodes


class Clock:
    """The orchestrator's clock for failover timing, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    store: EtcdStore
    cluster: str
    nodes: FakeNodes
    clock: Clock
    leadership: Leadership
    settings: OrchestratorSettings

    @property
    def prefix(self) -> str:
        return cluster_prefix(self.cluster)

    async def map(self) -> tuple[VBucketMap | None, int]:
        return await read_map(self.store, self.cluster)

    async def status(self) -> dict[str, Any]:
        got = await self.store.get(self.prefix + "status")
        return json.loads(got.value) if got is not None else {}

    async def until(self, what: Callable[[], Any], timeout: float = 20.0) -> Any:
        """Poll the async predicate ``what`` until it returns something truthy."""
        with trio.fail_after(timeout):
            while True:
                got = await what()
                if got:
                    return got
                await trio.sleep(0.03)

    async def settled_map(self, check: Callable[[VBucketMap], bool]) -> VBucketMap:
        async def ready() -> VBucketMap | None:
            m, _ = await self.map()
            return m if m is not None and m.forward is None and check(m) else None

        return await self.until(ready)


@contextlib.asynccontextmanager
async def harness(
    etcd: EtcdProcess,
    cluster: str,
    names: list[str],
    before: Callable[[Harness], Any] | None = None,
    **settings: Any,
) -> AsyncIterator[Harness]:
    """Fake nodes ``names`` joined, an orchestrator elected and running; ``before(h)``
    runs once the office is held, before the orchestrator starts (to set a stage)."""
    store = EtcdStore(etcd.endpoint, timeout=2.0)
    nvb = settings.pop("num_vbuckets", 16)
    nodes = FakeNodes(store, cluster, nvb, writes=settings.pop("writes", 1))
    for name in names:
        await nodes.join(name)
    s = OrchestratorSettings(cluster=cluster, num_vbuckets=nvb, **settings)
    lease, _ = await store.grant_lease(30)
    leadership = await Election(store, cluster, "orch", "uorch").campaign(lease)
    clock = Clock()
    h = Harness(store, cluster, nodes, clock, leadership, s)
    if before is not None:
        await before(h)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(nodes.run)
            orch = Orchestrator(
                store, leadership, nodes, s, clock=clock, poll_interval=0.05, status_interval=0.1
            )
            nursery.start_soon(orch.run)
            yield h
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await store.revoke_lease(lease)
            await store.aclose()


def one_active_each(h: Harness, m: VBucketMap) -> bool:
    return all(h.nodes.actives(vb) == [m.active(vb)] for vb in range(m.num_vbuckets))


async def test_first_map_is_balanced_and_status_says_so(etcd_server: EtcdProcess, cluster_name):
    async with harness(etcd_server, cluster_name, ["n1", "n2", "n3"]) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 3)
        assert m == compute_map(["n1", "n2", "n3"], 16, 1)
        await h.until(lambda: _true(one_active_each(h, m)))
        st = await h.until(h.status)
        assert st["orchestrator"] == "orch" and st["term"] == h.leadership.term
        assert st["down"] == {} and st["unavailable"] == []
        assert st["rebalance"]["state"] == "idle" and st["failover"]["state"] == "idle"
        assert st["autofailover"] == {"count": 0, "max": 1}
        assert set(st) == {
            "orchestrator", "term", "updated", "down", "unavailable", "rebalance",
            "failover", "autofailover",
        }  # fmt: skip


async def _true(value: bool) -> bool:
    return value


async def test_a_join_rebalances_with_one_active_per_vbucket_throughout(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    async with harness(
        etcd_server, cluster_name, ["n1", "n2", "n3"], num_vbuckets=32, rebalance_moves=4
    ) as h:
        first = await h.settled_map(lambda m: len(m.servers) == 3)
        seen: list[VBucketMap] = []

        async def record() -> None:
            async for snap in h.store.follow(h.prefix + "map", interval=0.01):
                got = snap.entries.get(h.prefix + "map")
                if got is not None:
                    seen.append(VBucketMap.from_json(got.value))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(record)
            await h.nodes.join("n4")
            await h.until(lambda: _rebalance_done(h))
            nursery.cancel_scope.cancel()
        final = await h.settled_map(lambda m: True)
        assert final == compute_map(["n1", "n2", "n3", "n4"], 32, 1, first)
        assert any(m.forward is not None for m in seen), "no batch was published"
        assert len([m for m in seen if m.forward is not None]) > 1, "one batch only"
        for m in seen:  # every map names one active per vbucket, moving or not
            assert m.unavailable() == []
        assert h.nodes.violations == []  # never two active copies on the nodes
        await h.until(lambda: _true(one_active_each(h, final)))
        st = await h.status()
        assert st["rebalance"]["total"] == st["rebalance"]["done"] > 0
        takeovers = [c for c in h.nodes.calls if c[2] and c[2].get("takeover")]
        assert takeovers, "actives moved without a takeover"


async def _rebalance_done(h: Harness) -> bool:
    st = await h.status()
    return bool(st) and st["rebalance"]["state"] == "done"


async def test_failover_promotes_the_replica_with_the_highest_seqno(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    async with harness(
        etcd_server, cluster_name, ["n1", "n2", "n3"], num_replicas=2, auto_failover_timeout=5.0
    ) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 3)
        await h.until(lambda: _true(one_active_each(h, m)))
        await trio.sleep(0.2)
        h.nodes.nodes["n3"].lagging = True  # n3's replicas fall behind n2's
        await trio.sleep(0.2)
        await h.nodes.kill("n1")
        await trio.sleep(0.3)
        assert (await h.map())[0] == m  # not before the timeout
        st = await h.until(h.status)
        assert "n1" in st["down"]
        h.clock.now += 5.0
        new = await h.settled_map(lambda m: "n1" not in m.servers)
        for vb in range(16):
            if m.active(vb) == "n1":
                assert new.names(vb) == ("n2", "n3", None), vb  # n2 had more
            else:
                assert new.names(vb) == tuple(n if n != "n1" else None for n in m.names(vb))[
                    :1
                ] + tuple(n for n in m.names(vb)[1:] if n != "n1") + (None,), vb
        st = await h.until(lambda: _failover_state(h, "done"))
        assert st["failover"]["auto"] is True and st["failover"]["node"] == "n1"
        assert st["autofailover"]["count"] == 1
        got = await h.store.get(h.prefix + "autofailover")
        assert got is not None and json.loads(got.value) == {"count": 1, "failed_over": ["n1"]}


async def _failover_state(h: Harness, state: str) -> dict[str, Any] | None:
    st = await h.status()
    return st if st and st["failover"]["state"] == state else None


async def test_refusals_leave_the_map_unchanged_and_say_why(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    async with harness(
        etcd_server, cluster_name, ["n1", "n2", "n3", "n4"], auto_failover_timeout=3.0
    ) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 4)
        # two down at once
        await h.nodes.kill("n1")
        await h.nodes.kill("n2")
        await trio.sleep(0.2)
        h.clock.now += 4
        st = await h.until(lambda: _failover_state(h, "refused"))
        assert "2 nodes are down (n1, n2)" in st["failover"]["message"]
        assert (await h.map())[0] == m
        # one comes back; the count is used up: refused again
        await h.store.put(h.prefix + "autofailover", b'{"count": 1, "failed_over": ["x"]}')
        await h.nodes.revive("n2")
        await h.until(lambda: _message_has(h, "automatic failovers used: 1 of 1"))
        assert (await h.map())[0] == m
        # an operator resets the count: n1 is failed over
        await h.store.delete(h.prefix + "autofailover")
        new = await h.settled_map(lambda m: "n1" not in m.servers)
        assert new.unavailable() == []


async def _message_has(h: Harness, text: str) -> bool:
    st = await h.status()
    return bool(st) and text in st["failover"]["message"]


async def test_no_failover_that_leaves_a_vbucket_without_an_active(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    async with harness(
        etcd_server, cluster_name, ["n1", "n2"], num_replicas=0, auto_failover_timeout=3.0
    ) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 2)
        await h.nodes.kill("n1")
        await trio.sleep(0.2)
        h.clock.now += 4
        await h.until(lambda: _message_has(h, "have no live replica"))
        assert (await h.map())[0] == m
        st = await h.status()
        assert st["failover"]["state"] == "refused" and st["failover"]["node"] == "n1"


async def test_the_failover_write_fails_when_the_node_came_back(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    """The node's key reappears between the decision and the write (while the
    orchestrator asks the replicas for seqnos): the guarded CAS refuses the map."""
    async with harness(
        etcd_server, cluster_name, ["n1", "n2", "n3"], auto_failover_timeout=3.0
    ) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 3)
        await h.nodes.kill("n1")
        await trio.sleep(0.2)
        came_back = trio.Event()

        async def back(address: str) -> None:
            if not came_back.is_set():
                await h.nodes.revive("n1")
                came_back.set()

        h.nodes.on_seqnos = back
        h.clock.now += 4
        with trio.fail_after(10):
            await came_back.wait()
        await trio.sleep(0.5)
        assert (await h.map())[0] == m
        counted = await h.store.get(h.prefix + "autofailover")  # counted first, then undone
        assert counted is None or json.loads(counted.value) == {"count": 0, "failed_over": []}
        st = await h.status()
        assert st["down"] == {} and st["failover"]["state"] != "done"


async def test_the_failover_clock_counts_from_the_last_keepalive_not_the_key_gone(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    """The key of a node vanishes one lease TTL after its last keepalive: the timeout is
    counted from that keepalive (seen gone minus the TTL its record states), so kill -9
    to failover takes the timeout, not TTL + timeout."""
    async with harness(
        etcd_server, cluster_name, ["n1", "n2", "n3"], auto_failover_timeout=5.0
    ) as h:
        assert h.nodes.lease_ttl == 2
        m = await h.settled_map(lambda m: len(m.servers) == 3)
        await h.until(lambda: _true(one_active_each(h, m)))
        await h.nodes.kill("n1")

        async def down() -> dict[str, Any] | None:
            st = await h.status()
            return st if "n1" in st.get("down", {}) else None

        st = await h.until(down)
        assert 2.0 <= st["down"]["n1"] < 2.5  # dated back by its TTL at once
        h.clock.now += 2.8  # 4.8 s after its last keepalive
        await trio.sleep(0.5)
        assert (await h.map())[0] == m
        h.clock.now += 0.4  # 5.2 s: failed over (the old clock said 3.2 s)
        new = await h.until(lambda: _settled_without(h, "n1"), timeout=10)
        assert new.unavailable() == []


async def _settled_without(h: Harness, name: str) -> VBucketMap | None:
    m, _ = await h.map()
    return m if m is not None and m.forward is None and name not in m.servers else None


def test_a_member_record_without_a_lease_ttl_reads_as_the_default() -> None:
    """Records written before the TTL was in them: dated by the default TTL (5 s)."""
    old = b'{"name": "n1", "address": "h:1", "uuid": "u", "num_vbuckets": 4, "cluster_id": "c"}'
    assert NodeRecord.from_json(old).lease_ttl == 5
    new = NodeRecord("n1", "h:1", "u", 4, "c", 2)
    assert NodeRecord.from_json(new.to_json()) == new
