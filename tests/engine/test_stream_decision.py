"""decide_stream_request follows protocol_spec/README.md §8 step by step (table-driven)."""

from __future__ import annotations

import pytest

from dcp.producer.engine import DecisionKind, decide_stream_request
from dcp.protocol.opcodes import SEQNO_MAX, Status, StreamRequestFlag, VBucketState

F = StreamRequestFlag
W, Y, Z = 0xAAAA, 0xBBBB, 0xCCCC
LOG = [(Y, 900), (W, 0)]  # newest first: the worked example of §5.4


def decide(**kw):
    args = dict(
        failover_log=LOG,
        high_seqno=950,
        purge_seqno=0,
        persisted_seqno=940,
        vb_state=VBucketState.ACTIVE,
        start=0,
        end=SEQNO_MAX,
        vb_uuid=0,
        snap_start=0,
        snap_end=0,
        flags=0,
        client_purge_seqno=0,
    )
    args.update(kw)
    return decide_stream_request(**args)


def req(start, ss, se, uuid, **kw):
    return dict(start=start, snap_start=ss, snap_end=se, vb_uuid=uuid, **kw)


# (test id, request fields, expected kind, expected rollback seqno or status)
CASES = [
    # pre-check 1: state
    ("replica_vbucket_is_streamable", dict(vb_state=VBucketState.REPLICA), "accept", None),
    (
        "pending_vbucket_is_not_my_vbucket",
        dict(vb_state=VBucketState.PENDING),
        "error",
        Status.NOT_MY_VBUCKET,
    ),
    (
        "dead_vbucket_is_not_my_vbucket",
        dict(vb_state=VBucketState.DEAD),
        "error",
        Status.NOT_MY_VBUCKET,
    ),
    (
        "active_only_flag_refuses_replica",
        dict(vb_state=VBucketState.REPLICA, flags=F.ACTIVE_VB_ONLY),
        "error",
        Status.NOT_MY_VBUCKET,
    ),
    ("active_only_flag_accepts_active", dict(flags=F.ACTIVE_VB_ONLY), "accept", None),
    # pre-check 4: ranges
    ("start_above_end_is_erange", dict(req(10, 10, 10, W), end=5), "error", Status.ERANGE),
    ("start_below_snapshot_is_erange", req(10, 11, 20, W), "error", Status.ERANGE),
    ("start_above_snapshot_is_erange", req(30, 11, 20, W), "error", Status.ERANGE),
    # rollback step 1: start 0
    ("start_0_unknown_uuid_never_rolls_back", req(0, 0, 0, Z), "accept", None),
    (
        "start_0_uuid_0_never_rolls_back_even_strict",
        req(0, 0, 0, 0, flags=F.STRICT_VB_UUID),
        "accept",
        None,
    ),
    (
        "start_0_strict_unknown_uuid_rolls_back_to_0",
        req(0, 0, 0, Z, flags=F.STRICT_VB_UUID),
        "rollback",
        0,
    ),
    ("start_0_strict_known_uuid_accepts", req(0, 0, 0, Y, flags=F.STRICT_VB_UUID), "accept", None),
    # rollback step 2: purge seqno
    ("start_below_purge_rolls_back_to_0", req(50, 50, 50, W, purge_seqno=100), "rollback", 0),
    (
        "start_equal_purge_does_not_roll_back",
        req(100, 100, 100, W, purge_seqno=100),
        "accept",
        None,
    ),
    (
        "client_purge_seqno_equal_to_ours_is_exempt",
        req(50, 50, 50, W, purge_seqno=100, client_purge_seqno=100),
        "accept",
        None,
    ),
    (
        "client_purge_seqno_different_is_not_exempt",
        req(50, 50, 50, W, purge_seqno=100, client_purge_seqno=99),
        "rollback",
        0,
    ),
    (
        "ignore_purged_tombstones_flag_zeroes_purge",
        req(50, 50, 50, W, purge_seqno=100, flags=F.IGNORE_PURGED_TOMBSTONES),
        "accept",
        None,
    ),
    (
        "purge_check_compares_start_not_snap_start",
        req(100, 40, 100, W, purge_seqno=60),
        "accept",
        None,
    ),
    # rollback step 3: uuid lookup
    ("unknown_uuid_rolls_back_to_0", req(10, 10, 10, Z), "rollback", 0),
    ("uuid_0_with_nonzero_start_rolls_back_to_0", req(10, 10, 10, 0), "rollback", 0),
    # steps 4-7 with an older branch (upper = 900)
    ("worked_example_first_request_rolls_back_to_900", req(1000, 1000, 1000, W), "rollback", 900),
    ("worked_example_rerequest_at_900_is_accepted", req(900, 900, 900, W), "accept", None),
    ("old_branch_snapshot_below_upper_accepted", req(500, 400, 600, W), "accept", None),
    ("old_branch_start_eq_snap_start_treats_se_as_start", req(800, 800, 1200, W), "accept", None),
    (
        "old_branch_snapshot_crossing_upper_rolls_back_to_snap_start",
        req(850, 800, 1000, W),
        "rollback",
        800,
    ),
    (
        "old_branch_whole_snapshot_past_upper_rolls_back_to_upper",
        req(1000, 950, 1000, W),
        "rollback",
        900,
    ),
    (
        "old_branch_partial_snapshot_past_upper_rolls_back_to_upper",
        req(960, 950, 1000, W),
        "rollback",
        900,
    ),
    # newest branch: upper = high seqno 950
    ("newest_uuid_within_high_seqno_accepted", req(940, 930, 950, Y), "accept", None),
    (
        "newest_uuid_snapshot_past_high_seqno_partial_rolls_back_to_snap_start",
        req(945, 930, 960, Y),
        "rollback",
        930,
    ),
    ("newest_uuid_start_past_high_rolls_back_to_high", req(960, 960, 960, Y), "rollback", 950),
    ("newest_uuid_start_eq_snap_start_clamps_snap_end", req(950, 950, 990, Y), "accept", None),
    (
        "newest_uuid_whole_snapshot_past_high_rolls_back_to_high",
        req(990, 955, 990, Y),
        "rollback",
        950,
    ),
    # post-checks
    ("to_latest_sets_end_to_high", req(10, 10, 10, Y, flags=F.TO_LATEST), "accept", None),
    ("disk_only_sets_end_to_persisted", req(10, 10, 10, Y, flags=F.DISK_ONLY), "accept", None),
    (
        "disk_only_with_start_past_persisted_is_erange",
        req(945, 945, 945, Y, flags=F.DISK_ONLY),
        "error",
        Status.ERANGE,
    ),
    (
        "to_latest_with_start_past_high_is_refused_by_rollback_first",
        req(960, 960, 960, Y, flags=F.TO_LATEST),
        "rollback",
        950,
    ),
    (
        "from_latest_starts_at_high",
        dict(flags=F.FROM_LATEST, start=3, snap_start=1, snap_end=7),
        "accept",
        None,
    ),
]


@pytest.mark.parametrize("fields,kind,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_stream_request_decision_table(fields, kind, expected) -> None:
    d = decide(**fields)
    assert d.kind is DecisionKind(kind), d.reason
    if kind == "rollback":
        assert d.status == Status.ROLLBACK
        assert d.rollback_seqno == expected
    elif kind == "error":
        assert d.status == expected
    else:
        assert d.status == Status.SUCCESS


def test_worked_example_of_reference_5_4() -> None:
    """C was promoted at 900; B saw W up to 1000 -> rollback to 900, then accepted."""
    first = decide(**req(1000, 1000, 1000, W))
    assert (first.kind, first.rollback_seqno) == (DecisionKind.ROLLBACK, 900)
    again = decide(**req(900, 900, 900, W))
    assert again.kind is DecisionKind.ACCEPT
    assert (again.start, again.snap_start, again.snap_end, again.vb_uuid) == (900, 900, 900, W)


def test_accept_reports_adjusted_range_and_uuid() -> None:
    d = decide(**req(10, 10, 10, Y, flags=F.TO_LATEST))
    assert (d.start, d.end, d.vb_uuid) == (10, 950, Y)
    d = decide(**req(10, 10, 10, Y, flags=F.DISK_ONLY))
    assert d.end == 940
    d = decide(**req(950, 950, 990, Y))
    assert (d.snap_start, d.snap_end) == (950, 950)  # clamped to H, no rollback


def test_from_latest_with_uuid_0_takes_newest_uuid() -> None:
    d = decide(flags=F.FROM_LATEST)
    assert d.kind is DecisionKind.ACCEPT
    assert (d.start, d.snap_start, d.snap_end, d.vb_uuid) == (950, 950, 950, Y)


def test_start_0_accept_with_uuid_0_reports_newest_uuid() -> None:
    assert decide().vb_uuid == Y


def test_uuid_lookup_scans_oldest_first_when_a_uuid_repeats() -> None:
    log = [(W, 500), (Y, 300), (W, 0)]  # duplicate W: the oldest entry (upper=300) wins
    d = decide(failover_log=log, **req(400, 400, 400, W))
    assert (d.kind, d.rollback_seqno) == (DecisionKind.ROLLBACK, 300)
