"""``python -m tools.bench.spark --tiny`` keeps working: every measure runs, DCP and
parquet read the same rows (the bench asserts it), and the JSON has the ratios against
the issue-#20 goals. Nothing is asserted about speed (small, shared machines)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[2]


def test_the_spark_bench_runs_tiny_beside_parquet() -> None:
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    p = subprocess.run(
        [sys.executable, "-m", "tools.bench.spark", "--tiny", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["rows"] == 4000 and res["history"] is True
    for key, goal in (("batch", 0.6), ("stream_query", 0.5), ("stream_inside", None)):
        m = res[key]
        assert m["ours_rows_per_s"] > 0 and m["parquet_rows_per_s"] > 0
        assert m["ratio"] == pytest.approx(m["ours_rows_per_s"] / m["parquet_rows_per_s"], 0.01)
        assert m["goal"] == goal
    live = res["max_offsets"]
    assert live["goal"] == 0.2 and live["live_rows"] == 1000
    # the limited run took more, smaller batches: the option was applied
    assert live["batches"][1] >= 2 and live["batches"][0] >= 1
