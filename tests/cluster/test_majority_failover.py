"""Automatic failover keeps every write acknowledged at MAJORITY: the replica promoted
(cluster/failover.py ``plan_failover``) holds at least the vbucket's majority seqno as
its active computed it (dcp/producer/durability.py) from the replicas' acks.

Fast and pure: 3-copy chains (num_replicas=2) whose replicas hold different seqnos;
the majority is the real ``DurabilityMonitor``'s, fed the acks the replicas would send
(held = their high seqno of whole snapshots)."""

from __future__ import annotations

import random

import pytest

from dcp.producer.cluster.failover import (
    auto_refusal,
    plan_failover,
    replicas_to_ask,
    valid_seqno,
)
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.producer.durability import DurabilityMonitor
from dcp.protocol.opcodes import DurabilityLevel

NODES = ["a", "b", "c", "d"]
MAJORITY = int(DurabilityLevel.MAJORITY)


def _map(chains: list[list[str | None]]) -> VBucketMap:
    return VBucketMap.from_names(2, chains, servers=NODES)


def _monitor(node: str, chains: list[list[str | None]], high: dict[int, int]) -> DurabilityMonitor:
    """``node``'s monitor: active for the vbuckets it heads, at the seqnos ``high``."""
    m = DurabilityMonitor(
        node,
        len(chains),
        high_seqno=lambda vb: high.get(vb, 0),
        persisted_seqno=lambda vb: 0,
        is_active=lambda vb: chains[vb][0] == node,
    )
    m.set_topology(chains)
    return m


def test_the_replica_with_the_highest_seqno_is_promoted_ties_in_chain_order() -> None:
    chains: list[list[str | None]] = [
        ["a", "b", "c"],  # c is ahead
        ["a", "c", "b"],  # b is ahead
        ["a", "b", "c"],  # a tie: the first replica in the chain
        ["b", "a", "c"],  # not active on a: untouched but for a's slot
    ]
    seqnos = {"b": {0: 10, 1: 30, 2: 5, 3: 0}, "c": {0: 12, 1: 20, 2: 5, 3: 0}}
    plan = plan_failover(_map(chains), "a", {"b", "c", "d"}, seqnos)
    assert plan.promoted == {0: "c", 1: "b", 2: "b"}
    assert [plan.vbmap.names(vb) for vb in range(4)] == [
        ("c", "b", None),
        ("b", "c", None),
        ("b", "c", None),
        ("b", "c", None),
    ]
    assert plan.unavailable == []


def test_a_majority_write_survives_when_the_replica_that_holds_it_is_second_in_chain() -> None:
    """The write at seqno 8 was acknowledged at MAJORITY by a + c only (b lags at 5):
    promoting the first replica of the chain would lose it."""
    chains: list[list[str | None]] = [["a", "b", "c"]]
    high = {0: 8}
    m = _monitor("a", chains, high)
    assert m.acknowledge(0, "b", 5, 0, sent=8) == ""
    assert not m.satisfied(0, 8, MAJORITY)
    assert m.acknowledge(0, "c", 8, 0, sent=8) == ""
    assert m.satisfied(0, 8, MAJORITY) and m.majority_seqno(0) == 8

    vbmap = _map(chains)
    live = {"b", "c", "d"}
    assert auto_refusal(vbmap, "a", {"a"}, live, 0, 3) is None
    assert replicas_to_ask(vbmap, "a", live) == {"b", "c"}
    plan = plan_failover(vbmap, "a", live, {"b": {0: 5}, "c": {0: 8}})
    assert plan.promoted == {0: "c"}


@pytest.mark.parametrize("seed", range(20))
def test_the_promoted_replica_holds_the_majority_seqno_whatever_the_replicas_hold(
    seed: int,
) -> None:
    rnd = random.Random(seed)
    num_vb = 64
    chains: list[list[str | None]] = []
    for _ in range(num_vb):
        active = rnd.choice(NODES)
        chains.append([active, *rnd.sample([n for n in NODES if n != active], 2)])
    high = {vb: rnd.randint(0, 50) for vb in range(num_vb)}  # each active's own seqnos
    held: dict[str, dict[int, int]] = {n: {} for n in NODES}  # replicas' whole snapshots
    monitors = {n: _monitor(n, chains, high) for n in NODES}
    for vb, chain in enumerate(chains):
        for replica in chain[1:]:
            assert replica is not None
            h = held[replica][vb] = rnd.randint(0, high[vb])
            # a replica may have acked less than it holds (its newest ack not arrived yet)
            acked = rnd.randint(0, h)
            assert monitors[chain[0]].acknowledge(vb, replica, acked, 0, sent=high[vb]) == ""
    failed = rnd.choice(NODES)
    live = set(NODES) - {failed}
    vbmap = _map(chains)
    seqnos = {n: held[n] for n in replicas_to_ask(vbmap, failed, live)}
    plan = plan_failover(vbmap, failed, live, seqnos)
    mine = [vb for vb in range(num_vb) if chains[vb][0] == failed]
    assert sorted(plan.promoted) == mine and plan.unavailable == []
    m = monitors[failed]
    for vb in mine:
        # every seqno the failed active answered MAJORITY for is on the promoted copy
        majority = m.majority_seqno(vb)
        assert held[plan.promoted[vb]][vb] >= majority, (vb, chains[vb], majority)
        assert all(not m.satisfied(vb, s, MAJORITY) for s in range(majority + 1, high[vb] + 1)), (
            "the monitor answered MAJORITY above its majority seqno"
        )
        assert plan.vbmap.active(vb) == plan.promoted[vb]
        assert failed not in plan.vbmap.names(vb)


# --------------------------------------------------------------------------- stale copies

#: vb uuids of three tenures: x's (from 0), a's after x was failed over at 90, a warm-up
U_X, U_A, U_W = 0x1111, 0x2222, 0x3333


def test_a_stale_copy_with_a_higher_seqno_is_not_promoted_over_the_majority() -> None:
    """x was the active up to 120 and was failed over at 90 (a took over: branch U_A
    from 90); x came back as a replica of a but has not rolled back yet. a answered
    MAJORITY up to 100 with b's acks. a dies: b (100, on a's branch) must win over x
    (120, of which only up to 90 is a's history)."""
    chains: list[list[str | None]] = [["a", "b", "x"]]
    vbmap = VBucketMap.from_names(2, chains, servers=["a", "b", "x"])
    seqnos = {"b": {0: 100}, "x": {0: 120}}
    logs = {"b": {0: [(U_A, 90), (U_X, 0)]}, "x": {0: [(U_X, 0)]}}
    assert plan_failover(vbmap, "a", {"b", "x"}, seqnos).promoted == {0: "x"}  # seqnos alone
    assert plan_failover(vbmap, "a", {"b", "x"}, seqnos, logs).promoted == {0: "b"}
    # the same x once rolled back and streaming from a (a's log adopted) is just behind
    logs_after = {"b": {0: [(U_A, 90), (U_X, 0)]}, "x": {0: [(U_A, 90), (U_X, 0)]}}
    assert plan_failover(
        vbmap, "a", {"b", "x"}, {"b": {0: 100}, "x": {0: 95}}, logs_after
    ).promoted == {0: "b"}
    assert plan_failover(
        vbmap, "a", {"b", "x"}, {"b": {0: 96}, "x": {0: 99}}, logs_after
    ).promoted == {0: "x"}


def test_valid_seqno_branches() -> None:
    on_a = [(U_A, 90), (U_X, 0)]
    # a copy of x's old branch counts up to where a's branch began
    assert valid_seqno(120, [(U_X, 0)], [(100, on_a)]) == 90
    assert valid_seqno(80, [(U_X, 0)], [(100, on_a)]) == 80  # below the branch: all valid
    # same newest branch: as it is
    assert valid_seqno(100, on_a, [(120, on_a)]) == 100
    # a restarted copy's warm-up entry at its own high seqno holds none of its data: the
    # copy streaming from a is not taken for stale because of it
    warm = [(U_W, 100), *on_a]
    assert valid_seqno(105, on_a, [(100, warm)]) == 105
    assert valid_seqno(100, warm, [(105, on_a)]) == 100
    # a copy that knows a's branch only as the one before a newer one (a warm-up entry
    # below its high) is behind on branches: the other's seqnos above it are not its
    warm_below = [(U_W, 95), *on_a]
    assert valid_seqno(110, on_a, [(100, warm_below)]) == 95
