"""The results of ``python -m tools.bench.spark`` (tools/bench/spark.py): JSON and table.

Rules of this module:
- Every repeated measure is summarised by its median, which is what the ratio and the
  goal use (a single slow or fast run of a JVM cannot move it), with min and max beside
  it; the JSON also carries every run's seconds and CPU by class.
- Rates are rows per second of each run, so min/max are the slowest/fastest run.
- It only formats: the runs and their checks are tools/bench/spark.py's.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from tools.bench.spark_cpu import CLASSES, per_million

GOALS = {"batch": 0.6, "stream": 0.5, "max_offsets_cost": 0.20}

# (JSON key, printed name, which runs, which seconds, goal)
MEASURES = (
    ("batch", "batch read", "batch", "s", GOALS["batch"]),
    ("stream_query", "stream: whole availableNow query", "stream", "query_s", GOALS["stream"]),
    ("stream_inside", "stream: inside batches (addBatch)", "stream", "inside_s", None),
)
# the runs whose CPU is reported (the stream's "inside" is part of the same runs)
CPU_MEASURES = (("batch", "batch read"), ("stream_query", "stream (whole query)"))


def _rates(rows: int, runs: list[dict[str, Any]], key: str) -> list[float]:
    return [rows / max(r[key], 1e-9) for r in runs]


def summarise(args: Any, runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per measure: medians, min/max, the ratio and goal, every run's seconds and CPU."""
    n = args.rows
    out: dict[str, Any] = {}
    for key, _name, which, secs, goal in MEASURES:
        ours = _rates(n, runs[which]["ours"], secs)
        base = _rates(n, runs[which]["parquet"], secs)
        m: dict[str, Any] = {
            "ours_rows_per_s": round(statistics.median(ours)),
            "parquet_rows_per_s": round(statistics.median(base)),
            "ratio": round(statistics.median(ours) / statistics.median(base), 3),
            "goal": goal,
            "ours_rows_per_s_min_max": [round(min(ours)), round(max(ours))],
            "parquet_rows_per_s_min_max": [round(min(base)), round(max(base))],
            "ours_s": [round(r[secs], 4) for r in runs[which]["ours"]],
            "parquet_s": [round(r[secs], 4) for r in runs[which]["parquet"]],
        }
        if key in dict(CPU_MEASURES):
            m["cpu_s"] = {
                side: {c: [round(r["cpu"][c], 3) for r in runs[which][side]] for c in CLASSES}
                for side in ("ours", "parquet")
            }
            m["cpu_s_per_1m_rows"] = {
                side: per_million([r["cpu"] for r in runs[which][side]], n)
                for side in ("ours", "parquet")
            }
        out[key] = m
    return out


def report(
    args: Any,
    alone: float,
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    live: dict[str, Any],
    machine: dict[str, Any],
) -> dict[str, Any]:
    """The results as a dict, printed as a table unless ``--json``."""
    n = args.rows
    out: dict[str, Any] = {
        "rows": n,
        "vbuckets": args.vbuckets,
        "partitions": args.partitions,
        "cores": args.cores,
        "reps": args.reps,
        "replay": args.replay,
        "history": not args.no_history,
        "python": sys.version.split()[0],
        **machine,
        "connector_alone_rows_per_s": round(alone),
        "stream_batches": runs["stream"]["ours"][0]["batches"],
    }
    out.update(summarise(args, runs))
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
    if not args.json:
        print_table(args, out)
    return out


def print_table(args: Any, out: dict[str, Any]) -> None:
    la0, la1 = (" ".join(f"{x:.2f}" for x in out[k]) for k in ("loadavg_start", "loadavg_end"))
    print(
        f"rows={args.rows:,} value={args.value_size} B vbuckets={args.vbuckets} "
        f"partitions={args.partitions} "
        f"local[{args.cores}] server={'stand-in (--replay)' if args.replay else 'dcp-server'} "
        f"history={not args.no_history} Python {out['python']}"
    )
    print(f"machine: nproc={out['nproc']}, load average {la0} at start, {la1} at end (1/5/15 min)")
    print(f"connector alone (1 connection, no Spark): {out['connector_alone_rows_per_s']:,} rows/s")
    print(
        f"median of {args.reps} alternating runs each, after one untimed warm-up of each; "
        "[min-max] rows/s"
    )
    print(f"{'measure':<35}{'ours rows/s':>30}{'parquet rows/s':>32}{'ratio':>7}{'goal':>7}  met")
    for key, name, _which, _secs, goal in MEASURES:
        m = out[key]
        ratio = m["ratio"]
        met = "-" if goal is None else ("yes" if ratio >= goal else "NO")
        g = "-" if goal is None else f">={goal:.1f}x"
        cols = [
            f"{m[f'{s}_rows_per_s']:,} [{lo:,}-{hi:,}]"
            for s in ("ours", "parquet")
            for lo, hi in [m[f"{s}_rows_per_s_min_max"]]
        ]
        print(f"{name:<35}{cols[0]:>30}{cols[1]:>32}{ratio:>6.2f}x{g:>7}  {met}")
    print(f"CPU-s per 1M rows (median of {args.reps}): " + ", ".join(CPU_HELP))
    print(f"{'measure':<35}{'side':<9}" + "".join(f"{c:>9}" for c in (*CLASSES, "total")))
    for key, name in CPU_MEASURES:
        for side in ("ours", "parquet"):
            cpu = out[key]["cpu_s_per_1m_rows"][side]
            print(f"{name:<35}{side:<9}" + "".join(f"{cpu[c]:>9.2f}" for c in (*CLASSES, "total")))
    if "max_offsets" in out:
        m = out["max_offsets"]
        print(
            f"live stream, {args.live_rows:,} rows in {args.rounds} rounds: unlimited "
            f"{m['unlimited_s']:.2f} s ({m['batches'][0]} batches), maxOffsetsPerTrigger="
            f"{args.max_offsets:,} {m['limited_s']:.2f} s ({m['batches'][1]} batches); writer "
            f"alone took {m['writer_s'][0]:.2f} / {m['writer_s'][1]:.2f} s (one run each)"
        )
        met = "yes" if m["cost"] <= GOALS["max_offsets_cost"] else "NO"
        print(f"maxOffsetsPerTrigger cost {m['cost']:.0%} (goal <= 20%)  {met}")


CPU_HELP = (
    "server = DCP server",
    "python = Spark's Python workers (pyspark.daemon and forks)",
    "jvm = Spark JVM",
    "driver = this process",
)
