"""The harness's verifier catches what it claims to catch (synthetic journals, no server)."""

from __future__ import annotations

from dcp.protocol import codec
from tools.chaos.verify import Truth, check_server_state, verify_journal
from tools.chaos.view import Journal, View, read_journal, uuid_of
from tools.chaos.writer import Attempt

NV = 4
U1, U2 = 111, 222


def _key(vb: int, i: int = 0) -> str:
    n = 0
    while True:
        k = f"k{n:05d}"
        if codec.vbucket_for_key(k.encode(), NV) == vb:
            if i == 0:
                return k
            i -= 1
        n += 1


def _acked(
    i: int,
    key: str,
    version: int,
    seqno: int,
    *,
    op: str = "set",
    uuid: int = U1,
    durable: bool = False,
) -> Attempt:
    value = None if op == "del" else f"{key}|{version}|1|"
    return Attempt(
        i,
        key,
        codec.vbucket_for_key(key.encode(), NV),
        version,
        op,
        durable,
        value,
        1,
        status="acked",
        uuid=uuid,
        seqno=seqno,
    )


def _truth() -> tuple[Truth, str, str]:
    a, b = _key(0, 0), _key(0, 1)
    attempts = [_acked(0, a, 1, 1), _acked(1, b, 1, 2), _acked(2, a, 2, 3)]
    return Truth(attempts, NV), a, b


def test_whole_snapshots_matching_the_acknowledged_writes_verify_clean() -> None:
    truth, a, b = _truth()
    log = [[U1, 0]]
    ops = [["b", 0, 2, 3, 1, log, [[2, "m", b, f"{b}|1|1|"], [3, "m", a, f"{a}|2|1|"]]]]
    view, findings, counts = verify_journal("c", [ops], truth)
    assert findings == []
    assert view.state() == {a: f"{a}|2|1|", b: f"{b}|1|1|"}
    assert counts["checked_writes"] == 3


def test_a_snapshot_cut_before_its_end_is_reported_as_partial() -> None:
    truth, a, b = _truth()
    ops = [["b", 0, 2, 3, 1, [[U1, 0]], [[2, "m", b, f"{b}|1|1|"]]]]  # seqno 3 missing
    _, findings, _ = verify_journal("c", [ops], truth)
    assert any("partial snapshot" in f and a in f for f in findings), findings


def test_a_skipped_snapshot_is_reported_as_a_lost_change() -> None:
    truth, a, b = _truth()
    ops = [["b", 0, 3, 3, 1, [[U1, 0]], [[3, "m", a, f"{a}|2|1|"]]]]  # [1, 2] never came
    _, findings, _ = verify_journal("c", [ops], truth)
    assert any("lost change" in f and b in f for f in findings), findings


def test_a_value_nobody_wrote_is_reported_as_invented() -> None:
    truth, a, b = _truth()
    ops = [
        [
            "b",
            0,
            1,
            3,
            1,
            [[U1, 0]],
            [[1, "m", a, f"{a}|1|1|"], [2, "m", b, "forged"], [3, "m", a, f"{a}|2|1|"]],
        ]
    ]
    _, findings, _ = verify_journal("c", [ops], truth)
    assert any("invented" in f for f in findings), findings


def test_a_change_kept_from_a_branch_the_server_lost_is_reported() -> None:
    a = _key(1)
    b = _key(1, 1)
    attempts = [
        _acked(0, a, 1, 1),
        _acked(1, a, 2, 2),  # seqno 2 lost by a crash
        _acked(2, b, 1, 2, uuid=U2),
    ]  # the new branch reuses seqno 2
    truth = Truth(attempts, NV)
    before = ["b", 1, 1, 2, 1, [[U1, 0]], [[1, "m", a, f"{a}|1|1|"], [2, "m", a, f"{a}|2|1|"]]]
    after = ["b", 1, 2, 2, 1, [[U2, 1], [U1, 0]], [[2, "m", b, f"{b}|1|1|"]]]
    _, findings, _ = verify_journal("c", [[before], [after]], truth)  # no rollback between
    assert any("branch" in f and a in f for f in findings), findings
    ok_view, ok, _ = verify_journal("c", [[before], [["r", 1, 1, 2, U1], after]], truth)
    assert [f for f in ok if "branch" in f] == []
    assert ok_view.state() == {a: f"{a}|1|1|", b: f"{b}|1|1|"}


def test_a_rollback_undoes_exactly_the_changes_above_its_seqno() -> None:
    v = View()
    v.apply_op(
        [
            "b",
            0,
            1,
            3,
            1,
            [[U1, 0]],
            [[1, "m", "x", "x1"], [2, "m", "y", "y1"], [3, "m", "x", "x2"]],
        ]
    )
    v.apply_op(["r", 0, 2, 3, U1])
    assert v.state() == {"x": "x1", "y": "y1"}
    assert v.vb(0).end == 2


def test_uuid_of_names_the_failover_entry_that_owns_a_seqno() -> None:
    log = [[U2, 10], [U1, 0]]
    assert uuid_of(11, log) == U2
    assert uuid_of(10, log) == U1
    assert uuid_of(0, log) is None


def test_a_journal_line_torn_by_a_kill_is_ignored_and_cut_before_the_next_append(tmp_path) -> None:
    path = tmp_path / "j.jsonl"
    j = Journal(path)
    j.append([["t", 0, 0]])
    j.close()
    with open(path, "ab") as f:
        f.write(b'[["b", 0, 1, 1')  # SIGKILL in the middle of a write
    assert list(read_journal(path)) == [[["t", 0, 0]]]
    j = Journal(path)
    j.append([["t", 1, 0]])
    j.close()
    assert list(read_journal(path)) == [[["t", 0, 0]], [["t", 1, 0]]]


def test_a_durable_write_missing_from_the_server_is_reported() -> None:
    a = _key(2)
    truth = Truth([_acked(0, a, 1, 1, durable=True)], NV)
    assert check_server_state({a: f"{a}|1|1|"}, truth, final_epoch=9, now=0) == []
    assert any("durable" in f for f in check_server_state({}, truth, final_epoch=9, now=0))
