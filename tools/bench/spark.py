"""Throughput of the Spark connector beside a parquet baseline of the same rows, same run.

Starts a DCP server subprocess on a fresh data directory (its default settings: the
change history is on), loads ``--rows`` documents of ``--value-size`` bytes over
``--vbuckets`` vbuckets, then measures on a local Spark session (``local[2]``, the test
tuning of docs/spark.md), each DCP measure beside the same measure on parquet:

- ``connector alone``: the executor code without Spark (one connection, in this process);
- ``batch read``: ``count(*), sum(length(value))`` over ``format("dcp")`` and over a
  parquet copy of exactly those rows (written once from the DCP read, untimed);
- ``stream``: an ``availableNow`` query whose ``foreachBatch`` runs the same aggregate,
  over ``readStream.format("dcp")`` and over the parquet directory as a file stream
  ("whole query": start to end; "inside": Spark's ``addBatch`` time);
- ``maxOffsetsPerTrigger``: a running stream (``startingOffsets=latest``, default
  trigger) while a writer adds ``--live-rows`` documents in ``--rounds`` rounds, timed
  from the first write to the last row in the sink, with and without
  ``maxOffsetsPerTrigger`` (``--max-offsets``). A backlog is cut only on boundaries the
  planner saw (docs/spark.md, Planning), so the limit only bites on a live feed.

The batch read and the stream each run once untimed per side (warm-up), then ``--reps``
times per side (3; ``--tiny`` 1), alternating ours and parquet, so both sides meet the
same JIT, GC and machine drift; the median is reported (min and max beside it) and used
for the ratio and the goal. Each timed run also records CPU seconds by process class
(DCP server, Spark's Python workers, JVM, this driver; tools/bench/spark_cpu.py),
printed per 1M rows, which shows where the time goes. The live measure runs once per
setting. The table (tools/bench/spark_report.py) starts with nproc and the load average
at start and end: a loaded machine moves every number.

The goals (issue #20): batch >= 0.6x parquet, whole streaming query >= 0.5x parquet,
``maxOffsetsPerTrigger`` costing <= 20 % of the live stream's throughput.

With ``--replay`` a stand-in server (spark_replay.py: pre-encoded memory snapshots)
replaces the real one for the DCP measures (no live measure then).

    .venv/bin/python -m tools.bench.spark                # 1,000,000 rows, 1024 vbuckets
    .venv/bin/python -m tools.bench.spark --replay       # the same through the stand-in
    .venv/bin/python -m tools.bench.spark --tiny         # CI smoke (about a minute)
    .venv/bin/python -m tools.bench.spark --reps 5 --json  # more runs, one JSON line

Rules of this module:
- Every process it starts (the server or stand-in, Spark's JVM) is stopped before it
  returns; everything listens on loopback.
- Every timed run's rows and bytes are checked against what was loaded before any
  number is reported: a fast wrong read fails the bench.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.bench import spark_cpu
from tools.bench.spark_report import report

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def start_server(data_dir: str, vbuckets: int, history: bool) -> tuple[subprocess.Popen, int]:
    """The server with its defaults (history on), or with ``history`` False, none."""
    cmd = [
        sys.executable,
        "-m",
        "dcp.producer",
        "--port",
        "0",
        "--data-dir",
        data_dir,
        *os.environ.get("BENCH_SERVER_ARGS", "").split(),
        "--num-vbuckets",
        str(vbuckets),
        "--log-level",
        "INFO",
    ]
    if not history:
        cmd += ["--history-seconds", "0", "--history-bytes", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"listening host=\S+ port=(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    else:
        raise SystemExit(f"server did not start (exit {proc.wait()})")
    stderr = proc.stderr
    threading.Thread(target=lambda: [None for _ in stderr], daemon=True).start()
    return proc, port


def load(
    port: int, rows: int, value_size: int, vbuckets: int, *, first: int = 0, step: int = 20_000
) -> float:
    """Write documents ``doc{first}`` .. ``doc{first + rows - 1}``, ``step`` at a time."""
    from dcp.consumer import BlockingKvClient

    value = b"x" * value_size
    t = time.perf_counter()
    with BlockingKvClient("127.0.0.1", port, num_vbuckets=vbuckets) as kv:
        for start in range(first, first + rows, step):
            stop = min(first + rows, start + step)
            kv.set_many({f"doc{i:09d}": value for i in range(start, stop)})
    return time.perf_counter() - t


def connector_alone(port: int) -> tuple[int, float]:
    from dcp.spark.arrow import to_record_batch
    from dcp.spark.batch_plan import VbRange
    from dcp.spark.driver import Planner
    from dcp.spark.executor import read_ranges
    from dcp.spark.options import parse_options

    cfg = parse_options({"port": str(port)}, streaming=False)
    planner = Planner(cfg)
    highs, _ = planner.refresh(force=True)
    planner.close()
    ranges = [VbRange(vb, 0, 0, h) for vb, h in sorted(highs.items()) if h]
    t = time.perf_counter()
    n = sum(to_record_batch(c).num_rows for c in read_ranges(cfg, ranges, "bench"))
    return n, time.perf_counter() - t


def session(cores: int) -> Any:
    from pyspark.sql import SparkSession

    s = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName("bench-spark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.extraJavaOptions", "-XX:+UseSerialGC")
        .getOrCreate()
    )
    s.sparkContext.setLogLevel("ERROR")
    return s


AGG = ("count(*)", "sum(length(value))")


def batch_read(df: Any) -> dict[str, Any]:
    t = time.perf_counter()
    n, nbytes = df.selectExpr(*AGG).collect()[0]
    return {"rows": n, "bytes": nbytes or 0, "s": time.perf_counter() - t}


def stream_read(reader: Any) -> dict[str, Any]:
    """``reader`` (a ``DataStreamReader``) drained by an ``availableNow`` query, from a
    fresh checkpoint (so every run reads everything)."""
    out: dict[str, Any] = {"rows": 0, "bytes": 0}

    def sink(df: Any, batch_id: int) -> None:
        n, nbytes = df.selectExpr(*AGG).collect()[0]
        out["rows"] += n
        out["bytes"] += nbytes or 0

    ck = tempfile.mkdtemp(prefix="bench-spark-ck-")
    try:
        t = time.perf_counter()
        q = (
            reader.load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", ck)
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination()
        out["query_s"] = time.perf_counter() - t
        progress = [p for p in q.recentProgress if p["numInputRows"]]
        out["batches"] = len(progress)
        out["inside_s"] = sum(p["durationMs"].get("addBatch", 0) for p in progress) / 1000
    finally:
        shutil.rmtree(ck, ignore_errors=True)
    return out


def live_stream(spark: Any, port: int, args: Any, first: int, max_offsets: int) -> dict[str, Any]:
    """A running query (from the latest offsets) while ``args.live_rows`` documents are
    written in ``args.rounds`` rounds: seconds from the first write to the last row."""
    seen = {"rows": 0, "batches": 0}
    done = threading.Event()

    def sink(df: Any, batch_id: int) -> None:
        n = df.count()
        seen["rows"] += n
        seen["batches"] += 1 if n else 0
        if seen["rows"] >= args.live_rows:
            done.set()

    reader = spark.readStream.format("dcp").option("port", port).option("startingOffsets", "latest")
    reader = reader.option("numPartitions", args.partitions)
    if max_offsets:
        reader = reader.option("maxOffsetsPerTrigger", max_offsets)
    ck = tempfile.mkdtemp(prefix="bench-spark-live-")
    reader = reader.option("startingOffsetsFile", ck + "/starting-offsets.json")
    q = reader.load().writeStream.foreachBatch(sink).option("checkpointLocation", ck).start()
    try:
        while not q.recentProgress:  # the first (empty) batch logged the start offsets
            time.sleep(0.05)
        step = max(1, args.live_rows // args.rounds)
        t = time.perf_counter()
        write_s = load(port, args.live_rows, args.value_size, args.vbuckets, first=first, step=step)
        if not done.wait(args.timeout):
            raise SystemExit(f"live stream: {seen['rows']} of {args.live_rows} rows arrived")
        total = time.perf_counter() - t
    finally:
        q.stop()
        shutil.rmtree(ck, ignore_errors=True)
    return {"s": total, "write_s": write_s, "batches": seen["batches"], "rows": seen["rows"]}


def alternate(
    reps: int, ours: Callable[[], dict], base: Callable[[], dict], server_pid: int
) -> dict[str, list[dict[str, Any]]]:
    """One untimed warm-up of each side, then ``reps`` timed runs of each, alternating
    ours/parquet, each with its CPU by process class (tools/bench/spark_cpu.py).

    Why: a single shot of either side mostly measures the JVM's state (JIT, GC, caches);
    alternating exposes both sides to the same drift of the machine and of the JVM."""
    ours()
    base()
    out: dict[str, list[dict[str, Any]]] = {"ours": [], "parquet": []}
    for _ in range(reps):
        for side, fn in (("ours", ours), ("parquet", base)):
            c0 = spark_cpu.sample(server_pid)
            r = fn()
            r["cpu"] = spark_cpu.delta(c0, spark_cpu.sample(server_pid))
            out[side].append(r)
    return out


def parse_args(argv: list[str] | None) -> Any:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench.spark", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--value-size", type=int, default=100)
    ap.add_argument("--vbuckets", type=int, default=1024)
    ap.add_argument("--partitions", type=int, default=2, help="Spark tasks per DCP read")
    ap.add_argument("--cores", type=int, default=2, help="local[N]")
    ap.add_argument("--no-history", action="store_true", help="server without a history window")
    ap.add_argument("--live-rows", type=int, help="maxOffsetsPerTrigger run: rows (rows/4)")
    ap.add_argument("--rounds", type=int, default=20, help="live writer rounds")
    ap.add_argument("--max-offsets", type=int, help="maxOffsetsPerTrigger (live rows / 10)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the live run")
    ap.add_argument("--replay", action="store_true", help="DCP reads from the stand-in server")
    ap.add_argument("--snapshot", type=int, default=10_000, help="--replay: items/snapshot")
    ap.add_argument("--tiny", action="store_true", help="CI smoke: 4,000 rows, 64 vbuckets")
    ap.add_argument("--reps", type=int, help="timed runs of each repeated measure (3; tiny 1)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead")
    args = ap.parse_args(argv)
    if args.tiny:
        args.rows, args.vbuckets, args.rounds = 4000, 64, 4
    if args.reps is None:
        args.reps = 1 if args.tiny else 3
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    args.live_rows = args.live_rows or max(1, args.rows // 4)
    args.max_offsets = args.max_offsets or max(1, args.live_rows // 10)
    return args


def main(argv: list[str] | None = None) -> int:
    from tools.bench.spark_replay import start_replay

    args = parse_args(argv)
    machine: dict[str, Any] = {"nproc": os.cpu_count(), "loadavg_start": os.getloadavg()}
    data = tempfile.mkdtemp(prefix="bench-spark-data-")
    pq = tempfile.mkdtemp(prefix="bench-spark-parquet-")
    t = time.perf_counter()
    if args.replay:
        proc, port = start_replay(args.rows, args.vbuckets, args.value_size, args.snapshot)
    else:
        proc, port = start_server(data, args.vbuckets, not args.no_history)
        load(port, args.rows, args.value_size, args.vbuckets)
    res: dict[str, Any] = {"load_s": round(time.perf_counter() - t, 2)}
    try:
        alone_n, alone_s = connector_alone(port)
        t = time.perf_counter()
        spark = session(args.cores)
        res["session_s"] = round(time.perf_counter() - t, 2)

        def dcp(stream: bool = False) -> Any:
            r = spark.readStream if stream else spark.read
            return r.format("dcp").option("port", port).option("numPartitions", args.partitions)

        t = time.perf_counter()
        dcp().load().write.parquet(pq + "/rows")  # also the first query (worker start-up)
        res["first_query_and_parquet_copy_s"] = round(time.perf_counter() - t, 2)
        schema = spark.read.parquet(pq + "/rows").schema
        runs = {
            "batch": alternate(
                args.reps,
                lambda: batch_read(dcp().load()),
                lambda: batch_read(spark.read.parquet(pq + "/rows")),
                proc.pid,
            ),
            "stream": alternate(
                args.reps,
                lambda: stream_read(dcp(stream=True)),
                lambda: stream_read(
                    spark.readStream.schema(schema).format("parquet").option("path", pq + "/rows")
                ),
                proc.pid,
            ),
        }
        live: dict[str, Any] = {}
        if not args.replay:
            live["unlimited"] = live_stream(spark, port, args, args.rows, 0)
            first = args.rows + args.live_rows
            live["limited"] = live_stream(spark, port, args, first, args.max_offsets)
        spark.stop()
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(pq, ignore_errors=True)
    machine["loadavg_end"] = os.getloadavg()
    want = (args.rows, args.rows * args.value_size)
    for which in runs.values():
        for side_runs in which.values():
            for r in side_runs:
                assert (r["rows"], r["bytes"]) == want, (r, want)
    assert alone_n == args.rows, alone_n
    res.update(report(args, alone_n / alone_s, runs, live, machine))
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
