"""``python -m tools.bench cluster`` keeps working: a tiny run, its output checked.

One run of ``python -m tools.bench cluster --tiny --json`` (a real etcd and three, then
four, ``dcp-server --cluster`` nodes: a kill -9 failover, then a 3 -> 4 rebalance of
3000 items) feeds every test here. Nothing is asserted about speed; only that each part
measured what it says (the lease went before every vbucket was writable again, the
rebalance moved items and every copy holds its active's data), that the settings given
are the ones reported, and that the JSON has the fields the report reads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("psutil", reason="the bench tool needs psutil (the bench extra)")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed"),
]


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "cluster.json"
    cmd = [sys.executable, "-m", "tools.bench", "cluster", "--tiny", "--json", "--no-install"]
    cmd += ["--timeout", "60", "--output", str(out)]
    cmd += ["--server-arg", "auto_failover_timeout=3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    return printed


def test_both_parts_ran_with_the_settings_reported(doc: dict[str, Any]) -> None:
    res = doc["results"]["cluster"]
    assert [r["name"] for r in res["rows"]] == ["cluster failover", "cluster rebalance"]
    assert res["params"]["auto_failover_timeout_s"] == 3.0  # the --server-arg given
    assert res["params"]["lease_ttl_s"] == 2
    assert res["ok"] is True and doc["peer"] is None
    assert res["summary"][0].startswith("cluster settings: lease TTL 2 s")
    assert res["goal"].startswith("failover <= auto_failover_timeout + 2 s")
    assert res["met"] == all(res["goals_met"].values())


def test_failover_measures_kill_to_every_vbucket_writable(doc: dict[str, Any]) -> None:
    res = doc["results"]["cluster"]
    (run,) = res["rows"][0]["ours"]["runs"]
    # the lease must go, and the failover timeout pass, before a promotion: counted from
    # the node's last keepalive, at most a third of the 2 s TTL before the kill
    assert 0 < run["lease_gone_s"] <= run["map_s"] <= run["failover_s"]
    assert run["map_s"] >= 3.0 - 2 / 3 - 0.2
    assert res["failover_s"] == run["failover_s"]
    assert res["goal_ratios"]["failover_vs_goal"] == pytest.approx(5.0 / run["failover_s"])


def test_rebalance_moved_every_item_it_counts(doc: dict[str, Any]) -> None:
    res = doc["results"]["cluster"]
    (run,) = res["rows"][1]["ours"]["runs"]
    assert run["ok"] is True and run["items"] >= doc["options"]["items"] == 3000
    # the fourth node's share: about a quarter of the actives and of the replicas
    assert run["vbuckets_moved"] >= doc["options"]["vbuckets"] // 4
    assert 0 < run["items_moved"] <= 2 * run["items"]
    assert run["rate"] == pytest.approx(run["items_moved"] / run["rebalance_s"])
    assert res["moved_rate"] == run["rate"]
