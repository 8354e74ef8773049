"""tools/bench_engine.py runs end to end on a tiny workload (CI smoke test, no timing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_engine.py"


def test_bench_engine_tiny_run_reports_every_phase(capsys) -> None:
    spec = importlib.util.spec_from_file_location("bench_engine", TOOL)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    res = mod.main(["--items", "2000", "--vbuckets", "16", "--no-sync", "--default-gc"])
    assert res["flushed_items"] == res["checkpoint_items"] == res["backfill_items"]
    for k in ("ingest_items_per_s", "flush_items_per_s", "update_flush_items_per_s",
              "backfill_items_per_s"):
        assert res[k] > 0
    assert "backfill" in capsys.readouterr().out
