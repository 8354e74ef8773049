"""The ``durability`` benchmark: write latency and throughput at each durability level on
a 3-node loopback cluster, beside Redis ``WAIT 1`` on a primary + replica, in one run.

- **ours**: etcd + nodes n1, n2, n3 (``dcp-server --cluster``, ``num_replicas=2``: every
  vbucket has three copies, so ``majority`` is the active and one replica), settled on
  its map. Levels: ``none``, ``majority``, ``majorityAndPersistActive``,
  ``persistToMajority``, ``persistActive`` (the durability frame info with a timeout of
  ``DURABILITY_TIMEOUT_MS``).
- **the peer**: two ``redis-server`` (persistence off), the second ``REPLICAOF`` the
  first; ``SET`` (beside our ``none``) and ``SET`` + ``WAIT 1 <timeout>`` (beside our
  ``majority``: the write is in the memory of two copies when answered, ours in two of
  three). Redis has nothing to set beside the persist levels.
- Two modes per level: **throughput** (closed loop: ``--window`` writes outstanding on
  each connection, for ``--seconds``) and **latency** (open loop at ``--rate`` writes/s for
  ``--seconds``: p50/p99 of the answer time, counted from when each write was due).
  Both sides use the same load generator (``durability_worker.py``: one process, the same
  number of connections, window, keys and value size).
- The ratios: majority throughput / none throughput (goal >= 0.5), majority p99 at
  the rate (goal <= 3 ms at 10 k writes/s), and ours / Redis for none and majority.

Rules of this module: as ``scale.py`` (fresh processes per repetition in a fresh scratch
directory, every one stopped by its PID, every wait bounded, nothing asserted about
speed). Ours and the peer run alternately inside a repetition, the order of the runs
reversed every other repetition; both sets of servers stay up for the repetition (the
idle side's CPU is in the JSON, per process). The cluster's lease TTL and failover
timeout are raised as in ``scale.py`` so that a loaded machine cannot fail a node over
in the middle of a measurement.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import trio

from .cluster_procs import HOST, Cluster, cluster, wait_settled
from .procs import BenchError, RedisServer, Scratch, Worker
from .scale import CLUSTER_SETTINGS, CpuMeter
from .scenarios import Ctx, summarize

__all__ = ["LEVELS", "PEER_LEVEL", "durability", "summary"]

LEVELS = ["none", "majority", "majorityAndPersistActive", "persistToMajority", "persistActive"]
#: our level -> the Redis write beside it
PEER_LEVEL = {"none": "none", "majority": "wait1"}
PEER_NAME = {"none": "Redis SET", "wait1": "Redis SET + WAIT 1"}
NODES = ["n1", "n2", "n3"]
DURABILITY_TIMEOUT_MS = 5000
GOAL_THROUGHPUT = 0.5  # majority / none
GOAL_P99_MS = 3.0  # majority, at 10 k writes/s
MODES = ("throughput", "latency")


# ---------------------------------------------------------------------- processes


@contextlib.contextmanager
def _ours(ctx: Ctx, sc: Scratch) -> Iterator[Cluster]:
    settings = ctx.server_args(log_level="WARNING", num_replicas=2, **CLUSTER_SETTINGS)
    with cluster(sc, ctx.o.vbuckets, settings, ctx.o.log_dir, NODES) as cl:
        trio.run(_settle, cl, ctx.o.timeout)
        yield cl


async def _settle(cl: Cluster, timeout: float) -> None:
    store = cl.store()
    try:
        await wait_settled(cl, store, NODES, timeout)
    finally:
        await store.aclose()


@contextlib.contextmanager
def redis_pair(sc: Scratch, timeout: float) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and its replica, linked (the replica's link up, the primary sees it
    online); both stopped at the end."""
    primary = RedisServer(sc.sub("redis-primary")).start()
    try:
        replica = RedisServer(sc.sub("redis-replica")).start()
        try:
            _link(primary.port, replica.port, timeout)
            yield primary, replica
        finally:
            replica.stop()
    finally:
        primary.stop()


def _link(primary: int, replica: int, timeout: float) -> None:
    import redis

    p = redis.Redis(host=HOST, port=primary)
    r = redis.Redis(host=HOST, port=replica)
    try:
        r.replicaof(HOST, primary)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = r.info("replication").get("master_link_status") == "up"
            online = p.info("replication").get("slave0", {}).get("state") == "online"
            if up and online:
                return
            time.sleep(0.05)
        raise BenchError(f"the Redis replica did not link to its primary within {timeout:g} s")
    finally:
        p.close()
        r.close()


# ---------------------------------------------------------------------- runs


def _run(
    ctx: Ctx, w: Worker, mode: str, level: str, pids: dict[str, int], servers: list[str]
) -> dict[str, Any]:
    """One measurement by the worker ``w``; CPU of ``pids`` and the worker over it."""
    o = ctx.o
    meter = CpuMeter({**pids, "client": w.proc.pid})
    w.send("run", mode=mode, level=level, seconds=o.seconds, rate=o.rate)
    res = w.expect("result", o.seconds + DURABILITY_TIMEOUT_MS / 1000 + 10 + o.timeout)
    cpu = meter.stop()
    res.pop("event", None)
    res["cpu"] = cpu
    res["server_cpu_s"] = sum(cpu["procs"][s]["cpu_s"] for s in servers)
    res["ok_run"] = not res["errors"] and res["unanswered"] == 0 and res["ok"] > 0
    answered = res["ok"] > 0
    res["p50_ms"] = res["answer_ms"]["p50"] if answered else None
    res["p99_ms"] = res["answer_ms"]["p99"] if answered else None
    return res


def _plan(levels: list[str], peer: bool, rep: int) -> list[tuple[str, str, str]]:
    """(mode, side, level) of one repetition, reversed every other repetition."""
    out = []
    for mode in MODES:
        out += [(mode, "ours", lv) for lv in levels]
        if peer:
            out += [(mode, "redis", PEER_LEVEL[lv]) for lv in levels if lv in PEER_LEVEL]
    return out[::-1] if rep % 2 else out


def _repetition(ctx: Ctx, levels: list[str], rep: int) -> list[dict[str, Any]]:
    o = ctx.o
    sc = ctx.scratch()
    runs: list[dict[str, Any]] = []
    try:
        with contextlib.ExitStack() as stack:
            ctx.step(f"durability: start cluster rep {rep + 1}/{o.reps}")
            cl = stack.enter_context(_ours(ctx, sc))
            workers: dict[str, Worker] = {}
            pids: dict[str, dict[str, int]] = {"ours": {n: cl.nodes[n].proc.pid for n in NODES}}
            pids["ours"]["etcd"] = cl.etcd.proc.pid
            common = {
                "vbuckets": o.vbuckets,
                "keys": o.keys,
                "window": o.window,
                "value_size": o.value_size,
                "timeout": o.timeout,
                "durability_timeout_ms": DURABILITY_TIMEOUT_MS,
            }
            boot = [(HOST, cl.nodes[n].port) for n in NODES]
            workers["ours"] = _worker(
                stack, ctx, "dura-ours", {**common, "bootstrap": boot, "conns_per_node": o.conns}
            )
            if ctx.peer:
                primary, replica = stack.enter_context(redis_pair(sc, o.timeout))
                pids["redis"] = {"primary": primary.proc.pid, "replica": replica.proc.pid}
                conns = o.conns * len(NODES)  # the same number of connections as ours
                workers["redis"] = _worker(
                    stack, ctx, "dura-redis", {**common, "port": primary.port, "connections": conns}
                )
            for w in workers.values():
                w.expect("ready", o.timeout)
            servers = {"ours": NODES, "redis": ["primary", "replica"]}
            warm = ctx.o.seconds / 4
            for side, w in workers.items():  # connections, replication streams, caches
                for lv in ("none", "majority" if side == "ours" else "wait1"):
                    w.send("run", mode="throughput", level=lv, seconds=warm, rate=o.rate)
                    w.expect("result", warm + DURABILITY_TIMEOUT_MS / 1000 + 10 + o.timeout)
            for mode, side, level in _plan(levels, ctx.peer, rep):
                ctx.step(f"durability: {side} {level} {mode} rep {rep + 1}/{o.reps}")
                res = _run(ctx, workers[side], mode, level, pids[side], servers[side])
                res.update(side=side, rep=rep)
                runs.append(res)
    finally:
        sc.close()
    return runs


def _worker(stack: contextlib.ExitStack, ctx: Ctx, role: str, params: dict[str, Any]) -> Worker:
    w = Worker(role, params, ctx.o.log_dir, script="durability_worker.py")
    stack.callback(w.close)
    return w


# ---------------------------------------------------------------------- the scenario


def _row(
    name: str, metric: str, key: str, ours: list[dict], peer: list[dict] | None, ctx: Ctx
) -> dict[str, Any]:
    """A table row: medians over the runs that had answers (all runs kept in ``runs``)."""
    row: dict[str, Any] = {"name": name, "metric": metric, "ratio": None, "peer": None}
    row["ours"] = summarize([r for r in ours if r[key] is not None], key)
    row["ours"]["runs"] = ours
    row["ok"] = all(r["ok_run"] for r in ours + (peer or []))
    row["peer_skipped"] = None
    if peer is None:
        row["peer_name"] = None
    elif not peer:
        row["peer_name"], row["peer_skipped"] = "Redis", ctx.peer_reason or "not run"
    else:
        row["peer_name"] = PEER_NAME[peer[0]["level"]]
        row["peer"] = summarize([r for r in peer if r[key] is not None], key)
        row["peer"]["runs"] = peer
        a, b = row["ours"]["median"], row["peer"]["median"]
        row["ratio"] = a / b if a is not None and b else None
    return row


def _median(rows: dict[tuple[str, str], dict[str, Any]], mode: str, level: str) -> float | None:
    row = rows.get((mode, level))
    return None if row is None else row["ours"]["median"]


def durability(ctx: Ctx) -> dict[str, Any]:
    o = ctx.o
    levels = (getattr(o, "levels", None) or ",".join(LEVELS)).split(",")
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        raise BenchError(f"--levels: {unknown} unknown; any of {LEVELS}")
    runs: list[dict[str, Any]] = []
    for rep in range(o.reps):
        runs += _repetition(ctx, levels, rep)
    params = {
        "nodes": len(NODES),
        "num_replicas": 2,
        "vbuckets": o.vbuckets,
        "levels": levels,
        "seconds": o.seconds,
        "rate": o.rate,
        "window": o.window,
        "connections": o.conns * len(NODES),
        "keys": o.keys,
        "value_size": o.value_size,
        "durability_timeout_ms": DURABILITY_TIMEOUT_MS,
    }
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for mode in MODES:
        for lv in levels:
            ours = [
                r for r in runs if r["side"] == "ours" and r["mode"] == mode and r["level"] == lv
            ]
            peer = None
            if lv in PEER_LEVEL:
                peer = [
                    r
                    for r in runs
                    if r["side"] == "redis" and r["mode"] == mode and r["level"] == PEER_LEVEL[lv]
                ]
            if mode == "throughput":
                name, metric, key = f"durability {lv} throughput", "writes/s", "rate"
            else:
                name, metric, key = (
                    f"durability {lv} p99",
                    f"answer p99 at {o.rate}/s (ms)",
                    "p99_ms",
                )
            row = _row(name, metric, key, ours, peer, ctx)
            row.update(level=lv, mode=mode)
            for k in ("p50_ms", "p99_ms"):
                xs = [r[k] for r in ours if r[k] is not None]
                row[f"ours_{k}"] = statistics.median(xs) if xs else None
            rows[(mode, lv)] = row
    out: dict[str, Any] = {
        "name": "durability",
        "metric": "durability levels",
        "params": params,
        "rows": list(rows.values()),
        "ours": None,
        "peer": None,
        "peer_name": "Redis primary + replica, SET / SET + WAIT 1",
        "peer_skipped": ctx.peer_reason,
        "ratio": None,
        "ok": all(r["ok"] for r in rows.values()),
    }
    out.update(_ratios(rows))
    out["summary"] = summary(out)
    return out


def _ratios(rows: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    none_t = _median(rows, "throughput", "none")
    maj_t = _median(rows, "throughput", "majority")
    maj_p99 = _median(rows, "latency", "majority")
    ratios: dict[str, float | None] = {
        "majority_vs_none_throughput": maj_t / none_t if maj_t is not None and none_t else None,
        "majority_p99_ms": maj_p99,
    }
    for lv in PEER_LEVEL:
        for mode in MODES:
            row = rows.get((mode, lv))
            if row is not None:
                ratios[f"{lv}_vs_redis_{PEER_LEVEL[lv]}_{mode}"] = row["ratio"]
    goals: dict[str, bool] = {}
    if ("throughput", "majority") in rows and ("throughput", "none") in rows:
        goals["majority throughput >= 0.5x none"] = (
            ratios["majority_vs_none_throughput"] or 0.0
        ) >= GOAL_THROUGHPUT
    if ("latency", "majority") in rows:
        goals["majority p99 <= 3 ms at the rate"] = maj_p99 is not None and maj_p99 <= GOAL_P99_MS
    return {"ratios": ratios, "goals_met": goals}


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    if x >= 10_000:
        return f"{x / 1000:,.1f} k{unit}"
    return f"{x:,.0f}{unit}" if x >= 100 else f"{x:.3g}{unit}"


def summary(res: dict[str, Any]) -> list[str]:
    """One line per level (both modes, the peer beside), then the ratios against the goals."""
    p = res["params"]
    lines = [
        f"durability: {p['nodes']} nodes, {p['num_replicas']} replicas, {p['vbuckets']} "
        f"vbuckets; {p['connections']} connections x window {p['window']} (throughput), "
        f"open loop {p['rate']}/s (latency), {p['seconds']:g} s each, {p['value_size']}-byte "
        f"values"
    ]
    by = {(r["mode"], r["level"]): r for r in res["rows"]}
    for lv in p["levels"]:
        t, lat = by[("throughput", lv)], by[("latency", lv)]
        errs: dict[str, int] = {}
        for r in t["ours"]["runs"] + lat["ours"]["runs"]:
            for k, v in r["errors"].items():
                errs[k] = errs.get(k, 0) + v
        line = (
            f"  {lv:<25} {_fmt(t['ours']['median'], '/s'):>10}  p50 "
            f"{_fmt(lat['ours_p50_ms'])} ms  p99 {_fmt(lat['ours_p99_ms'])} ms"
        )
        if t.get("peer"):
            pr, pl = t["peer"], lat.get("peer") or {}
            pl_runs = [r for r in pl.get("runs", []) if r["p50_ms"] is not None]
            p50 = statistics.median(r["p50_ms"] for r in pl_runs) if pl_runs else None
            line += (
                f"   | {t['peer_name']}: {_fmt(pr['median'], '/s')}  p50 {_fmt(p50)} ms  "
                f"p99 {_fmt(pl.get('median'))} ms"
            )
        kept = [r["rate"] for r in lat["ours"]["runs"]]
        if kept and statistics.median(kept) < 0.95 * p["rate"]:  # an open loop overrun
            line += f"   (answered {_fmt(statistics.median(kept), '/s')} of {p['rate']}/s)"
        if errs:
            line += f"   errors {errs}"
        lines.append(line)
    r = res["ratios"]
    maj = r.get("majority_vs_none_throughput")
    if maj is not None:
        lines.append(f"  majority / none throughput {maj:.2f}x (goal >= {GOAL_THROUGHPUT})")
    if r.get("majority_p99_ms") is not None:
        lines.append(
            f"  majority p99 {r['majority_p99_ms']:.2f} ms at {p['rate']}/s "
            f"(goal <= {GOAL_P99_MS:g} ms at 10000/s)"
        )
    for lv, plv in PEER_LEVEL.items():
        t = r.get(f"{lv}_vs_redis_{plv}_throughput")
        q = r.get(f"{lv}_vs_redis_{plv}_latency")
        if t is not None or q is not None:
            lines.append(f"  ours {lv} / {PEER_NAME[plv]}: throughput {_fmt(t)}x, p99 {_fmt(q)}x")
    return lines
