"""The parts of ``dcpctl cluster`` that need no etcd: compact vbucket ranges, the lag
report built from STAT pairs, the command line."""

from __future__ import annotations

from typing import Any

from dcp.ctl.args import ranges_text, vb_list
from dcp.ctl.cluster_view import lag_report, parse_view
from dcp.producer.cluster.store import Snapshot
from dcp.producer.cluster.vbmap import VBucketMap

from .support import ctl
from .test_cluster_cmd import CHAINS, NODES


def test_ranges_text_is_vb_lists_inverse() -> None:
    assert ranges_text([9, 0, 1, 2, 3, 3]) == "0-3,9"
    assert ranges_text([]) == "" and ranges_text([5]) == "5"
    for text in ("0-3,9", "1,3-4,6,8-1023"):
        assert ranges_text(vb_list(text)) == text


def test_lag_report_measures_against_the_source() -> None:
    """n2 replicates vb 0-2 from n1: vb 1 is 40 behind n1's high seqno (n2 itself only
    heard of 30); n3 did not answer; n1 should replicate vb 6 and 7 but does not."""
    view = parse_view("c", Snapshot(1, {}))
    view.live = {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2", "n3": "127.0.0.1:3"}
    view.vbmap = VBucketMap.from_names(1, CHAINS, servers=list(NODES))
    repl = [("vb_0:state", "replica")]
    for vb, own, heard in ((0, 100, 100), (1, 60, 90), (2, 5, 5)):
        repl += [
            (f"vb_{vb}:source", "127.0.0.1:1"),
            (f"vb_{vb}:high_seqno", str(own)),
            (f"vb_{vb}:lag", str(heard - own)),
            (f"vb_{vb}:stream", "streaming"),
        ]
    n1_highs = [("vb_0:high_seqno", "100"), ("vb_1:high_seqno", "100"), ("vb_2:high_seqno", "5")]
    answers: dict[str, Any] = {
        "n1": ([("vb_6:state", "active")], n1_highs),
        "n2": (repl, []),
        "n3": "cannot connect to 127.0.0.1:3: connection refused",
    }
    rep = lag_report(view, answers)
    nodes = {n["node"]: n for n in rep["nodes"]}
    assert (nodes["n2"]["caught_up"], nodes["n2"]["behind"], nodes["n2"]["max_lag"]) == (2, 1, 40)
    assert nodes["n1"]["not_replicating"] == 2 and nodes["n1"]["replicas"] == 2
    assert nodes["n3"]["state"] == "unreachable" and "connection refused" in nodes["n3"]["error"]
    first = rep["copies"][:3]
    assert [(c["vb"], c["node"], c["stream"]) for c in first[:2]] == [
        (6, "n1", "not replicating"),
        (7, "n1", "not replicating"),
    ]
    assert first[2] | {} == {
        "vb": 1,
        "node": "n2",
        "source": "n1",
        "stream": "streaming",
        "high_seqno": 60,
        "source_high_seqno": 100,
        "lag": 40,
        "measured": "source",
    }


def test_cluster_help_lists_every_action() -> None:
    r = ctl("cluster", "--help")
    assert r.returncode == 0
    for action in ("nodes", "map", "rebalance", "failover", "reset-autofailover", "lag"):
        assert action in r.stdout
