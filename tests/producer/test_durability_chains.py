"""DurabilityMonitor (dcp/producer/durability.py, durability_chains.py) across map
changes: forward chains, acks of nodes the map does not name yet, acks kept by the
stream that made them, state changes, copies this node does not hold, waiters taken
back, and which vbuckets a change reports."""

from __future__ import annotations

from dcp.protocol import DurabilityLevel as L

from .test_durability_monitor import Node, _topo

MAJORITY = int(L.MAJORITY)


def test_a_write_needs_a_majority_of_the_forward_chain_too() -> None:
    """The replica moves from C to E with the active unchanged: (A, B, C) -> (A, B, E).
    A write A and C hold is a majority of the old chain only; if the map flips and A
    dies, B or E is promoted without it. It waits until the new chain has it too."""
    node = Node()
    m = node.monitor()
    node.high[0] = node.high[1] = 10
    m.set_topology([("A", "B", "C")] * 4, [("A", "B", "E"), None, None, None])
    assert m.forward_chain(0) == ("A", "B", "E") and m.forward_chain(1) is None
    m.acknowledge(0, "C", 10, 10, sent=10)
    m.acknowledge(1, "C", 10, 10, sent=10)
    assert m.satisfied(1, 10, MAJORITY)  # not moving: the current chain alone
    assert not m.satisfied(0, 10, MAJORITY), "a majority of the old chain only"
    assert m.majority_seqno(0) == 0 and m.stable_seqno(0) == 0
    m.acknowledge(0, "E", 7, 7, sent=10)
    assert m.majority_seqno(0) == 7  # A and E of the new chain
    m.acknowledge(0, "B", 10, 10, sent=10)
    assert m.satisfied(0, 10, MAJORITY) and m.stable_seqno(0) == 10
    # forward chains too short for a majority make the majority levels impossible
    m.set_topology([("A", "B", "C")] * 4, [("A", None, None)] * 4)
    assert not m.possible(0, MAJORITY) and m.possible(0, int(L.PERSIST_TO_ACTIVE))


def test_a_node_acking_before_the_map_names_it_counts_once_it_does() -> None:
    """E streams (and acks) before this node reads the map adding it; E will not send the
    same ack again, so an idle vbucket would sit at majority 0 after the flip."""
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B", "C")
    node.high[0] = 9
    assert m.acknowledge(0, "E", 9, 9, sent=9) == ""  # not named yet: no warning
    assert m.majority_seqno(0) == 0
    _topo(m, "A", "B", "E")
    assert m.majority_seqno(0) == m.stable_seqno(0) == 9


def test_acks_are_forgotten_by_the_stream_that_made_them() -> None:
    """B reconnected: its new stream acked before its old connection was seen to close.
    The old stream going must not take the new stream's ack with it (B does not repeat
    an ack it sent)."""
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B")
    node.high[0] = 6
    old, new = object(), object()
    m.acknowledge(0, "B", 4, 4, sent=6, source=old)
    m.acknowledge(0, "B", 6, 6, sent=6, source=new)
    m.forget(0, source=old)
    assert m.majority_seqno(0) == 6
    m.forget(0, source=new)
    assert m.majority_seqno(0) == 0


def test_acks_on_a_vbucket_not_active_here_never_count() -> None:
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B")
    node.high[0] = 5
    node.active[0] = False
    m.state_changed(0)
    assert m.acknowledge(0, "B", 5, 5, sent=5) == ""
    node.active[0] = True
    m.state_changed(0)  # active now: the ack of the replica time does not count
    assert m.majority_seqno(0) == 0
    m.acknowledge(0, "B", 5, 5, sent=5)
    assert m.majority_seqno(0) == 5
    m.state_changed(0)  # told again, still active: no change, acks kept
    assert m.majority_seqno(0) == 5


def test_every_state_change_drops_the_acks() -> None:
    """A change the monitor hears of only as 'not active before' (a takeover's source
    going PENDING and back to ACTIVE) still drops what was acknowledged before it."""
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B")
    node.high[1] = 3
    m.acknowledge(1, "B", 3, 3, sent=3)
    node.active[1] = False
    m.state_changed(1)
    node.active[1] = True
    m.state_changed(1)
    assert m.majority_seqno(1) == 0


def test_only_the_copies_a_chain_names_count() -> None:
    """This node D is active for vb 0 (a takeover) while the map still says (A, -, -):
    it holds no copy the map knows of, so there is no majority of that chain."""
    node = Node()
    m = node.monitor("D")
    node.high[0] = node.persisted[0] = 4
    _topo(m, "A", None, None)
    assert not m.possible(0, MAJORITY)
    assert m.majority_seqno(0) == 0 and m.stable_seqno(0) == 0
    # (A, B, -) at D: two copies named, both replicas' acks are needed
    _topo(m, "A", "B", None)
    assert m.possible(0, MAJORITY)
    m.acknowledge(0, "B", 4, 4, sent=4)
    assert m.majority_seqno(0) == 0, "D counted itself"
    m.acknowledge(0, "A", 3, 3, sent=4)
    assert m.majority_seqno(0) == 3
    # named: D counts itself
    _topo(m, "D", "B", None)
    assert m.majority_seqno(0) == 4


def test_a_lone_named_copy_that_is_not_this_node_is_stable_at_what_it_persisted() -> None:
    node = Node()
    m = node.monitor("D")
    node.high[0] = node.persisted[0] = 8
    _topo(m, "A", None)
    assert m.stable_seqno(0) == 0
    m.acknowledge(0, "A", 8, 5, sent=8)
    assert m.stable_seqno(0) == 5


def test_a_waiter_that_goes_away_takes_its_callback_back() -> None:
    node = Node()
    m = node.monitor()
    woken: list[str] = []

    class Waiter:
        def __init__(self, name: str) -> None:
            self.name = name

        def wake(self) -> None:
            woken.append(self.name)

    gone, stays = Waiter("gone"), Waiter("stays")
    m.wait_stable(0, 3, gone.wake)  # a bound method: equal, not identical, when taken back
    m.wait_stable(0, 2, stays.wake)
    assert m.waiting() == 2
    assert m.cancel_wait(0, gone.wake) == 1
    assert m.cancel_wait(1, gone.wake) == 0
    assert m.waiting() == 1
    node.persisted[0] = 5
    m.flushed()
    assert woken == ["stays"] and m.waiting() == 0


def test_a_change_names_the_vbuckets_whose_writers_to_wake() -> None:
    node = Node()
    m = node.monitor()
    _topo(m, "A", "B")
    node.high[2] = 5
    node.changed_vbs.clear()
    m.acknowledge(2, "B", 5, 5, sent=5)
    assert node.changed_vbs == [(2,)]
    m.flushed()
    assert node.changed_vbs[-1] is None  # a flush: any vbucket's persisted seqno
    node.active[3] = False
    m.state_changed(3)
    assert node.changed_vbs[-1] == (3,)
