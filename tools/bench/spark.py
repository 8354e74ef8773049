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

The goals (issue #20): batch >= 0.6x parquet, whole streaming query >= 0.5x parquet,
``maxOffsetsPerTrigger`` costing <= 20 % of the live stream's throughput.

With ``--replay`` a stand-in server (spark_replay.py: pre-encoded memory snapshots)
replaces the real one for the DCP measures (no live measure then).

    .venv/bin/python -m tools.bench.spark                # 1,000,000 rows, 1024 vbuckets
    .venv/bin/python -m tools.bench.spark --replay       # the same through the stand-in
    .venv/bin/python -m tools.bench.spark --tiny         # CI smoke (well under a minute)
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
from pathlib import Path
from typing import Any

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


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), 0.0 where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


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


def batch_read(df: Any) -> tuple[int, int, float]:
    t = time.perf_counter()
    n, nbytes = df.selectExpr(*AGG).collect()[0]
    return n, nbytes or 0, time.perf_counter() - t


def stream_read(reader: Any, opts: dict[str, Any] | None = None) -> dict[str, Any]:
    """``reader`` (a ``DataStreamReader``) drained by an ``availableNow`` query."""
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


GOALS = {"batch": 0.6, "stream": 0.5, "max_offsets_cost": 0.20}


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
    ap.add_argument("--json", action="store_true", help="print one JSON line instead")
    args = ap.parse_args(argv)
    if args.tiny:
        args.rows, args.vbuckets, args.rounds = 4000, 64, 4
    args.live_rows = args.live_rows or max(1, args.rows // 4)
    args.max_offsets = args.max_offsets or max(1, args.live_rows // 10)
    return args


def main(argv: list[str] | None = None) -> int:
    from tools.bench.spark_replay import start_replay

    args = parse_args(argv)
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
        c0 = cpu_seconds(proc.pid)
        ours_b = batch_read(dcp().load())
        res["server_cpu_batch_s"] = round(cpu_seconds(proc.pid) - c0, 2)
        pq_b = batch_read(spark.read.parquet(pq + "/rows"))
        ours_s = stream_read(dcp(stream=True))
        schema = spark.read.parquet(pq + "/rows").schema
        pq_s = stream_read(
            spark.readStream.schema(schema).format("parquet").option("path", pq + "/rows")
        )
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
    want = (args.rows, args.rows * args.value_size)
    for got in (
        ours_b[:2],
        pq_b[:2],
        (ours_s["rows"], ours_s["bytes"]),
        (pq_s["rows"], pq_s["bytes"]),
    ):
        assert got == want, (got, want)
    assert alone_n == args.rows, alone_n
    res.update(report(args, alone_n / alone_s, ours_b, pq_b, ours_s, pq_s, live))
    if args.json:
        print(json.dumps(res))
    return 0


def report(
    args: Any, alone: float, ours_b: tuple, pq_b: tuple, ours_s: dict, pq_s: dict, live: dict
) -> dict[str, Any]:
    """The results as a dict, printed as a table unless ``--json``."""
    n = args.rows
    rows = [  # (key, name, ours rows/s, parquet rows/s, goal)
        ("batch", "batch read", n / ours_b[2], n / pq_b[2], GOALS["batch"]),
        (
            "stream_query",
            "stream: whole availableNow query",
            n / ours_s["query_s"],
            n / pq_s["query_s"],
            GOALS["stream"],
        ),
        (
            "stream_inside",
            "stream: inside batches (addBatch)",
            n / max(ours_s["inside_s"], 1e-9),
            n / max(pq_s["inside_s"], 1e-9),
            None,
        ),
    ]
    out: dict[str, Any] = {
        "rows": n,
        "vbuckets": args.vbuckets,
        "partitions": args.partitions,
        "cores": args.cores,
        "replay": args.replay,
        "history": not args.no_history,
        "python": sys.version.split()[0],
        "connector_alone_rows_per_s": round(alone),
        "stream_batches": ours_s["batches"],
    }
    for key, _name, ours, base, goal in rows:
        out[key] = {
            "ours_rows_per_s": round(ours),
            "parquet_rows_per_s": round(base),
            "ratio": round(ours / base, 3),
            "goal": goal,
        }
    if live:
        u, lim = live["unlimited"], live["limited"]
        cost = 1 - (args.live_rows / lim["s"]) / (args.live_rows / u["s"])
        out["max_offsets"] = {
            "live_rows": args.live_rows,
            "rounds": args.rounds,
            "maxOffsetsPerTrigger": args.max_offsets,
            "unlimited_s": round(u["s"], 3),
            "limited_s": round(lim["s"], 3),
            "writer_s": [round(u["write_s"], 3), round(lim["write_s"], 3)],
            "batches": [u["batches"], lim["batches"]],
            "cost": round(cost, 3),
            "goal": GOALS["max_offsets_cost"],
        }
    if args.json:
        return out
    print(
        f"rows={n:,} value={args.value_size} B vbuckets={args.vbuckets} "
        f"partitions={args.partitions} "
        f"local[{args.cores}] server={'stand-in (--replay)' if args.replay else 'dcp-server'} "
        f"history={not args.no_history} Python {out['python']}"
    )
    print(f"connector alone (1 connection, no Spark): {alone:,.0f} rows/s")
    print(f"{'measure':<36}{'ours rows/s':>13}{'parquet rows/s':>16}{'ratio':>8}{'goal':>8}  met")
    for _key, name, ours, base, goal in rows:
        ratio = ours / base
        met = "-" if goal is None else ("yes" if ratio >= goal else "NO")
        g = "-" if goal is None else f">={goal:.1f}x"
        print(f"{name:<36}{ours:>13,.0f}{base:>16,.0f}{ratio:>7.2f}x{g:>8}  {met}")
    if live:
        m = out["max_offsets"]
        print(
            f"live stream, {args.live_rows:,} rows in {args.rounds} rounds: unlimited "
            f"{m['unlimited_s']:.2f} s ({m['batches'][0]} batches), maxOffsetsPerTrigger="
            f"{args.max_offsets:,} {m['limited_s']:.2f} s ({m['batches'][1]} batches); writer "
            f"alone took {m['writer_s'][0]:.2f} / {m['writer_s'][1]:.2f} s"
        )
        met = "yes" if m["cost"] <= GOALS["max_offsets_cost"] else "NO"
        print(f"maxOffsetsPerTrigger cost {m['cost']:.0%} (goal <= 20%)  {met}")
    return out


if __name__ == "__main__":
    sys.exit(main())
