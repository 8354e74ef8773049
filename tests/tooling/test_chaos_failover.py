"""``python -m tools.chaos failover``: its checks catch what they claim to catch, and its
short form (one round of each kind: kill -9 of a node, SIGSTOP past the auto-failover
timeout, etcd kill -9, kill -9 and an immediate restart) passes strictly on a real 3-node cluster.

Rules of this module: the checker tests are pure (hand-made attempts and failover logs);
the run starts etcd and three ``dcp-server --cluster`` nodes on loopback and the harness
kills every one of them however it ends (``tools/chaos/procs.py``'s ``@scenario``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio

from tools.chaos.cli import failed
from tools.chaos.failover import KINDS, run_failover
from tools.chaos.failover_verify import epoch_violations, level_counts
from tools.chaos.failover_writer import LEVELS, LevelAttempt
from tools.chaos.writer import encode_value

U1, U2 = 1111, 2222


def w(
    key: str,
    version: int,
    *,
    uuid: int = U1,
    seqno: int = 0,
    sent: float = 0.0,
    acked: float = 0.0,
    node: str = "n1",
    op: str = "set",
    level: str = "majority",
    outcome: str = "ok",
) -> LevelAttempt:
    status = {"ok": "acked", "notfound": "rejected", "impossible": "rejected"}.get(
        outcome, "indeterminate"
    )
    value = encode_value(key, version, 0, 3).decode() if op == "set" else None
    return LevelAttempt(
        0, key, 0, version, op, level != "none", value, 0, status=status, uuid=uuid,
        seqno=seqno, level=level, outcome=outcome, node=node, t_sent=sent, t_acked=acked,
    )  # fmt: skip


# --------------------------------------------------------------------------- epoch checks


def test_a_takeover_hands_a_branch_to_another_node_without_a_violation() -> None:
    writes = [
        w("a", 1, seqno=1, sent=0.0, acked=0.1, node="n1"),
        w("b", 1, seqno=2, sent=0.2, acked=0.3, node="n1"),
        w("c", 1, seqno=3, sent=0.4, acked=0.5, node="n2"),  # same uuid: a takeover
        w("d", 1, seqno=4, sent=0.6, acked=0.7, node="n1"),  # and back
    ]
    findings, figures = epoch_violations(writes, {0: [[[U1, 0]]]})
    assert findings == []
    assert figures["branches_on_several_nodes"] == 1


def test_two_nodes_assigning_seqnos_on_one_branch_at_once_are_caught() -> None:
    dup = [w("a", 1, seqno=5, acked=1.0), w("b", 1, seqno=5, sent=0.5, acked=1.5, node="n2")]
    (f,) = epoch_violations(dup, {})[0]
    assert "seqno 5 acknowledged for two writes" in f
    # b was sent after a was acked at 7, yet got a lower seqno on the same branch
    late = [w("a", 1, seqno=7, acked=1.0), w("b", 1, seqno=6, sent=1.2, acked=1.5, node="n2")]
    (f,) = epoch_violations(late, {})[0]
    assert "two nodes took writes on one branch at once" in f
    # overlapping in time (b sent before a's ack): no proof, no finding
    ok = [w("a", 1, seqno=7, acked=1.0), w("b", 1, seqno=6, sent=0.9, acked=1.5, node="n2")]
    assert epoch_violations(ok, {})[0] == []


def test_an_old_branch_acking_a_write_sent_after_the_new_branch_acked_one_is_caught() -> None:
    logs = {0: [[[U2, 10], [U1, 0]]]}  # U2 branched off U1 at 10: U2 is newer
    new = w("n", 1, uuid=U2, seqno=11, sent=2.0, acked=3.0, node="n2")
    old_late = w("o", 1, uuid=U1, seqno=12, sent=3.5, acked=4.0, node="n1", level="none")
    (f,) = epoch_violations([new, old_late], logs)[0]
    assert "the old active still took writes" in f and "branch 1111" in f
    old_early = w("o", 1, uuid=U1, seqno=12, sent=2.5, acked=4.0, node="n1", level="none")
    assert epoch_violations([new, old_early], logs)[0] == []
    # without a log placing U2 above U1 nothing is known about their order
    assert epoch_violations([new, old_late], {0: [[[U1, 0]]]})[0] == []


# --------------------------------------------------------------------------- lost writes


def test_lost_writes_are_counted_per_level_and_only_majority_ones_are_findings() -> None:
    v = encode_value
    attempts = [
        w("m", 3, seqno=3),  # majority, final state holds v2: lost
        w("n", 3, seqno=3, level="none"),  # none, final holds v2: lost, only counted
        w("d", 2, op="del"),  # a delete, key absent: kept
        w("s", 1),  # set, key absent, a later delete tried: kept
        w("s", 2, op="del", outcome="error"),
        w("r", 1),  # set, key absent, the later delete refused (not found): lost
        w("r", 2, op="del", outcome="notfound"),
        w("k", 4),  # final holds a later version: kept
        w("x", 1, outcome="ambiguous"),
        w("y", 1, outcome="impossible"),
    ]
    state = {"m": v("m", 2, 0, 1).decode(), "n": v("n", 2, 0, 1).decode()}
    state["k"] = v("k", 5, 0, 1).decode()
    counts, findings = level_counts(attempts, state)
    assert counts["majority"]["lost"] == 2 and counts["none"]["lost"] == 1
    assert counts["majority"]["ambiguous"] == 1 and counts["majority"]["impossible"] == 1
    assert counts["majority"]["notfound"] == 1 and counts["majority"]["error"] == 1
    assert len(findings) == 2
    assert any("set:m v3" in f for f in findings) and any("set:r v1" in f for f in findings)


# --------------------------------------------------------------------------- the short run


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")
def test_short_failover_run_one_round_of_each_kind_passes_strictly(tmp_path: Path) -> None:
    report = trio.run(
        lambda: run_failover(
            tmp_path,
            rounds=len(KINDS),
            seed=17,
            num_vbuckets=8,
            keys_per_vb=4,
            normal_consumers=1,
            stable_consumers=1,
            min_up=0.5,
            max_up=1.0,
            heal_timeout=40.0,
            converge_timeout=40.0,
        )
    )
    assert not failed(report), report["findings"]
    assert report["round_kinds"] == dict.fromkeys(KINDS, 1)
    assert set(report["per_level"]) == set(LEVELS)
    assert all(c["acked"] > 0 for c in report["per_level"].values()), report["per_level"]
    assert report["acked_majority_lost"] == 0 and report["rollbacks_stable_only"] == 0
    assert all(c["snapshots"] > 0 for c in report["per_consumer"].values())
    assert report["epochs"]["acked_checked"] > 0
    assert (tmp_path / "report.json").exists() and (tmp_path / "writer.jsonl").exists()
