"""``python -m tools.bench.spark --tiny`` keeps working: every measure runs, DCP and
parquet read the same rows (the bench asserts it), and the JSON has the ratios against
the issue-#20 goals, every repeated run's seconds and its CPU by process class. Nothing
is asserted about speed (small, shared machines).

The CPU accounting (tools/bench/spark_cpu.py) is checked on its own with stand-in
processes that burn known CPU seconds: a fake "java" (a Python binary under that name)
with a reaped worker child, and a server with a reaped child, so a misbooked class
shows as a wrong amount."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.bench import spark_cpu
from tools.bench.spark import parse_args

ROOT = Path(__file__).resolve().parents[2]

# Burns ``seconds`` of this process's CPU time (not wall time: a loaded machine only
# makes it take longer), optionally in a reaped child first, then waits for stdin EOF.
BURNER = textwrap.dedent(
    """
    import subprocess, sys, time
    own, child, python, wait = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    if child:
        subprocess.run([python, __file__, str(child), "0", python, "no"], check=True)
    t = time.process_time()
    while time.process_time() - t < own:
        pass
    if wait == "wait":
        print("done", flush=True)
        sys.stdin.read()
    """
)


def test_reps_default_to_three_and_tiny_to_one() -> None:
    assert parse_args([]).reps == 3
    assert parse_args(["--tiny"]).reps == 1
    assert parse_args(["--tiny", "--reps", "2"]).reps == 2
    with pytest.raises(SystemExit):
        parse_args(["--reps", "0"])


# Run in a fresh interpreter: the accounting looks at the children of the process that
# samples, and a pytest process may already have a Spark JVM child (tests/spark's session).
ACCOUNT = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from pathlib import Path
    from tools.bench import spark_cpu
    burner, real = sys.argv[1], sys.argv[2]
    java = Path(burner).parent / "java"
    java.symlink_to(real)  # the process's name (comm) is "java": it stands in for Spark's
    before = spark_cpu.sample(server_pid=-1)  # neither process exists yet: 0 for both
    assert before["server"] == before["jvm"] == before["python"] == 0, before
    procs = []
    try:
        # the server: 0.3 s in a child it reaps, nothing itself
        server = subprocess.Popen([real, burner, "0", "0.3", real, "wait"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(server)
        # the "JVM": 0.3 s itself, 0.6 s in a Python child it reaps
        jvm = subprocess.Popen([str(java), burner, "0.3", "0.6", real, "wait"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(jvm)
        for p in procs:
            assert p.stdout.readline().strip() == b"done"
        spent = spark_cpu.delta(before, spark_cpu.sample(server.pid))
    finally:
        for p in procs:
            p.communicate(timeout=30)
    print(json.dumps(spent))
    """
)


def test_cpu_is_booked_to_server_jvm_and_python_workers(tmp_path: Path) -> None:
    burner = tmp_path / "burn.py"
    burner.write_text(BURNER)
    real = os.path.realpath(sys.executable)
    out = subprocess.run(
        [sys.executable, "-c", ACCOUNT, str(burner), real],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    spent = json.loads(out.stdout.strip().splitlines()[-1])
    # each burner also spends interpreter start-up (well under 0.3 s on any machine)
    assert 0.3 <= spent["server"] < 0.3 + 0.6, spent
    assert 0.3 <= spent["jvm"] < 0.3 + 0.6, spent  # the worker's 0.6 s is not the JVM's
    assert 0.6 <= spent["python"] < 0.6 + 0.6, spent
    assert spent["driver"] < 0.3, spent  # the sampling process only waited


def test_per_million_takes_the_median_per_class() -> None:
    runs = [
        {"server": 1.0, "python": 2.0, "jvm": 3.0, "driver": 0.0},
        {"server": 5.0, "python": 0.0, "jvm": 1.0, "driver": 0.0},
        {"server": 2.0, "python": 1.0, "jvm": 2.0, "driver": 1.0},
    ]
    got = spark_cpu.per_million(runs, 500_000)
    assert got == {"server": 4.0, "python": 2.0, "jvm": 4.0, "driver": 0.0, "total": 12.0}


@pytest.mark.spark
def test_the_spark_bench_runs_tiny_beside_parquet() -> None:
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    reps = 2
    p = subprocess.run(
        [sys.executable, "-m", "tools.bench.spark", "--tiny", "--reps", str(reps), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["rows"] == 4000 and res["history"] is True and res["reps"] == reps
    assert res["nproc"] >= 1 and len(res["loadavg_start"]) == len(res["loadavg_end"]) == 3
    for key, goal in (("batch", 0.6), ("stream_query", 0.5), ("stream_inside", None)):
        m = res[key]
        assert m["ours_rows_per_s"] > 0 and m["parquet_rows_per_s"] > 0
        assert m["ratio"] == pytest.approx(m["ours_rows_per_s"] / m["parquet_rows_per_s"], 0.01)
        assert m["goal"] == goal
        for side in ("ours", "parquet"):
            secs = m[f"{side}_s"]
            assert len(secs) == reps and all(s > 0 for s in secs)
            rates = [4000 / s for s in secs]
            lo, hi = m[f"{side}_rows_per_s_min_max"]
            # the JSON's seconds are rounded to 0.1 ms: rates agree to that precision
            assert lo == pytest.approx(min(rates), rel=2e-3)
            assert hi == pytest.approx(max(rates), rel=2e-3)
            assert m[f"{side}_rows_per_s"] == pytest.approx(statistics.median(rates), rel=2e-3)
    for key in ("batch", "stream_query"):
        cpu = res[key]["cpu_s"]
        for side in ("ours", "parquet"):
            assert set(cpu[side]) == set(spark_cpu.CLASSES)
            assert all(len(v) == reps for v in cpu[side].values())
            per = res[key]["cpu_s_per_1m_rows"][side]
            assert per["total"] > 0
        # Spark's JVM worked in every run; only our side makes the server stream rows
        assert all(v > 0 for v in cpu["ours"]["jvm"] + cpu["parquet"]["jvm"])
    server = {
        side: sum(sum(res[k]["cpu_s"][side]["server"]) for k in ("batch", "stream_query"))
        for side in ("ours", "parquet")
    }
    assert server["ours"] > server["parquet"], server
    live = res["max_offsets"]
    assert live["goal"] == 0.2 and live["live_rows"] == 1000
    # the limited run took more, smaller batches: the option was applied
    assert live["batches"][1] >= 2 and live["batches"][0] >= 1
