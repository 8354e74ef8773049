"""Planning decisions: rollback checks, snapshot-aligned ends, row budgets, grouping."""

from __future__ import annotations

import pytest

from dcp.spark.batch_plan import (
    VbRange,
    branch_uuid,
    group_ranges,
    plan_end,
    plan_ranges,
    rollback_seqno,
)
from dcp.spark.errors import OffsetError, RangeUnavailableError, RollbackDetectedError
from dcp.spark.offsets import VbPosition

LOG = [(222, 10), (111, 0)]  # newest first: branch 222 started at seqno 10


@pytest.mark.parametrize(
    ("pos", "high", "want"),
    [
        (VbPosition(111, 0), 50, None),  # seqno 0 never rolls back
        (VbPosition(111, 10), 50, None),  # old branch up to where the new one starts
        (VbPosition(111, 15), 50, 10),  # changes 11..15 of the old branch are gone
        (VbPosition(222, 50), 50, None),
        (VbPosition(222, 60), 50, 50),  # the server lost 51..60 without a new entry
        (VbPosition(999, 5), 50, 0),  # unknown branch: from scratch
        (VbPosition(0, 40), 50, None),  # no uuid given: accepted while reachable
    ],
)
def test_rollback_rule_matches_the_server_for_zero_width_snapshots(pos, high, want):
    assert rollback_seqno(pos, LOG, high) == want


def test_end_uuid_is_the_branch_that_holds_the_end():
    assert branch_uuid(LOG, 9) == 111
    assert branch_uuid(LOG, 10) == 222
    assert branch_uuid(LOG, 99) == 222


def test_idle_vbuckets_keep_their_start_position_exactly():
    start = {0: VbPosition(222, 50, 40), 1: VbPosition(222, 7)}
    end = plan_end(start, {0: 50, 1: 9}, {0: LOG, 1: LOG}, {})
    assert end[0] is start[0]  # unchanged, rollback mark included
    assert end[1] == VbPosition(111, 9, None, 7)  # p: where its change set started
    assert plan_end(start, {0: 50, 1: 7}, {0: LOG, 1: LOG}, {}) == start


def test_a_row_limit_cuts_only_at_observed_boundaries_and_always_progresses():
    start = {0: VbPosition(0, 0), 1: VbPosition(0, 0)}
    logs = {0: [(5, 0)], 1: [(5, 0)]}
    bounds = {0: [10, 20, 30], 1: [100]}
    end = plan_end(start, {0: 40, 1: 100}, logs, bounds, limit=25)
    assert end[0].seqno == 20 and end[1].seqno == 0  # round robin within the budget
    end = plan_end(start, {0: 40, 1: 100}, logs, {1: [100]}, limit=25)
    assert end[0].seqno == 40  # one whole snapshot even when it exceeds the budget
    end = plan_end(start, {0: 40, 1: 100}, logs, bounds, target={0: 20, 1: 50})
    assert (end[0].seqno, end[1].seqno) == (20, 50)


def test_a_rollback_fails_planning_with_the_facts():
    start = {3: VbPosition(111, 15)}
    with pytest.raises(RollbackDetectedError) as info:
        plan_end(start, {3: 50}, {3: LOG}, {})
    err = info.value
    assert (err.vbucket, err.vb_uuid, err.seqno, err.rollback_seqno) == (3, 111, 15, 10)
    assert "vbucket 3" in str(err) and "uuid 111" in str(err) and "seqno 15" in str(err)
    assert "roll back to seqno 10" in str(err) and "onRollback=rewind" in str(err)


def test_rewind_ends_the_vbucket_at_the_rollback_seqno_with_a_mark():
    start = {3: VbPosition(111, 15), 4: VbPosition(222, 20)}
    end = plan_end(start, {3: 50, 4: 30}, {3: LOG, 4: LOG}, {}, on_rollback="rewind")
    assert end[3] == VbPosition(222, 10, 10, 10, 1)  # generation 1: rows after it sort later
    ranges = plan_ranges(start, end)
    assert ranges == [
        VbRange(3, 222, 10, 10, 10, 222, 10, 1),
        VbRange(4, 222, 20, 30, None, 222, None, 0),
    ]


@pytest.mark.parametrize(
    ("prev", "rollback", "want"),
    [
        (12, 13, 12),  # inside the last change set (12, 15]: re-read it whole
        (13, 13, 13),  # the rollback seqno is that set's start: a boundary already
        (14, 13, 0),  # below the last set's start: earlier boundaries unknown, from 0
        (None, 13, 13),  # offsets without p (user-given): the rollback seqno
    ],
)
def test_a_rewind_goes_back_to_a_change_set_boundary(prev, rollback, want):
    """Rows of a change set are the newest version per key: rewinding into the middle of
    one would lose the versions it deduplicated (the sink undoes the rows above the
    rollback row's seqno and the re-read must bring every key changed since)."""
    log = [(222, rollback), (111, 0)]
    start = {3: VbPosition(111, 15, None, prev, 2)}
    end = plan_end(start, {3: 50}, {3: log}, {}, on_rollback="rewind")
    assert end[3] == VbPosition(branch_uuid(log, want), want, want, want, 3)


def test_a_position_ahead_of_the_server_is_not_called_a_loss():
    with pytest.raises(RollbackDetectedError) as info:
        plan_end({3: VbPosition(0, 99)}, {3: 50}, {3: LOG}, {})
    assert info.value.ahead and "is ahead of the server" in str(info.value)
    assert "lost by the server" not in str(info.value)


def test_a_vbucket_the_server_lost_is_an_error():
    with pytest.raises(RangeUnavailableError, match="vbucket 7"):
        plan_end({7: VbPosition()}, {0: 1}, {}, {})


def test_an_end_below_its_start_is_refused_not_planned_empty():
    with pytest.raises(OffsetError, match="below start"):
        plan_ranges({0: VbPosition(1, 9)}, {0: VbPosition(1, 5)})
    with pytest.raises(OffsetError, match="different vbuckets"):
        plan_ranges({0: VbPosition()}, {1: VbPosition()})


def test_ranges_spread_evenly_over_a_few_groups():
    ranges = [VbRange(vb, 1, 0, 10 + vb) for vb in range(64)]
    groups = group_ranges(ranges, 3)
    assert len(groups) == 3
    assert sorted(r.vbucket for g in groups for r in g) == list(range(64))
    loads = [sum(r.weight for r in g) for g in groups]
    assert max(loads) - min(loads) <= 73
    assert group_ranges(ranges[:2], 5) == [[ranges[1]], [ranges[0]]]
