"""``python -m tools.bench`` keeps working: every scenario at a tiny size, output structure
checked.

One run of ``python -m tools.bench all --tiny --json`` (about 10-20 s) feeds every test here.
Nothing is asserted about speed (CI machines are small and noisy); only that each scenario ran, that
what the consumers received equals what was written, and that the JSON has the keys the
docs and plots read. The Redis half runs when ``redis-server`` and the ``redis`` package
are installed, and is skipped cleanly otherwise.
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
BENCH = [sys.executable, "-m", "tools.bench"]  # run from ROOT: ``-m`` finds ``tools`` there
SCENARIOS = [
    "ceiling",
    "stream-memory",
    "stream-disk",
    "ingest",
    "fanout",
    "latency",
    "slow-consumer",
]
SUMMARY_KEYS = {
    "runs",
    "median",
    "min",
    "max",
    "server_cpu_s",
    "client_cpu_s",
    "server_peak_rss_mib",
    "client_peak_rss_mib",
}

pytest.importorskip("psutil", reason="the bench tool needs psutil (the bench extra)")


def _redis_missing() -> str | None:
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis package is not installed"
    return None


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "tiny.json"
    cmd = [*BENCH, "all", "--tiny", "--json", "--no-install", "--output", str(out)]
    if _redis_missing():
        cmd.append("--no-peer")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    return printed


def test_document_has_the_machine_the_command_and_every_scenario(doc: dict[str, Any]) -> None:
    assert doc["tool"] == "tools.bench"
    assert "-m tools.bench all --tiny" in doc["command"]
    assert {"cpu", "cores", "memory_gib", "python"} <= set(doc["machine"])
    assert list(doc["results"]) == SCENARIOS


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_scenario_reports_medians_cpu_rss_and_a_goal(doc: dict[str, Any], name: str) -> None:
    res = doc["results"][name]
    assert {
        "name",
        "metric",
        "params",
        "ours",
        "peer",
        "ratio",
        "ok",
        "goal",
        "met",
        "wall_s",
    } <= set(res)
    summaries = [row["ours"] for row in res["rows"]] if name == "fanout" else [res["ours"]]
    for s in summaries:
        assert SUMMARY_KEYS <= set(s)
        assert s["runs"] and s["median"] is not None
        assert s["min"] <= s["median"] <= s["max"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_consumers_received_exactly_what_was_written(doc: dict[str, Any], name: str) -> None:
    res = doc["results"][name]
    assert res["ok"] is True
    rows = res["rows"] if name == "fanout" else [res]
    for row in rows:
        for side in ("ours", "peer"):
            for run in (row[side] or {}).get("runs", []):
                assert run["count"] == run["expected"], (name, side, run)


def test_scenario_specific_fields(doc: dict[str, Any]) -> None:
    r = doc["results"]
    assert r["ceiling"]["frame_only"]["median"] > 0
    assert [row["consumers"] for row in r["fanout"]["rows"]] == [1, 2]
    assert r["fanout"]["ours_extra_us"] is not None
    lat = r["latency"]["ours"]
    assert {"p50_ms", "p99_ms", "p999_ms", "max_ms"} <= set(lat)
    slow = r["slow-consumer"]["ours"]["runs"][0]
    assert slow["keys_final"] == slow["keys_expected"] > 0
    assert slow["wrong_last_values"] == 0 and slow["regressions"] == 0
    assert slow["rss_samples"] and r["slow-consumer"]["limit_mib"] > 0
    assert r["stream-memory"]["ceiling_fraction"] > 0


def test_redis_half_runs_alternately_with_ours(doc: dict[str, Any]) -> None:
    why = _redis_missing()
    if why:
        assert doc["peer"] is None and doc["peer_skipped"]
        pytest.skip(f"Redis peer not available: {why}")
    r = doc["results"]
    for name in ("stream-memory", "ingest", "latency"):
        assert r[name]["peer"]["runs"], name
        assert r[name]["ratio"] is not None
    for row in r["fanout"]["rows"]:
        assert row["peer"]["runs"]
    assert r["fanout"]["peer_extra_us"] is not None


def test_saved_results_render_as_table_markdown_and_plot(
    doc: dict[str, Any], tmp_path: Path
) -> None:
    src = tmp_path / "r.json"
    src.write_text(json.dumps(doc))
    md = subprocess.run(
        [*BENCH, "table", str(src), "--markdown"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert md.returncode == 0, md.stderr
    assert md.stdout.count("\n| stream-memory |") == 1
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    p = subprocess.run(
        [*BENCH, "plot", str(src), str(png)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
