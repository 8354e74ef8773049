"""The ``scale`` benchmark: ingest and stream-memory on one node against two, in one run.

Each configuration gets fresh processes and the same data (``--items`` keys
``key-%012d``, 100-byte values) from the same load generators (``scale_worker.py``:
``--writers`` writer and ``--consumers`` consumer *processes*, the same count for every
configuration, each routing by the bucket config itself):

- ``c1``: a one-node cluster (etcd + ``dcp-server --cluster``): the baseline. It runs the
  same code paths as the two-node cluster (lease keepalives, the write gate, etcd on the
  machine), so the ratio is what a second node buys, not what cluster mode costs.
- ``c2r0``: two nodes, ``num_replicas=0`` (pure sharding): the headline ratio c2r0 / c1.
- ``c2r1``: two nodes, one replica each (each node also applies the other's writes).
- ``plain``: a plain ``dcp-server`` (no etcd), for reference: what cluster mode costs.

**ingest**: the writers write every item (each batch to its vbucket's active), timed from
"go" to the last answer. **stream-memory**: the consumers open one DCP connection per node
and a stream per vbucket from its active, then stop reading while the writers write
everything; once every node has flushed, "go" to the last of the items delivered.

The CPU of every process (each server, etcd, each load generator: user + system seconds
from ``/proc/<pid>/stat``) and of the whole machine (``/proc/stat``) is taken over the
measured phase, and the run says what limited it: all cores busy, one server process at
a full core (its GIL), or neither.

Rules of this module: as ``scenarios.py`` (fresh processes per run in a fresh scratch
directory, every one stopped by its PID, every wait bounded, nothing asserted about
speed). The cluster's lease TTL and failover timeout are raised (10 s / 30 s) so that a
fully loaded machine cannot make a node fence itself in the middle of a measurement.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import trio

from .cluster_procs import HOST, Etcd, cluster, high_seqnos, wait_settled
from .procs import BenchError, OurServer, Worker, stat, wait_persisted
from .scenarios import Ctx, _memory_quota, _scenario

__all__ = ["CONFIGS", "GOAL_INGEST", "GOAL_MEMORY", "scale", "summary"]

GOAL_INGEST = 1.6  # 2 nodes / 1 node
GOAL_MEMORY = 1.3
#: name -> (label, node names or None for a plain dcp-server, num_replicas)
CONFIGS: dict[str, tuple[str, list[str] | None, int]] = {
    "c1": ("1-node cluster", ["n1"], 0),
    "c2r0": ("2-node cluster, 0 replicas", ["n1", "n2"], 0),
    "c2r1": ("2-node cluster, 1 replica", ["n1", "n2"], 1),
    "plain": ("plain dcp-server", None, 0),
}
BASELINE, HEADLINE = "c1", "c2r0"
CLUSTER_SETTINGS = {"cluster_lease_ttl": 10, "auto_failover_timeout": 30.0}
_TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- CPU accounting


def proc_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads (``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return (0.0, 0.0)
    return (int(fields[11]) / _TICK, int(fields[12]) / _TICK)  # utime, stime (fields 14, 15)


def machine_busy() -> float:
    """CPU seconds the whole machine spent not idle, since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / _TICK  # all but idle and iowait (guest is in user)


class CpuMeter:
    """CPU of named processes and of the machine between ``__init__`` and ``stop``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0 = time.perf_counter()
        self.before = {n: proc_cpu(p) for n, p in pids.items()}
        self.busy0 = machine_busy()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        busy = machine_busy() - self.busy0
        procs = {}
        for name, pid in self.pids.items():
            u, s = proc_cpu(pid)
            u0, s0 = self.before[name]
            cpu = u - u0 + s - s0
            procs[name] = {
                "cpu_s": round(cpu, 3),
                "user_s": round(u - u0, 3),
                "sys_s": round(s - s0, 3),
                "pct_of_wall": round(100 * cpu / wall, 1) if wall else None,
            }
        return {"wall_s": wall, "procs": procs, "machine_busy_s": busy}


def limit_of(cpu: dict[str, Any], cores: int) -> dict[str, Any]:
    """Sums per role and what limited the phase (see the module docstring)."""
    wall = cpu["wall_s"] or 1e-9
    procs = cpu["procs"]
    servers = {n: v for n, v in procs.items() if n.startswith("n") or n == "server"}
    gens = sum(v["cpu_s"] for n, v in procs.items() if n.startswith(("writer", "consumer")))
    ours = sum(v["cpu_s"] for v in procs.values())
    busy = cpu["machine_busy_s"] / wall
    top = max(servers.items(), key=lambda kv: kv[1]["cpu_s"]) if servers else None
    if busy >= 0.9 * cores:
        why = f"the machine: {busy:.2f} of {cores} cores busy"
    elif top and top[1]["pct_of_wall"] >= 90:
        why = f"one server process ({top[0]} at {top[1]['pct_of_wall']:.0f}% of a core: its GIL)"
    else:
        why = f"no CPU limit reached ({busy:.2f} of {cores} cores busy)"
    return {
        "servers_cpu_s": round(sum(v["cpu_s"] for v in servers.values()), 3),
        "loadgen_cpu_s": round(gens, 3),
        "machine_busy_cores": round(busy, 2),
        "other_cores": round(max(0.0, cpu["machine_busy_s"] - ours) / wall, 2),
        "limit": why,
    }


# ---------------------------------------------------------------------- processes


@contextlib.contextmanager
def _nodes(ctx: Ctx, conf: str, **extra: Any) -> Iterator[tuple[dict[str, OurServer], Etcd | None]]:
    """The configuration's servers, settled on their map when a cluster; all stopped after."""
    sc = ctx.scratch()
    _label, names, replicas = CONFIGS[conf]
    try:
        if names is None:
            srv = OurServer(
                sc.sub("data"),
                ctx.o.vbuckets,
                ctx.server_args(log_level="WARNING", **extra),
                log_path=f"{ctx.o.log_dir}/scale-plain.log",
            ).start()
            try:
                yield {"server": srv}, None
            finally:
                srv.stop()
            return
        settings = ctx.server_args(
            log_level="WARNING", num_replicas=replicas, **CLUSTER_SETTINGS, **extra
        )
        with cluster(sc, ctx.o.vbuckets, settings, ctx.o.log_dir, names) as cl:
            trio.run(_settle, cl, names, ctx.o.timeout)
            yield dict(cl.nodes), cl.etcd
    finally:
        sc.close()


async def _settle(cl: Any, names: list[str], timeout: float) -> None:
    store = cl.store()
    try:
        await wait_settled(cl, store, names, timeout)
    finally:
        await store.aclose()


def _workers(ctx: Ctx, role: str, count: int, params: Any) -> list[Worker]:
    out: list[Worker] = []
    try:
        for i in range(count):
            out.append(Worker(role, params(i), ctx.o.log_dir, script="scale_worker.py"))
    except BaseException:
        for w in out:
            w.close()
        raise
    return out


def _write(ctx: Ctx, boot: list[tuple[str, int]], pids: dict[str, int]) -> dict[str, Any]:
    """All items by the writers; their results and the CPU of ``pids`` + theirs."""
    o = ctx.o
    n, k = o.items, o.writers
    ws = _workers(
        ctx,
        "scale-writer",
        k,
        lambda i: {
            "bootstrap": boot,
            "vbuckets": o.vbuckets,
            "batch": o.batch,
            "value_size": o.value_size,
            "timeout": o.timeout,
            "lo": i * n // k,
            "hi": (i + 1) * n // k,
        },
    )
    try:
        for w in ws:
            w.expect("ready", o.timeout)
        meter = CpuMeter({**pids, **{f"writer{i}": w.proc.pid for i, w in enumerate(ws)}})
        for w in ws:
            w.send("go")
        res = [w.expect("result", o.timeout) for w in ws]
        cpu = meter.stop()
    finally:
        for w in ws:
            w.close()
    return {
        "count": sum(r["count"] for r in res),
        "retried": sum(r["retried"] for r in res),
        "cpu": cpu,
    }


def _pids(nodes: dict[str, OurServer], etcd: Etcd | None) -> dict[str, int]:
    out = {name: srv.proc.pid for name, srv in nodes.items()}
    if etcd is not None:
        out["etcd"] = etcd.proc.pid
    return out


def _held(nodes: dict[str, OurServer]) -> int:
    """Items the cluster holds: per vbucket the highest seqno of any copy (each key was
    written once, so a vbucket's seqno is its item count), summed."""
    best: dict[int, int] = {}
    for srv in nodes.values():
        for vb, s in high_seqnos(srv).items():
            best[vb] = max(best.get(vb, 0), s)
    return sum(best.values())


def _finish(run: dict[str, Any], cores: int) -> dict[str, Any]:
    cpu = run["cpu"]
    run.update(limit_of(cpu, cores))
    run["wall_s"] = cpu["wall_s"]
    run["server_cpu_s"] = run["servers_cpu_s"]
    run["client_cpu_s"] = run["loadgen_cpu_s"]
    return run


# ---------------------------------------------------------------------- the two phases


def ingest_run(ctx: Ctx, conf: str) -> dict[str, Any]:
    with _nodes(ctx, conf) as (nodes, etcd):
        boot = [(HOST, srv.port) for srv in nodes.values()]
        run = _write(ctx, boot, _pids(nodes, etcd))
        t0 = time.perf_counter()
        for srv in nodes.values():
            wait_persisted(srv.port, ctx.o.timeout)
        run["persist_after_s"] = time.perf_counter() - t0
        run["held"] = _held(nodes)
    run["rate"] = run["count"] / run["cpu"]["wall_s"]
    run["expected"] = ctx.o.items
    run["ok"] = run["count"] == run["held"] == ctx.o.items
    return _finish(run, os.cpu_count() or 1)


def memory_run(ctx: Ctx, conf: str) -> dict[str, Any]:
    o = ctx.o
    with _nodes(ctx, conf, checkpoint_memory_quota=_memory_quota(o.items)) as (nodes, etcd):
        boot = [(HOST, srv.port) for srv in nodes.values()]
        cs = _workers(
            ctx,
            "scale-consumer",
            o.consumers,
            lambda i: {
                "bootstrap": boot,
                "vbuckets": o.vbuckets,
                "items": o.items,
                "consumers": o.consumers,
                "index": i,
                "buffer_size": 10 * 1024 * 1024,
                "timeout": o.timeout,
            },
        )
        try:
            for c in cs:
                c.expect("registered", o.timeout)
            wrote = _write(ctx, boot, _pids(nodes, etcd))
            for srv in nodes.values():
                wait_persisted(srv.port, o.timeout)
            pids = {**_pids(nodes, etcd), **{f"consumer{i}": c.proc.pid for i, c in enumerate(cs)}}
            meter = CpuMeter(pids)
            for c in cs:
                c.send("go")
            res = [c.expect("result", o.timeout) for c in cs]
            cpu = meter.stop()
        finally:
            for c in cs:
                c.close()
        dropped = sum(int(stat(s.port).get("ep_cursors_dropped", 0)) for s in nodes.values())
    count = sum(r["count"] for r in res)
    run = {
        "count": count,
        "expected": o.items,
        "ok": count == o.items and all(r["count"] == r["expected"] for r in res),
        "rate": count / cpu["wall_s"],
        "write_rate": wrote["count"] / wrote["cpu"]["wall_s"],
        "cursors_dropped": dropped,
        "per_node": _merge([r["per_node"] for r in res]),
        "cpu": cpu,
    }
    return _finish(run, os.cpu_count() or 1)


def _merge(parts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0) + v
    return out


# ---------------------------------------------------------------------- the scenario


def scale(ctx: Ctx) -> dict[str, Any]:
    o = ctx.o
    confs = (getattr(o, "configs", None) or "c1,c2r0,c2r1,plain").split(",")
    unknown = [c for c in confs if c not in CONFIGS]
    if unknown or BASELINE not in confs:
        raise BenchError(
            f"--configs: {unknown or 'c1 (the baseline) is missing'}; one of {list(CONFIGS)}"
        )
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(o.reps):
        order = confs if rep % 2 == 0 else confs[::-1]  # drift of the machine hits all alike
        for conf in order:
            for kind, fn in (("ingest", ingest_run), ("stream-memory", memory_run)):
                ctx.step(f"scale: {kind} {conf} rep {rep + 1}/{o.reps}")
                runs.setdefault((kind, conf), []).append(fn(ctx, conf))
    params = {
        "items": o.items,
        "vbuckets": o.vbuckets,
        "writers": o.writers,
        "consumers": o.consumers,
        "batch": o.batch,
        "cores": os.cpu_count(),
        "baseline": BASELINE,
        "configs": {c: CONFIGS[c][0] for c in confs},
    }
    rows = []
    medians: dict[str, dict[str, float]] = {}
    for (kind, conf), rs in runs.items():
        metric = "writes/s" if kind == "ingest" else "mutations/s"
        row = _scenario(
            f"scale {kind} {conf}", metric, params, rs, None, None, ctx, all(r["ok"] for r in rs)
        )
        row["config"], row["kind"] = conf, kind
        rows.append(row)
        medians.setdefault(kind, {})[conf] = row["ours"]["median"]
    out: dict[str, Any] = {
        "name": "scale",
        "metric": "2 nodes / 1 node",
        "params": params,
        "rows": rows,
        "ratios": {},
        "rep_ratios": {},
        "goals_met": {},
        "ours": None,
        "peer": None,
        "peer_name": None,
        "peer_skipped": "no peer: our servers, one node against two",
        "ratio": None,
        "ok": all(r["ok"] for r in rows),
    }
    for kind, goal in (("ingest", GOAL_INGEST), ("stream-memory", GOAL_MEMORY)):
        base = medians[kind][BASELINE]
        out["ratios"][kind] = {c: m / base for c, m in medians[kind].items() if c != BASELINE}
        out["rep_ratios"][kind] = {
            c: [
                a["rate"] / b["rate"]
                for a, b in zip(runs[(kind, c)], runs[(kind, BASELINE)], strict=True)
            ]
            for c in confs
            if c != BASELINE
        }
        if HEADLINE in out["ratios"][kind]:
            out["goals_met"][kind] = out["ratios"][kind][HEADLINE] >= goal
    out["summary"] = summary(out)
    return out


def _median_run(row: dict[str, Any]) -> dict[str, Any]:
    rs = sorted(row["ours"]["runs"], key=lambda r: r["rate"])
    return rs[len(rs) // 2]


def summary(res: dict[str, Any]) -> list[str]:
    """The rates, the ratios against the goals, and each process's CPU (median run)."""
    p = res["params"]
    lines = [
        f"scale: {p['items']:,} items, {p['vbuckets']} vbuckets, {p['writers']} writer and "
        f"{p['consumers']} consumer processes (the same for every configuration), "
        f"{p['cores']} cores; baseline {CONFIGS[BASELINE][0]}"
    ]
    goals = {"ingest": GOAL_INGEST, "stream-memory": GOAL_MEMORY}
    for kind, goal in goals.items():
        rows = [r for r in res["rows"] if r["kind"] == kind]
        for r in rows:
            s = r["ours"]
            line = (
                f"{kind:<13} {CONFIGS[r['config']][0]:<27} {s['median'] / 1000:8.1f} k/s "
                f"[{s['min'] / 1000:.1f}-{s['max'] / 1000:.1f}]"
            )
            ratio = res["ratios"][kind].get(r["config"])
            if ratio is not None:
                reps = res["rep_ratios"][kind][r["config"]]
                line += f"  {ratio:.2f}x one node (per rep {min(reps):.2f}-{max(reps):.2f})"
                if r["config"] == HEADLINE:
                    met = "met" if res["goals_met"][kind] else "NOT met"
                    line += f"; goal >= {goal}x: {met}"
            lines.append(line)
    lines.append("CPU of the measured phase (median run): s and % of its wall time")
    for r in res["rows"]:
        m = _median_run(r)
        procs = ", ".join(
            f"{n} {v['cpu_s']:.2f} s ({v['pct_of_wall']:.0f}%)"
            for n, v in m["cpu"]["procs"].items()
        )
        lines.append(
            f"  {r['kind']} {r['config']}: {m['wall_s']:.2f} s wall; {procs}; machine "
            f"{m['machine_busy_cores']:.2f} cores busy (others {m['other_cores']:.2f}); "
            f"limit: {m['limit']}"
        )
    return lines
