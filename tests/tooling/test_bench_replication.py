"""``python -m tools.bench replication`` keeps working: a tiny run, its output checked.

One run of ``python -m tools.bench replication --tiny --json`` (an active and a
``--replica-of`` replica, then stream-memory and stream-disk at the same size) feeds every
test here. Nothing is asserted about speed; only that the replica ended with exactly what
was written, that the lag run delivered every write from the replica, and that the JSON
has the fields docs/benchmarks.md reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("psutil", reason="the bench tool needs psutil (the bench extra)")


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "replication.json"
    cmd = [sys.executable, "-m", "tools.bench", "replication", "--tiny", "--json"]
    cmd += ["--no-install", "--timeout", "60", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    return printed


def test_runs_replication_then_the_streaming_figures_of_the_same_run(doc: dict[str, Any]) -> None:
    assert list(doc["results"]) == ["replication", "stream-memory", "stream-disk"]
    assert doc["peer"] is None  # two of our servers: no Redis half
    for name in ("stream-memory", "stream-disk"):
        assert doc["results"][name]["params"]["items"] == doc["options"]["items"]


def test_the_replica_holds_exactly_what_was_written(doc: dict[str, Any]) -> None:
    rep = doc["results"]["replication"]
    assert rep["ok"] is True
    rows = {row["name"]: row for row in rep["rows"]}
    assert list(rows) == [
        "replication applied",
        "replication persisted",
        "replication catch-up",
        "replication lag",
    ]
    for row in ("replication applied", "replication catch-up"):
        for run in rows[row]["ours"]["runs"]:
            assert run["count"] == run["expected"] == doc["options"]["items"]
            assert 0 < run["applied_s"] <= run["persisted_s"]
            assert run["applied_rate"] >= run["persisted_rate"] > 0
    assert rep["catchup_rate"] == rows["replication catch-up"]["ours"]["median"]
    for run in rows["replication lag"]["ours"]["runs"]:
        assert run["count"] == run["expected"] > 0  # every write arrived from the replica


def test_goals_ratios_and_beside_figures_are_reported(doc: dict[str, Any]) -> None:
    rep = doc["results"]["replication"]
    assert rep["goal"].startswith(">= 300 k/s applied")
    assert rep["met"] in (True, False)
    assert rep["applied_rate"] > 0 and rep["persisted_rate"] > 0
    assert 0 <= rep["lag_p50_ms"] <= rep["lag_p99_ms"]
    assert rep["goal_ratios"]["applied_vs_300k"] == pytest.approx(rep["applied_rate"] / 300_000)
    assert rep["goal_ratios"]["lag_5ms_vs_p99"] > 0
    for name in ("stream-memory", "stream-disk"):
        beside = rep["beside"][name]
        med = doc["results"][name]["ours"]["median"]
        assert beside["mutations_per_s"] == med
        assert beside["applied_vs_stream"] == pytest.approx(rep["applied_rate"] / med)


def test_saved_results_render_as_a_table(doc: dict[str, Any], tmp_path: Path) -> None:
    src = tmp_path / "r.json"
    src.write_text(json.dumps(doc))
    p = subprocess.run(
        [sys.executable, "-m", "tools.bench", "table", str(src)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "replication lag" in p.stdout and "replica applied" in p.stdout
