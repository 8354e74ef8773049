"""The checkers the cluster tests rely on can fail: a balanced map passes, each way of
being unbalanced or unsettled is named, and a write log flags a lost acknowledged write.
(Pure: no etcd, no process.)"""

from __future__ import annotations

from dcp.producer.cluster.placement import compute_map
from dcp.producer.cluster.vbmap import VBucketMap

from .harness import balance_problems, expected_states
from .traffic import KeyLog, Writer, value_of

NODES = ["n1", "n2", "n3"]


def test_a_computed_map_is_balanced() -> None:
    m = compute_map(NODES, 32, 1)
    assert balance_problems(m, NODES) == []
    m4 = compute_map([*NODES, "n4"], 32, 1, m)
    assert balance_problems(m4, [*NODES, "n4"]) == []
    assert balance_problems(m4, NODES) != []  # n4 holds copies the test did not expect


def test_unbalanced_or_unsettled_maps_are_named() -> None:
    chains = [["n1", "n2"]] * 16 + [["n2", "n3"]] * 16
    assert any(
        "actives per node" in p for p in balance_problems(VBucketMap.from_names(1, chains), NODES)
    )
    m = compute_map(NODES, 32, 1)
    one_copy = VBucketMap(32, 1, m.servers, ((m.chains[0][0], -1), *m.chains[1:]))
    assert any("vb 0" in p and "2 distinct" in p for p in balance_problems(one_copy, NODES))
    no_active = VBucketMap(32, 1, m.servers, ((-1, m.chains[0][1]), *m.chains[1:]))
    assert any("vb 0 has no active" in p for p in balance_problems(no_active, NODES))
    fwd = list(m.chains)
    fwd[0] = (fwd[0][1], fwd[0][0])
    moving = VBucketMap(32, 1, m.servers, m.chains, tuple(fwd))
    assert any("moving" in p for p in balance_problems(moving, NODES))


def test_expected_states_follow_the_chains() -> None:
    m = VBucketMap.from_names(1, [["n1", "n2"], ["n2", "n3"], ["n3", "n1"]])
    assert expected_states(m, "n1") == {0: "active", 1: "dead", 2: "replica"}


def test_a_lost_acknowledged_write_is_flagged() -> None:
    w = Writer.__new__(Writer)  # only the log is used by ``lost``
    w.log = {
        b"a": KeyLog(acked=3, unacked={4}),  # 4 sent, answer lost: 3 or 4 are fine
        b"b": KeyLog(acked=1),
        b"c": KeyLog(acked=None, unacked={0}),  # never acknowledged: anything goes
        b"d": KeyLog(acked=2),
    }
    found = {
        b"a": value_of(b"a", 4),
        b"b": value_of(b"b", 0),  # an older version: the ack of 1 was lost
        b"c": None,
        b"d": None,  # gone
    }
    lost = w.lost(found)
    assert len(lost) == 2 and lost[0].startswith("b'b'") and lost[1].startswith("b'd'")
    found[b"b"], found[b"d"] = value_of(b"b", 1), value_of(b"d", 2)
    assert w.lost(found) == []
