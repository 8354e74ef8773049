"""The node side's reconcile rules (cluster/reconcile.py), as a pure function: every case
of its module rules, the forward ones in particular."""

from __future__ import annotations

from collections.abc import Sequence

from dcp.producer.cluster.reconcile import desired_assignment
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.producer.replication.target import Assignment
from dcp.protocol.opcodes import VBucketState

A, R, D, P = (
    VBucketState.ACTIVE,
    VBucketState.REPLICA,
    VBucketState.DEAD,
    VBucketState.PENDING,
)
ADDR = {"n1": "h:1", "n2": "h:2", "n3": "h:3"}


def want(
    chains: Sequence[Sequence[str | None]],
    me: str,
    *,
    forward: Sequence[Sequence[str | None]] | None = None,
    engine: Sequence[VBucketState] | None = None,
    current: dict[int, Assignment] | None = None,
    addresses: dict[str, str] = ADDR,
) -> list[Assignment]:
    vbmap = VBucketMap.from_names(
        len(chains[0]) - 1, chains, servers=["n1", "n2", "n3"], forward=forward
    )
    held = engine or [A] * len(chains)
    out = desired_assignment(
        vbmap,
        me,
        addresses,
        lambda vb: held[vb],
        lambda vb: (current or {}).get(vb),
    )
    return [out[vb] for vb in range(len(chains))]


def test_no_forward_active_replica_dead() -> None:
    chains = [["n1", "n2"], ["n2", "n1"], ["n3", "n2"], [None, "n1"]]
    assert want(chains, "n1") == [
        Assignment(A),
        Assignment(R, "h:2"),
        Assignment(D),
        Assignment(R, None),  # no active: the replica waits, it is not promoted here
    ]


def test_a_replica_whose_active_has_no_known_address_waits() -> None:
    assert want([["n2", "n1"]], "n1", addresses={"n1": "h:1"}) == [Assignment(R, None)]


def test_forward_new_active_is_fed_from_the_current_active() -> None:
    chains, forward = [["n1", "n2"]], [["n3", "n2"]]
    assert want(chains, "n3", forward=forward, engine=[D]) == [Assignment(R, "h:1")]
    assert want(chains, "n2", forward=forward, engine=[R]) == [Assignment(R, "h:1")]
    assert want(chains, "n1", forward=forward, engine=[A]) == [Assignment(A)]


def test_forward_a_handed_over_active_stays_dead_and_the_taker_stays_active() -> None:
    chains, forward = [["n1", "n2"]], [["n3", "n2"]]
    assert want(chains, "n1", forward=forward, engine=[D]) == [Assignment(D)]
    assert want(chains, "n3", forward=forward, engine=[A]) == [Assignment(A)]


def test_forward_a_source_mid_takeover_stays_pending_until_it_is_handed_over() -> None:
    """The takeover's source turns PENDING once caught up (dcp/producer/takeover.py):
    reconciling it back to ACTIVE then would abort the hand-over."""
    chains, forward = [["n1", "n2"]], [["n3", "n2"]]
    assert want(chains, "n1", forward=forward, engine=[P]) == [Assignment(P)]
    # without a move in flight, a pending head is an anomaly: the map's ACTIVE wins
    assert want(chains, "n1", engine=[P]) == [Assignment(A)]


def test_forward_keeps_a_takeover_in_flight_but_not_one_from_elsewhere() -> None:
    chains, forward = [["n1", "n2"]], [["n3", "n2"]]
    taking = Assignment(R, "h:1", True)
    assert want(chains, "n3", forward=forward, engine=[R], current={0: taking}) == [taking]
    stale = Assignment(R, "h:9", True)  # a takeover from a node that is not the active
    assert want(chains, "n3", forward=forward, engine=[R], current={0: stale}) == [
        Assignment(R, "h:1")
    ]


def test_forward_a_copy_only_in_the_forward_chain_is_a_replica_of_the_active() -> None:
    chains, forward = [["n1", "n2"]], [["n1", "n3"]]
    assert want(chains, "n3", forward=forward, engine=[D]) == [Assignment(R, "h:1")]
    # n2 leaves the chain but keeps following until the map drops it
    assert want(chains, "n2", forward=forward, engine=[R]) == [Assignment(R, "h:1")]
