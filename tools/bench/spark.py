"""Throughput of the Spark connector: rows/s inside batches (Arrow record batches from read).

Starts a DCP server subprocess on a fresh data directory, loads ``--rows`` documents of
``--value-size`` bytes, then measures on a local Spark session (``local[2]``, the test
tuning of docs/spark.md):

- ``connector alone``: the executor code without Spark (one connection, in this process):
  stream requests, snapshot checks, Arrow conversion;
- ``batch read``: ``spark.read.format("dcp")...load()`` then ``count(*), sum(length(value))``;
- ``stream``: ``readStream.format("dcp")`` with ``trigger(availableNow=True)`` and a
  ``foreachBatch`` doing the same aggregate. "inside" is Spark's ``addBatch`` duration
  (reading every row in the executors and aggregating it), "query" the whole run.

With ``--replay`` a minimal stand-in server (a separate process sending pre-encoded
memory snapshots of ``--snapshot`` items) replaces the real one, so the numbers measure
the connector and Spark without the server's disk backfill (which costs the real server
about a core-second per 500,000 items on the reference machine).

    .venv/bin/python -m tools.bench.spark                # 1,000,000 rows, real server
    .venv/bin/python -m tools.bench.spark --replay       # the same through the stand-in
    .venv/bin/python -m tools.bench.spark --rows 20000   # CI smoke (well under a minute)
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
    if history:
        cmd += ["--history-seconds", "3600"]
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


def serve_replay(rows: int, vbuckets: int, value_size: int, snapshot: int) -> None:
    """The ``--replay`` stand-in server (run in its own process): answers the handshake,
    GET_ALL_VB_SEQNOS and failover-log requests, and streams each requested vbucket from
    seqno 0 as pre-encoded memory snapshots (only the opaque is patched per request)."""
    import socket

    from dcp.protocol import Frame, Opcode, ServerSession, codec
    from dcp.protocol.layout import U32

    per = {vb: rows // vbuckets + (1 if vb < rows % vbuckets else 0) for vb in range(vbuckets)}
    value = b"x" * value_size
    encoded: dict[int, tuple[bytes, list[int]]] = {}
    for vb in range(vbuckets):
        parts, offs, pos = [], [], 0
        for start in range(1, per[vb] + 1, snapshot):
            end = min(per[vb], start + snapshot - 1)
            for f in [codec.snapshot_marker(vb, 0, start, end, 0x05)] + [
                codec.mutation(
                    vb,
                    0,
                    i,
                    1,
                    b"doc%09d" % (i * vbuckets + vb),
                    value,
                    cas=1_700_000_000_000_000_000 + i,
                    flags=7,
                )
                for i in range(start, end + 1)
            ]:
                parts.append(f)
                offs.append(pos)
                pos += len(f)
        encoded[vb] = (b"".join(parts), offs)
    log = codec.failover_log_value([(0x1234, 0)])
    pack_into = U32.pack_into

    def handle(conn: socket.socket) -> None:
        session = ServerSession()  # frames requests; the client's answers are absorbed
        opaques: dict[int, int] = {}
        with conn:
            while True:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                for f in session.receive_data(data):
                    if not isinstance(f, Frame):
                        continue  # a refused DCP message: the replay does not care
                    op, o = f.opcode, f.opaque
                    if op == Opcode.GET_ALL_VB_SEQNOS:
                        out = codec.response(
                            op, opaque=o, value=codec.all_vb_seqnos_value(sorted(per.items()))
                        )
                    elif op in (Opcode.DCP_GET_FAILOVER_LOG,):
                        out = codec.response(op, opaque=o, value=log)
                    elif op == Opcode.DCP_CLOSE_STREAM:
                        out = codec.response(op, opaque=o) + codec.stream_end(
                            f.vbucket, opaques.get(f.vbucket, 0), 1
                        )
                    elif op == Opcode.DCP_STREAM_REQ:
                        opaques[f.vbucket] = o
                        raw, offs = encoded[f.vbucket]
                        buf = bytearray(raw)
                        for off in offs:
                            pack_into(buf, off + 12, o)
                        out = codec.response(op, opaque=o, value=log) + bytes(buf)
                    elif f.magic == 0x80 and op != Opcode.DCP_BUFFER_ACK:
                        out = codec.response(op, opaque=o)
                    else:
                        continue
                    try:
                        conn.sendall(out)
                    except OSError:
                        return

    srv = socket.create_server(("127.0.0.1", 0))
    print(f"listening host=127.0.0.1 port={srv.getsockname()[1]}", file=sys.stderr, flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def start_replay(
    rows: int, vbuckets: int, value_size: int, snapshot: int
) -> tuple[subprocess.Popen, int]:
    code = (
        "from tools.bench.spark import serve_replay; "
        f"serve_replay({rows}, {vbuckets}, {value_size}, {snapshot})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, cwd=ROOT
    )  # ``-c`` puts the cwd first: ``tools`` imports from there
    assert proc.stderr is not None
    line = proc.stderr.readline()
    m = re.search(r"port=(\d+)", line)
    if not m:
        raise SystemExit(f"stand-in server did not start: {line}{proc.stderr.read()}")
    return proc, int(m.group(1))


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), 0.0 where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def load(port: int, rows: int, value_size: int, vbuckets: int) -> float:
    from dcp.consumer import BlockingKvClient

    value = b"x" * value_size
    t = time.perf_counter()
    with BlockingKvClient("127.0.0.1", port, num_vbuckets=vbuckets) as kv:
        for start in range(0, rows, 20_000):
            kv.set_many({f"doc{i:09d}": value for i in range(start, min(rows, start + 20_000))})
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


def batch_read(spark: Any, port: int, partitions: int) -> tuple[int, int, float]:
    df = spark.read.format("dcp").option("port", port).option("numPartitions", partitions).load()
    t = time.perf_counter()
    n, nbytes = df.selectExpr("count(*)", "sum(length(value))").collect()[0]
    return n, nbytes or 0, time.perf_counter() - t


def stream_read(spark: Any, port: int, partitions: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": 0, "bytes": 0}

    def sink(df: Any, batch_id: int) -> None:
        n, nbytes = df.selectExpr("count(*)", "sum(length(value))").collect()[0]
        out["rows"] += n
        out["bytes"] += nbytes or 0

    ck = tempfile.mkdtemp(prefix="bench-spark-ck-")
    try:
        t = time.perf_counter()
        q = (
            spark.readStream.format("dcp")
            .option("port", port)
            .option("numPartitions", partitions)
            .load()
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
        out["trigger_s"] = sum(p["durationMs"].get("triggerExecution", 0) for p in progress) / 1000
    finally:
        shutil.rmtree(ck, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench.spark", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--value-size", type=int, default=100)
    ap.add_argument("--vbuckets", type=int, default=64)
    ap.add_argument("--partitions", type=int, default=2, help="Spark tasks per read")
    ap.add_argument("--cores", type=int, default=2, help="local[N]")
    ap.add_argument("--history", action="store_true", help="server keeps a history window")
    ap.add_argument(
        "--replay",
        action="store_true",
        help="read from a stand-in server replaying pre-encoded snapshots",
    )
    ap.add_argument(
        "--snapshot",
        type=int,
        default=10_000,
        help="--replay: items per snapshot (the real server's checkpoint size)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line instead")
    args = ap.parse_args(argv)

    data = tempfile.mkdtemp(prefix="bench-spark-data-")
    if args.replay:
        t = time.perf_counter()
        proc, port = start_replay(args.rows, args.vbuckets, args.value_size, args.snapshot)
        load_s = time.perf_counter() - t
    else:
        proc, port = start_server(data, args.vbuckets, args.history)
    try:
        if not args.replay:
            load_s = load(port, args.rows, args.value_size, args.vbuckets)
        c0 = cpu_seconds(proc.pid)
        alone_n, alone_s = connector_alone(port)
        alone_cpu = cpu_seconds(proc.pid) - c0
        t = time.perf_counter()
        spark = session(args.cores)
        session_s = time.perf_counter() - t
        t = time.perf_counter()
        (
            spark.read.format("dcp").option("port", port).option("vbuckets", "0").load().count()
        )  # warm-up: the first query of a session pays worker start-up
        warm_s = time.perf_counter() - t
        c0 = cpu_seconds(proc.pid)
        b_rows, b_bytes, b_s = batch_read(spark, port, args.partitions)
        b_cpu = cpu_seconds(proc.pid) - c0
        st = stream_read(spark, port, args.partitions)
        st_cpu = cpu_seconds(proc.pid) - c0 - b_cpu
        spark.stop()
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(data, ignore_errors=True)
    assert alone_n == b_rows == st["rows"] == args.rows, (alone_n, b_rows, st["rows"])
    assert b_bytes == st["bytes"] == args.rows * args.value_size, (b_bytes, st["bytes"])
    res = {
        "rows": args.rows,
        "value_size": args.value_size,
        "vbuckets": args.vbuckets,
        "partitions": args.partitions,
        "history": args.history,
        "replay": args.replay,
        "python": sys.version.split()[0],
        "load_s": round(load_s, 2),
        "session_s": round(session_s, 2),
        "warmup_s": round(warm_s, 2),
        "alone_rows_per_s": round(alone_n / alone_s),
        "batch_read_s": round(b_s, 3),
        "batch_rows_per_s": round(b_rows / b_s),
        "stream_batches": st["batches"],
        "stream_inside_s": round(st["inside_s"], 3),
        "stream_inside_rows_per_s": round(st["rows"] / max(st["inside_s"], 1e-9)),
        "stream_query_s": round(st["query_s"], 3),
        "stream_query_rows_per_s": round(st["rows"] / st["query_s"]),
        "server_cpu_s": {
            "alone": round(alone_cpu, 2),
            "batch": round(b_cpu, 2),
            "stream": round(st_cpu, 2),
        },
    }
    if args.json:
        print(json.dumps(res))
        return 0
    print(
        f"rows={args.rows:,} value={args.value_size} B vbuckets={args.vbuckets} "
        f"partitions={args.partitions} local[{args.cores}] "
        f"server={'stand-in (--replay)' if args.replay else 'dcp-server'} "
        f"history={args.history} Python {res['python']}"
    )
    print(f"load {load_s:.1f} s, Spark session {session_s:.1f} s, first query {warm_s:.1f} s")
    print(f"{'measure':<35}{'seconds':>9}{'rows/s':>12}{'server CPU s':>14}")
    print(
        f"{'connector alone (1 connection)':<35}{alone_s:>9.3f}{res['alone_rows_per_s']:>12,}"
        f"{alone_cpu:>14.2f}"
    )
    print(
        f"{'batch read: count + sum(length)':<35}{b_s:>9.3f}{res['batch_rows_per_s']:>12,}"
        f"{b_cpu:>14.2f}"
    )
    print(
        f"{'stream: inside batches (addBatch)':<35}{st['inside_s']:>9.3f}"
        f"{res['stream_inside_rows_per_s']:>12,}{st_cpu:>14.2f}"
    )
    print(
        f"{'stream: whole availableNow query':<35}{st['query_s']:>9.3f}"
        f"{res['stream_query_rows_per_s']:>12,}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
