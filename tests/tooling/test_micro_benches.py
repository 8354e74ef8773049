"""The micro-benchmarks (``python -m tools.bench.micro.*``) run end to end on a tiny
workload (CI smoke tests, no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.micro import codec, engine, hotpath

ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_tiny_run_reports_every_phase(capsys: pytest.CaptureFixture[str]) -> None:
    res = engine.main(["--items", "2000", "--vbuckets", "16", "--no-sync", "--default-gc"])
    assert res["flushed_items"] == res["checkpoint_items"] == res["backfill_items"]
    for k in (
        "ingest_items_per_s",
        "flush_items_per_s",
        "update_flush_items_per_s",
        "backfill_items_per_s",
    ):
        assert res[k] > 0
    assert "backfill" in capsys.readouterr().out


@pytest.mark.parametrize("what", ["fill", "set", "flush", "kvencode"])
def test_every_hotpath_benchmark_runs_on_a_tiny_input(
    what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each subcommand runs its own imports and work: a stale import inside one (a module
    that moved) fails here, where ``--help`` would not notice."""
    hotpath.main([what, "--items", "300", "--vbuckets", "8", "--batch", "100", "--streams", "1,2"])
    out = capsys.readouterr().out
    assert out.startswith(what), out
    assert "us/" in out


def test_the_codec_benchmark_runs_on_a_tiny_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert codec.main(["--n", "50"]) == 0
    assert "construct compiled" in capsys.readouterr().out


@pytest.mark.parametrize(
    "module",
    [
        "tools.bench.micro.codec",
        "tools.bench.micro.hotpath",
        "tools.bench.micro.engine",
        "tools.bench.spark",
        "tools.bench",
        "tools.chaos",
        "tools.vectors",
    ],
)
def test_every_tool_runs_as_a_module_from_the_repository_root(module: str) -> None:
    """The commands tools/README.md gives (``python -m tools...``) start and parse flags."""
    p = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"python -m {module}" in p.stdout
