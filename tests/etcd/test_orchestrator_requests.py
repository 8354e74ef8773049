"""The orchestrator's requests and its resume after a crash: half-done moves finished or
rolled back by what the nodes say (never two actives, never none), manual hard and
graceful failover, rebalance with eject; each answered in status with its id."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import trio

from dcp.producer.cluster.vbmap import VBucketMap

from .conftest import EtcdProcess
from .orchestrator_fakes import A, D, R
from .test_orchestrator import Harness, harness, one_active_each


async def _request(h: Harness, kind: str, doc: dict[str, Any]) -> None:
    key = h.prefix + "requests/" + kind
    assert await h.store.compare_and_put(key, json.dumps(doc).encode(), mod_revision=0)


async def _answered(h: Harness, kind: str, rid: str) -> dict[str, Any]:
    async def done() -> dict[str, Any] | None:
        st = await h.status()
        part = st.get(kind, {}) if st else {}
        ok = part.get("id") == rid and part.get("state") in ("done", "failed")
        return part if ok else None

    part: dict[str, Any] = await h.until(done)
    assert await h.store.get(h.prefix + "requests/" + kind) is None  # taken
    return part


def _stage(
    chains: Sequence[Sequence[str | None]], forward: Sequence[Sequence[str | None]], states: dict
) -> Any:
    """A ``before`` hook: the map a dead orchestrator left (with forward chains) and the
    nodes' states as its moves left them."""

    async def before(h: Harness) -> None:
        m = VBucketMap.from_names(1, chains, forward=forward)
        assert await h.leadership.write_map(m, 0) is not None
        h.nodes.vbmap = m
        for node in h.nodes.nodes.values():
            h.nodes.reconcile(node, m)
        for (name, vb), st in states.items():
            h.nodes.nodes[name].state[vb] = st

    return before


async def test_resume_finishes_continues_or_rolls_back_each_move(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    chains = [["n1", "n2"], ["n1", "n2"], ["n2", "n3"], ["n3", "n1"]]
    forward = [["n3", "n1"], ["n3", "n2"], ["n1", "n3"], ["n3", "n1"]]
    states = {
        ("n1", 0): D, ("n3", 0): A,  # vb 0: handed over before the crash: finish
        ("n1", 1): A, ("n3", 1): R,  # vb 1: not started: carry on (takeover)
        ("n2", 2): D, ("n1", 2): R,  # vb 2: the old one dead, the new one never active
    }  # fmt: skip
    async with harness(
        etcd_server,
        cluster_name,
        ["n1", "n2", "n3"],
        before=_stage(chains, forward, states),
        num_vbuckets=4,
        move_timeout=1.0,
    ) as h:
        m = await h.settled_map(lambda m: True)
        assert [list(m.names(vb)) for vb in range(4)] == [
            ["n3", "n1"], ["n3", "n2"], ["n2", "n3"], ["n3", "n1"],
        ]  # fmt: skip
        await h.until(lambda: _ok(one_active_each(h, m)))
        assert h.nodes.violations == []
        assert ("n2", "ACTIVE", None) in h.nodes.calls  # vb 2's old active revived


async def test_resume_with_the_new_active_gone_revives_the_old_one(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    async def before(h: Harness) -> None:
        await _stage([["n1", "n2"], ["n2", "n1"]], [["n3", "n2"], ["n2", "n1"]], {
            ("n1", 0): D, ("n3", 0): R,
        })(h)  # fmt: skip
        await h.nodes.kill("n3")

    async with harness(
        etcd_server, cluster_name, ["n1", "n2", "n3"], before=before, num_vbuckets=2
    ) as h:
        m = await h.settled_map(lambda m: True)
        assert m.names(0) == ("n1", "n2") and m.names(1) == ("n2", "n1")
        await h.until(lambda: _ok(h.nodes.actives(0) == ["n1"]))
        assert h.nodes.violations == []


async def _ok(value: bool) -> bool:
    return value


async def test_a_move_whose_live_new_active_does_not_answer_stays_in_flight(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    """n3 took vb 0 over (ACTIVE) but the orchestrator cannot reach it while its lease
    holds: reviving n1 would make two actives, so the move keeps its forward chain (n1
    stays dead) until n3 answers, and is then finished."""

    async def before(h: Harness) -> None:
        await _stage([["n1", "n2"], ["n2", "n1"]], [["n3", "n2"], ["n2", "n1"]], {
            ("n1", 0): D, ("n3", 0): A,
        })(h)  # fmt: skip
        h.nodes.nodes["n3"].unreachable = True

    async with harness(
        etcd_server,
        cluster_name,
        ["n1", "n2", "n3"],
        before=before,
        num_vbuckets=2,
        move_timeout=0.5,
    ) as h:
        await trio.sleep(2.0)  # several settling rounds
        m, _ = await h.map()
        assert m is not None and m.forward_names(0) == ("n3", "n2")
        assert h.nodes.actives(0) == ["n3"] and ("n1", "ACTIVE", None) not in h.nodes.calls
        h.nodes.nodes["n3"].unreachable = False
        done = await h.settled_map(lambda m: m.active(0) == "n3")
        assert done.names(0) == ("n3", "n2")
        assert h.nodes.violations == []


async def test_hard_failover_of_a_live_node_and_unavailable_vbuckets(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    async with harness(etcd_server, cluster_name, ["n1", "n2"], num_replicas=0) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 2)
        lost = [vb for vb in range(16) if m.active(vb) == "n2"]
        await _request(h, "failover", {"id": "f1", "node": "n2", "graceful": False})
        part = await _answered(h, "failover", "f1")
        assert part["state"] == "done" and part["node"] == "n2" and part["auto"] is False
        assert f"{len(lost)} vbuckets had no replica and are unavailable" in part["message"]
        new, _ = await h.map()
        assert new is not None and new.servers == ("n1",) and new.unavailable() == lost
        st = await h.until(lambda: _unavailable(h, lost))
        assert st["autofailover"]["count"] == 0  # a manual failover is not counted
        await h.until(lambda: _ok(all(h.nodes.nodes["n2"].state[vb] == D for vb in range(16))))
        await trio.sleep(0.3)  # n2 is live, but out of the roster: not rebalanced back in
        assert (await h.map())[0] == new and await h.store.get(h.prefix + "members/n2") is None
        # a node outside the map: refused, the map unchanged
        await _request(h, "failover", {"id": "f2", "node": "n9", "graceful": False})
        part = await _answered(h, "failover", "f2")
        assert part["state"] == "failed" and "not a node of the map" in part["message"]
        assert (await h.map())[0] == new


async def _unavailable(h: Harness, vbs: list[int]) -> dict[str, Any] | None:
    st = await h.status()
    return st if st and st["unavailable"] == vbs else None


async def test_graceful_failover_hands_the_actives_over_first(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    async with harness(etcd_server, cluster_name, ["n1", "n2", "n3"]) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 3)
        await h.until(lambda: _ok(one_active_each(h, m)))
        mine = [vb for vb in range(16) if m.active(vb) == "n3"]
        await _request(h, "failover", {"id": "g1", "node": "n3", "graceful": True})
        part = await _answered(h, "failover", "g1")
        assert part["state"] == "done", part
        new, _ = await h.map()
        assert new is not None and "n3" not in new.servers
        for vb in mine:  # its replica took over
            assert new.active(vb) == m.replicas(vb)[0]
        takeovers = {c[0] for c in h.nodes.calls if c[2] and c[2].get("takeover")}
        assert takeovers and "n3" not in takeovers
        await h.until(lambda: _ok(one_active_each(h, new)))
        assert h.nodes.violations == []
        # graceful needs the node up
        await h.nodes.kill("n2")
        await _request(h, "failover", {"id": "g2", "node": "n2", "graceful": True})
        part = await _answered(h, "failover", "g2")
        assert part["state"] == "failed" and "is down" in part["message"]


async def test_rebalance_request_with_eject(etcd_server: EtcdProcess, cluster_name: str) -> None:
    async with harness(etcd_server, cluster_name, ["n1", "n2", "n3", "n4"]) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 4)
        await _request(h, "rebalance", {"id": "r0", "eject": ["n9"]})
        part = await _answered(h, "rebalance", "r0")
        assert part["state"] == "failed" and "n9" in part["message"]
        assert (await h.map())[0] == m
        await _request(h, "rebalance", {"id": "r1", "eject": ["n4"]})
        part = await _answered(h, "rebalance", "r1")
        assert part["state"] == "done" and part["total"] == part["done"] > 0
        assert part["started"] is not None and part["finished"] >= part["started"]
        new, _ = await h.map()
        assert new is not None and new.servers == ("n1", "n2", "n3") and new.forward is None
        assert await h.store.get(h.prefix + "members/n4") is None
        await h.until(lambda: _ok(one_active_each(h, new)))
        assert h.nodes.violations == []
        await trio.sleep(0.3)  # n4 is live but no member: no automatic rebalance back
        assert (await h.map())[0] == new


async def test_hard_failover_of_a_live_node_stops_its_writes_before_promoting(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    """A live node keeps acknowledging writes on its actives until it reads a new map:
    its actives are set dead (under forward chains, so its own reconcile keeps them
    dead) and the promoted replicas catch up with it before the map promotes them."""
    async with harness(etcd_server, cluster_name, ["n1", "n2", "n3"]) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 3)
        await h.until(lambda: _ok(one_active_each(h, m)))
        mine = [vb for vb in range(16) if m.active(vb) == "n2"]
        h.nodes.calls.clear()
        await _request(h, "failover", {"id": "f3", "node": "n2", "graceful": False})
        part = await _answered(h, "failover", "f3")
        assert part["state"] == "done", part
        assert ("n2", "DEAD", None) in h.nodes.calls
        new, _ = await h.map()
        assert new is not None and "n2" not in new.servers and new.forward is None
        n2 = h.nodes.nodes["n2"]
        assert all(n2.state[vb] == D for vb in mine)
        for vb in mine:  # the promoted copy holds everything n2 took
            promoted = h.nodes.nodes[new.active(vb) or ""]
            assert promoted.state[vb] == A and promoted.seqno[vb] >= n2.seqno[vb]
        assert h.nodes.violations == []


async def test_a_node_back_in_the_roster_gets_its_former_vbuckets_as_replicas(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    """A failed-over node that returns after the others were rebalanced still holds the
    data of its former copies (dead, seqno above 0): the rebalance that takes it back in
    makes those its replicas (placement's ``prefer``), so its stale tail is rolled back
    and fewer copies are built from nothing."""
    async with harness(etcd_server, cluster_name, ["n1", "n2", "n3"], num_vbuckets=64) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 3)
        await h.until(lambda: _ok(one_active_each(h, m)))
        await trio.sleep(0.1)  # a few ticks: every copy holds data
        held = {vb for vb in range(64) if "n3" in m.names(vb)}
        await _request(h, "failover", {"id": "f4", "node": "n3", "graceful": False})
        assert (await _answered(h, "failover", "f4"))["state"] == "done"
        await _request(h, "rebalance", {"id": "r4", "eject": []})
        assert (await _answered(h, "rebalance", "r4"))["state"] == "done"
        two = await h.settled_map(lambda m: m.servers == ("n1", "n2"))
        assert all(set(two.names(vb)) == {"n1", "n2"} for vb in range(64))
        # n3 is started again: back in the roster, holding nothing in the map
        await h.store.put(h.prefix + "members/n3", h.nodes.record("n3"))
        back = await h.settled_map(lambda m: len(m.servers) == 3)
        replicas = {vb for vb in range(64) if "n3" in back.replicas(vb)}
        assert replicas and replicas <= held, sorted(replicas - held)
        assert h.nodes.violations == []
