"""DurabilityMonitor (dcp/producer/durability.py) on its own: fake seqnos and states."""

from __future__ import annotations

import pytest

from dcp.producer.durability import DurabilityMonitor
from dcp.protocol import DurabilityLevel as L


class Node:
    """This node's seqnos and states as the monitor reads them."""

    def __init__(self, n: int = 4) -> None:
        self.high = [0] * n
        self.persisted = [0] * n
        self.active = [True] * n
        self.changes = 0
        self.changed_vbs: list[object] = []
        self.soon: list = []

    def monitor(self, name: str = "A") -> DurabilityMonitor:
        m = DurabilityMonitor(
            name,
            len(self.high),
            high_seqno=self.high.__getitem__,
            persisted_seqno=self.persisted.__getitem__,
            is_active=self.active.__getitem__,
        )
        m.on_change = self._changed
        return m

    def _changed(self, vbs: object) -> None:
        self.changes += 1
        self.changed_vbs.append(None if vbs is None else tuple(vbs))  # type: ignore[arg-type]


def _topo(m: DurabilityMonitor, *chain: str | None) -> None:
    m.set_topology([chain] * m.num_vbuckets)


def test_single_node_majority_is_own_high_and_stable_is_own_persisted() -> None:
    node = Node()
    m = node.monitor()
    node.high[0], node.persisted[0] = 10, 7
    assert m.chain(0) == ("A",)
    assert m.majority_seqno(0) == 10
    assert m.majority_persisted_seqno(0) == 7
    assert m.stable_seqno(0) == 7  # one copy: only disk survives its failure
    assert m.possible(0, L.MAJORITY) and m.possible(0, L.PERSIST_TO_MAJORITY)
    assert m.satisfied(0, 10, L.MAJORITY)
    assert not m.satisfied(0, 10, L.PERSIST_TO_ACTIVE)
    assert not m.satisfied(0, 8, L.MAJORITY_AND_PERSIST_TO_ACTIVE)
    assert m.satisfied(0, 7, L.PERSIST_TO_MAJORITY)
    assert m.satisfied(0, 99, L.NONE)
    assert not m.satisfied(0, 1, 5)  # an undefined level never holds


def test_chain_of_two_needs_the_replica() -> None:
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B")
    node.high[1], node.persisted[1] = 10, 10
    assert m.majority_seqno(1) == 0 and m.stable_seqno(1) == 0
    assert m.acknowledge(1, "B", 6, 4, sent=10) == ""
    assert m.majority_seqno(1) == 6
    assert m.majority_persisted_seqno(1) == 4
    assert m.stable_seqno(1) == 6
    assert m.satisfied(1, 6, L.MAJORITY) and not m.satisfied(1, 7, L.MAJORITY)
    assert m.satisfied(1, 4, L.PERSIST_TO_MAJORITY)
    assert not m.satisfied(1, 5, L.PERSIST_TO_MAJORITY)
    node.persisted[1] = 5  # own persistence alone does not make persist-to-majority
    assert not m.satisfied(1, 5, L.PERSIST_TO_MAJORITY)


def test_chain_of_three_takes_the_second_largest() -> None:
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B", "C")
    node.high[2] = node.persisted[2] = 20
    m.acknowledge(2, "B", 5, 5, sent=20)
    assert m.majority_seqno(2) == 5  # A (20) and B (5)
    m.acknowledge(2, "C", 12, 3, sent=20)
    assert m.majority_seqno(2) == 12  # A and C hold 12
    assert m.majority_persisted_seqno(2) == 5
    # acks may go down (a replica rolled back)
    m.acknowledge(2, "C", 4, 3, sent=20)
    assert m.majority_seqno(2) == 5


@pytest.mark.parametrize(
    ("chain", "possible", "stable_is_persisted"),
    [
        (("A", None), False, True),  # k = 2, one copy
        (("A", None, None), False, True),  # k = 2, one copy
        (("A", "B", None), True, False),  # k = 2, two copies
        (("A", None, None, "D"), False, True),  # k = 3, two copies
    ],
)
def test_missing_copies_count_in_the_chain_length(
    chain: tuple[str | None, ...], possible: bool, stable_is_persisted: bool
) -> None:
    node = Node()
    m = node.monitor()
    _topo(m, *chain)
    node.high[0], node.persisted[0] = 9, 3
    for r in chain[1:]:
        if r is not None:
            m.acknowledge(0, r, 9, 9, sent=9)
    assert m.possible(0, L.MAJORITY) is possible
    assert m.possible(0, L.MAJORITY_AND_PERSIST_TO_ACTIVE) is possible
    assert m.possible(0, L.PERSIST_TO_MAJORITY) is possible
    assert m.possible(0, L.PERSIST_TO_ACTIVE) and m.possible(0, L.NONE)
    if not possible:
        assert m.majority_seqno(0) == 0
    assert m.stable_seqno(0) == (3 if stable_is_persisted else 9)


def test_hostile_acks_are_clamped_to_what_was_sent_and_held() -> None:
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B")
    node.high[0] = node.persisted[0] = 10
    why = m.acknowledge(0, "B", 1_000_000, 1_000_000, sent=7)
    assert "clamped" in why
    assert m.majority_seqno(0) == 7
    assert m.majority_persisted_seqno(0) == 7
    why = m.acknowledge(0, "B", 5, 6, sent=7)  # persisted above held
    assert "clamped" in why
    assert m.majority_persisted_seqno(0) == 5
    # without a persisted seqno the last one said is kept, within the held one
    assert m.acknowledge(0, "B", 3, None, sent=7) == ""
    assert m.majority_persisted_seqno(0) == 3
    assert m.acknowledge(0, "B", 6, None, sent=7) == ""
    assert m.majority_persisted_seqno(0) == 3


def test_acks_from_nodes_outside_the_chain_do_not_count() -> None:
    node = Node()
    m = node.monitor()
    node.high[0] = 5
    assert m.acknowledge(0, "B", 5, 5, sent=5) == ""  # single node: kept, not counted
    assert m.stable_seqno(0) == 0
    _topo(m, "A", "C")
    assert m.acknowledge(0, "X", 5, 5, sent=5) == ""  # a race (rebalance): no warning
    assert "itself" in m.acknowledge(0, "A", 5, 5, sent=5)
    assert m.majority_seqno(0) == 0


def test_forget_drops_acks_and_only_chain_members_count() -> None:
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B", "C")
    node.high[0] = 8
    m.acknowledge(0, "B", 8, 8, sent=8)
    m.acknowledge(0, "C", 6, 6, sent=8)
    m.forget(0, "B")
    assert m.majority_seqno(0) == 6
    _topo(m, "A", "B", "D")  # C left the chain: its ack no longer counts
    assert m.majority_seqno(0) == 0
    m.acknowledge(0, "D", 2, 2, sent=8)
    assert m.majority_seqno(0) == 2
    m.forget(0)
    assert m.majority_seqno(0) == 0


def test_not_active_here_means_zero_and_a_new_term() -> None:
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B")
    node.high[3] = node.persisted[3] = 4
    m.acknowledge(3, "B", 4, 4, sent=4)
    assert m.term(3) == 0
    m.state_changed(3)  # still active: nothing moves
    assert m.term(3) == 0 and m.majority_seqno(3) == 4
    node.active[3] = False
    m.state_changed(3)
    assert m.term(3) == 1
    assert m.majority_seqno(3) == m.stable_seqno(3) == 0
    node.active[3] = True
    m.state_changed(3)
    assert m.term(3) == 1
    assert m.majority_seqno(3) == 0  # the acks of the old term are gone
    assert m.term(0) == 0  # other vbuckets keep theirs


def test_wait_stable_is_one_shot_and_woken_by_acks_flushes_and_changes() -> None:
    node = Node()
    m = node.monitor()
    woken: list[str] = []
    # single node: stable = persisted; a flush wakes
    node.high[0] = 5
    m.wait_stable(0, 5, lambda: woken.append("flush"))
    m.flushed()
    assert woken == []
    node.persisted[0] = 5
    m.flushed()
    assert woken == ["flush"]
    m.flushed()
    assert woken == ["flush"]  # one shot
    # two copies: an ack of another vbucket does not wake; the right one does
    _topo(m, "A", "B")
    node.high[1] = node.high[2] = 9
    m.wait_stable(1, 9, lambda: woken.append("ack"))
    m.wait_stable(1, 20, lambda: woken.append("later"))
    m.acknowledge(2, "B", 9, 9, sent=9)
    m.acknowledge(1, "B", 8, 8, sent=9)
    assert woken == ["flush"]
    m.acknowledge(1, "B", 9, 9, sent=9)
    assert woken == ["flush", "ack"]
    assert m.waiting() == 1
    # a topology change wakes every waiter to re-check, so does a state change
    _topo(m, "A", "C")
    assert woken == ["flush", "ack", "later"]
    m.wait_stable(1, 20, lambda: woken.append("state"))
    node.active[1] = False
    m.state_changed(1)
    assert woken[-1] == "state" and m.waiting() == 0


def test_wait_stable_never_calls_back_from_inside_itself() -> None:
    node = Node()
    m = node.monitor()
    node.high[0] = node.persisted[0] = 3
    woken: list[int] = []
    m.wait_stable(0, 2, lambda: woken.append(1))  # due, but no call_soon: next change
    assert woken == []
    m.flushed()
    assert woken == [1]
    m.call_soon = node.soon.append
    m.wait_stable(0, 2, lambda: woken.append(2))
    assert woken == [1] and len(node.soon) == 1
    node.soon.pop()()
    assert woken == [1, 2]


def test_on_change_only_when_a_majority_moved() -> None:
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B", "C")
    node.high[0] = 10
    base = node.changes
    m.acknowledge(0, "B", 5, 0, sent=10)
    assert node.changes == base + 1
    m.acknowledge(0, "C", 3, 0, sent=10)  # second largest is still 5
    assert node.changes == base + 1
    m.acknowledge(0, "B", 5, 5, sent=10)  # persisted 2nd largest of (0, 5, 0): still 0
    assert node.changes == base + 1
    node.persisted[0] = 4
    m.flushed()
    assert node.changes == base + 2


def test_bad_topologies_are_refused() -> None:
    m = Node().monitor()
    with pytest.raises(ValueError):
        m.set_topology([("A",)])
    with pytest.raises(ValueError):
        m.set_topology([(), (), (), ()])
    m.set_topology([("A", "B")] * 4)
    m.set_topology(None)
    assert m.chain(2) == ("A",)
