"""cluster/failover.py's choice of the replica to promote (pure)."""

from __future__ import annotations

from dcp.producer.cluster.failover import plan_failover
from dcp.producer.cluster.vbmap import VBucketMap


def test_a_replica_without_the_vbucket_in_replica_state_is_never_promoted() -> None:
    m = VBucketMap.from_names(2, [["n1", "n2", "n3"], ["n1", "n3", "n2"]])
    live = {"n2", "n3"}
    # n2 answered but holds vb 0 in no replica state (dead, or not built): n3 it is, even
    # though n2 comes first in the chain; vb 1 as usual by seqno
    plan = plan_failover(m, "n1", live, {"n2": {1: 9}, "n3": {0: 3, 1: 5}})
    assert plan.promoted == {0: "n3", 1: "n2"}
    # nobody holds vb 0: it is unavailable, not handed to an empty copy
    plan = plan_failover(m, "n1", live, {"n2": {1: 9}, "n3": {1: 5}})
    assert plan.unavailable == [0] and plan.vbmap.active(0) is None


def test_a_replica_that_did_not_answer_ranks_last_but_remains_a_candidate() -> None:
    m = VBucketMap.from_names(2, [["n1", "n2", "n3"]])
    assert plan_failover(m, "n1", {"n2", "n3"}, {"n3": {0: 1}}).promoted == {0: "n3"}
    assert plan_failover(m, "n1", {"n2", "n3"}, {}).promoted == {0: "n2"}  # chain order
