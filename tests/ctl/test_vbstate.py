"""dcpctl set-state / promote / move and the replication columns of vbuckets, against
``FakeNode`` (fake_node.py): the bytes dcpctl sends, its output and its exit status.

The same commands against real servers are in test_vbstate_live.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from dcp.ctl.vbstate import runs
from dcp.protocol import Status, VBucketState

from .fake_node import FakeNode
from .support import ctl, fails, ok, ok_json, table_header, table_rows

REPLICA, ACTIVE, DEAD = VBucketState.REPLICA, VBucketState.ACTIVE, VBucketState.DEAD


@pytest.fixture
def nodes() -> Iterator[tuple[FakeNode, FakeNode]]:
    peers: dict[str, FakeNode] = {}
    a, b = FakeNode(8, peers), FakeNode(8, peers)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def sent(node: FakeNode) -> list[tuple[int, int, int, object]]:
    """(vb, state byte, datatype, JSON options or None) of every SET_VBUCKET_STATE."""
    return [(vb, st, dt, json.loads(v) if v else None) for vb, st, dt, v in node.received]


# ---------------------------------------------------------------------- usage


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["set-state", "0-3", "bogus"], "invalid choice: 'bogus'"),
        (["set-state", "5-3", "dead"], "not a vbucket list"),
        (["set-state", "x", "dead"], "not a vbucket list"),
        (["set-state", "1"], "required"),
        (["set-state", "1", "replica", "--source", "nohost"], "is not HOST:PORT"),
        (["set-state", "1", "replica", "--source", "h:99999"], "is not HOST:PORT"),
        (["move", "3"], "--to"),
        (["move", "3", "--to", "h:"], "is not HOST:PORT"),
        (["move", "70000", "--to", "h:1"], "is not a vbucket id"),
        (["promote", "1-x"], "not a vbucket list"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], needle: str) -> None:
    r = ctl(*argv, port=1)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_source_only_goes_with_replica_or_pending(nodes) -> None:
    a, _ = nodes
    line = fails("set-state", "1", "active", "--source", "127.0.0.1:1", port=a.port, code=2)
    assert "--source goes with state replica or pending" in line
    assert a.received == []


def test_runs_group_consecutive_vbuckets_with_the_same_outcome() -> None:
    nmvb = (Status.NOT_MY_VBUCKET, "")
    got = runs({0: (0, ""), 1: (0, ""), 2: (0, ""), 4: (0, ""), 8: nmvb, 9: nmvb, 10: (0, "")})
    assert [(r["vbuckets"], r["status"], r["ok"]) for r in got] == [
        ("0-2", "SUCCESS", True),
        ("4", "SUCCESS", True),
        ("8-9", "NOT_MY_VBUCKET", False),
        ("10", "SUCCESS", True),
    ]


# ---------------------------------------------------------------------- set-state


def test_set_state_sends_one_request_per_vbucket_with_the_source_as_json(nodes) -> None:
    a, b = nodes
    out = ok("set-state", "0-3", "replica", "--source", b.address, port=a.port)
    assert sent(a) == [(vb, 2, 0x01, {"source": b.address}) for vb in range(4)]
    assert out.strip().splitlines() == [f"vb 0-3: replica (source {b.address})"]
    assert [a.states[vb] for vb in range(5)] == [REPLICA] * 4 + [ACTIVE]


def test_set_state_without_source_sends_no_value(nodes) -> None:
    a, _ = nodes
    doc = ok_json("set-state", "5", "dead", port=a.port)
    assert sent(a) == [(5, 4, 0, None)]
    assert doc["state"] == "dead" and doc["options"] is None
    assert doc["results"] == [
        {"first": 5, "last": 5, "status": "SUCCESS", "error": "", "vbuckets": "5", "ok": True}
    ]


def test_set_state_reports_each_range_and_fails_naming_the_first_refused_vbucket(nodes) -> None:
    a, _ = nodes
    a.refuse[6] = Status.ETMPFAIL
    r = ctl("set-state", "4-9", "pending", port=a.port)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout.strip().splitlines() == [
        "vb 4-5: pending",
        "vb 6: ETMPFAIL (fake refuses vb 6)",
        "vb 7: pending",
        "vb 8-9: NOT_MY_VBUCKET",
    ]
    assert r.stderr.strip() == (
        "dcpctl: SET_VBUCKET_STATE pending refused for 3 vbuckets: first vb 6: ETMPFAIL"
        " (fake refuses vb 6)"
    )
    # pipelined: every vbucket of the range was asked, not just up to the first error
    assert [vb for vb, *_ in a.received] == [4, 5, 6, 7, 8, 9]


# ---------------------------------------------------------------------- promote


def test_promote_without_vbuckets_promotes_every_replica(nodes) -> None:
    a, _ = nodes
    for vb in (2, 3, 5):
        a.states[vb] = REPLICA
    a.states[7] = DEAD
    out = ok("promote", port=a.port)
    assert sent(a) == [(2, 1, 0, None), (3, 1, 0, None), (5, 1, 0, None)]
    assert out.strip().splitlines()[-1] == f"promoted 3 vbuckets on {a.address}: vb 2-3, 5"
    assert a.states[7] == DEAD


def test_promote_named_vbuckets_counts_the_already_active_ones_apart(nodes) -> None:
    a, _ = nodes
    a.states[2] = REPLICA
    doc = ok_json("promote", "1-2", port=a.port)
    assert [vb for vb, *_ in sent(a)] == [1, 2]
    assert (doc["promoted"], doc["already_active"]) == (1, 1)


def test_promote_with_no_replica_sends_nothing(nodes) -> None:
    a, _ = nodes
    assert "nothing to promote" in ok("promote", port=a.port)
    assert a.received == []


def test_promote_of_a_missing_vbucket_fails(nodes) -> None:
    a, _ = nodes
    line = fails("promote", "9", port=a.port)
    assert "first vb 9: NOT_MY_VBUCKET" in line


# ---------------------------------------------------------------------- move


def test_move_takes_over_on_the_target_then_makes_the_source_its_replica(nodes) -> None:
    a, b = nodes
    a.high[3] = 42
    out = ok("move", "3", "--to", b.address, port=a.port)
    assert sent(b) == [(3, 2, 0x01, {"source": a.address, "takeover": True})]
    assert sent(a) == [(3, 2, 0x01, {"source": b.address})]
    assert (a.states[3], b.states[3]) == (REPLICA, ACTIVE)
    lines = out.strip().splitlines()
    assert lines[0] == f"{a.address}: vb 3 is active"
    assert lines[1] == f"{b.address}: vb 3 replica, taking over from {a.address}"
    assert lines[2].startswith(f"{b.address}: vb 3 active after ")
    assert lines[3:5] == [f"{a.address}: vb 3 dead", f"{a.address}: vb 3 replica of {b.address}"]
    assert lines[5].startswith(f"moved vb 3 from {a.address} to {b.address} in ")


def test_move_json_lists_the_steps(nodes) -> None:
    a, b = nodes
    doc = ok_json("move", "1", "--to", b.address, port=a.port)
    assert (doc["vbucket"], doc["from"], doc["to"]) == (1, a.address, b.address)
    want = [a.address, b.address, b.address, a.address, a.address]
    assert [s["node"] for s in doc["steps"]] == want


def test_move_gives_up_after_the_takeover_timeout_naming_the_stream_state(nodes) -> None:
    a, b = nodes
    b.takeover_finishes = False
    line = fails("move", "3", "--to", b.address, "--takeover-timeout", "0.5", port=a.port)
    assert f"vb 3 is still replica on {b.address} after 0.5 s" in line
    assert "stream takeover" in line
    assert a.received == []  # the source is left alone


def test_move_refuses_a_vbucket_that_is_not_active_on_the_source(nodes) -> None:
    a, b = nodes
    a.states[3] = REPLICA
    line = fails("move", "3", "--to", b.address, port=a.port)
    assert f"vb 3 is replica on {a.address}, not active" in line
    assert b.received == []


def test_move_fails_when_the_source_does_not_report_dead(nodes) -> None:
    a, b = nodes
    a.source_goes_dead = False
    line = fails("move", "3", "--to", b.address, port=a.port, timeout=60)
    assert f"{a.address} reports it active, not dead" in line
    assert a.received == []


def test_move_to_an_unreachable_node_fails_before_anything_changes(nodes) -> None:
    a, _ = nodes
    line = fails("move", "3", "--to", "127.0.0.1:1", port=a.port)
    assert "cannot connect to 127.0.0.1:1" in line
    assert a.received == []


# ---------------------------------------------------------------------- vbuckets


def test_vbuckets_shows_source_and_lag_against_the_source(nodes) -> None:
    a, b = nodes
    a.high[2] = 10
    b.states[2] = REPLICA
    b.high[2] = 7
    b.replication[2] = {"source": a.address, "stream": "streaming", "source_seqno": 9}
    rows = {r["vbucket"]: r for r in ok_json("vbuckets", port=b.port)["vbuckets"]}
    assert rows[2]["state"] == "replica" and rows[2]["source"] == a.address
    assert rows[2]["source_high_seqno"] == 10 and rows[2]["source_reachable"] is True
    assert rows[2]["lag"] == 3 and rows[2]["replication_lag"] == 2
    assert rows[2]["stream"] == "streaming"
    assert rows[0]["source"] is None and rows[0]["lag"] is None
    text = ok("vbuckets", port=b.port)
    assert table_header(text)[-4:] == ["source", "link", "src high", "lag"]
    body = table_rows(text)
    assert body[2][-4:] == [a.address, "streaming", "10", "3"]
    assert body[0][-4:] == ["-", "-", "-", "-"]
    assert body[-1][-1] == "3"


def test_vbuckets_with_an_unreachable_source_still_answers(nodes) -> None:
    _, b = nodes
    b.states[4] = REPLICA
    b.high[4] = 5
    b.replication[4] = {"source": "127.0.0.1:1", "stream": "backoff", "source_seqno": 8}
    row = ok_json("vbuckets", "--vb", "4", port=b.port)["vbuckets"][0]
    assert (row["source_reachable"], row["source_high_seqno"], row["lag"]) == (False, None, None)
    assert row["replication_lag"] == 3
    text = ok("vbuckets", "--vb", "4", port=b.port)
    assert table_rows(text)[0][-4:] == ["127.0.0.1:1", "backoff", "unreachable", "3*"]
    assert "* source unreachable" in text


def test_vbuckets_of_a_server_without_the_replication_group_has_no_such_columns(nodes) -> None:
    a, _ = nodes
    a.has_replication_group = False
    text = ok("vbuckets", port=a.port)
    assert table_header(text)[-1] == "streams"
    assert ok_json("vbuckets", port=a.port)["vbuckets"][0]["source"] is None


def test_move_with_a_zero_takeover_timeout_is_a_clear_error(nodes) -> None:
    # the timeout ends before the first GET_VBUCKET answer: an error line, no traceback
    a, b = nodes
    line = fails("move", "3", "--to", b.address, "--takeover-timeout", "0", port=a.port)
    assert "did not answer GET_VBUCKET 3 within 0s" in line
