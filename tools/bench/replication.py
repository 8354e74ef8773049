"""The ``replication`` scenario: one active ``dcp-server`` and one ``--replica-of`` it.

Three measurements, each on fresh servers (fresh data directories, loopback):

- **throughput**: ``--items`` writes to the active, as fast as the pipelined ``KvClient``
  goes (the ``ours-writer`` worker); the bench polls both nodes' ``STAT vbucket-seqno``
  until the replica's high seqno, then its persisted seqno, equal the active's in every
  vbucket. Rates are items / (time from the first write to that moment), so they include
  the replica's catching up after the writer is done (which is the point).
- **catch-up**: ``--items`` written to the active first, then a replica started and timed
  until it holds and has persisted them all: the replica's own pace (a backfill of every
  vbucket), which the throughput run cannot show when the writer is the slower side.
- **lag**: writes at ``--rate`` per second for ``--seconds`` to the active while a DCP
  client streams from the *replica* and records when each write arrives (the
  ``ours-latency`` worker with ``dcp_port`` = the replica). Lag = arrival at that client
  minus the active's ack to the writer, for every write (all are sampled). Why a DCP client
  and not polling: a replica answers GET with NOT_MY_VBUCKET, and a stream is what the
  replica's own consumers see; it includes one extra local hop (replica -> client), so the
  figure is an upper bound of "the replica holds the item".

Rules of this module: as ``scenarios.py`` (fresh servers per run, stopped by PID on every
path, every wait bounded, nothing asserted about speed). The stream-disk and stream-memory
figures "of the same run" are those scenarios themselves, run by ``cli.py`` right after
this one at the same ``--items``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

from .procs import BenchError, OurServer, Profiler, Worker, stat
from .scenarios import Ctx, _finish, _scenario, summarize

GOAL_APPLIED = 300_000  # mutations/s applied on the replica
GOAL_LAG_P99_MS = 5.0  # at 10 k writes/s
POLL = 0.1  # seconds between two STAT polls of the catch-up (the replica serves them too)


def _seqnos(port: int, timeout: float) -> tuple[dict[int, int], dict[int, int]]:
    """(high seqno, persisted seqno) per vbucket from ``STAT vbucket-seqno``."""
    high: dict[int, int] = {}
    persisted: dict[int, int] = {}
    for k, v in stat(port, "vbucket-seqno", timeout).items():
        head, _, field = k.partition(":")
        if not head[3:].isdigit():
            continue
        if field == "high_seqno":
            high[int(head[3:])] = int(v)
        elif field == "last_persisted_seqno":
            persisted[int(head[3:])] = int(v)
    return high, persisted


def _until_caught_up(
    ctx: Ctx, replica: OurServer, target: dict[int, int], t0: float
) -> tuple[float | None, float | None, dict[int, int]]:
    """Poll the replica until its high seqnos, then its persisted seqnos, equal
    ``target`` (or the timeout): seconds since ``t0`` for each (None: not reached) and
    the high seqnos last seen."""
    applied_s = persisted_s = None
    high: dict[int, int] = {}
    while time.perf_counter() - t0 < ctx.o.timeout:
        high, persisted = _seqnos(replica.port, ctx.o.timeout)
        now = time.perf_counter() - t0
        if applied_s is None and high == target:
            applied_s = now
        if applied_s is not None and persisted == target:
            persisted_s = now
            break
        time.sleep(POLL)
    return applied_s, persisted_s, high


def wait_replicating(replica: OurServer, source: str, vbuckets: int, timeout: float) -> float:
    """Until the replica's connection to ``source`` is up and every vbucket streams
    (``STAT replication``); returns the seconds it took."""
    t0 = time.perf_counter()
    last: dict[str, str] = {}
    while time.perf_counter() - t0 < timeout:
        if not replica.alive():
            raise BenchError(f"the replica exited: {replica.errors()[-3:]}")
        try:
            last = stat(replica.port, "replication")
        except BenchError as exc:
            raise BenchError(f"the replica has no STAT replication group: {exc}") from None
        streaming = sum(1 for k, v in last.items() if k.endswith(":stream") and v == "streaming")
        if streaming >= vbuckets:  # a streaming vbucket implies a connected source
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise BenchError(
        f"the replica did not stream all {vbuckets} vbuckets from {source} within {timeout:g}s"
        f" (connected={last.get(f'source:{source}:connected', '?')})"
    )


@contextlib.contextmanager
def _pair(ctx: Ctx) -> Iterator[tuple[OurServer, OurServer, str]]:
    """A fresh active and its replica in a fresh scratch directory; both stopped (by
    PID) and the directory removed on every way out."""
    sc = ctx.scratch()
    servers: list[OurServer] = []
    try:
        servers.append(ctx.server(sc, "active"))
        source = f"127.0.0.1:{servers[0].port}"
        servers.append(ctx.server(sc, "replica", replica_of=source))
        yield servers[0], servers[1], source
    finally:
        for srv in reversed(servers):
            srv.stop()
        sc.close()


def _throughput_run(ctx: Ctx, items: int) -> dict[str, Any]:
    with _pair(ctx) as (active, replica, source):
        setup_s = wait_replicating(replica, source, ctx.o.vbuckets, ctx.o.timeout)
        cpu0 = replica.cpu_split()
        active_cpu0 = active.cpu()
        w = Worker(
            "ours-writer",
            ctx.wparams(port=active.port, items=items, batch=ctx.o.batch),
            ctx.o.log_dir,
        )
        try:
            w.expect("ready", 60)
            prof = Profiler().start(active=active.proc.pid, replica=replica.proc.pid)
            t0 = time.perf_counter()
            w.send("go")
            wres = w.expect("result", ctx.o.timeout)
        finally:
            w.close()
        written_s = time.perf_counter() - t0
        target, _ = _seqnos(active.port, ctx.o.timeout)
        applied_s, persisted_s, high = _until_caught_up(ctx, replica, target, t0)
        prof.stop()
        if persisted_s is None or applied_s is None:
            raise BenchError(
                f"the replica did not catch up within {ctx.o.timeout:g}s "
                f"(replica {sum(high.values())} of {sum(target.values())} seqnos)"
            )
        res = {
            "count": sum(high.values()),
            "expected": items,
            "writer_rate": wres["count"] / wres["seconds"],
            "written_s": written_s,
            "applied_s": applied_s,
            "persisted_s": persisted_s,
            "applied_rate": items / applied_s,
            "persisted_rate": items / persisted_s,
            "setup_s": setup_s,
            "active_cpu_s": active.cpu() - active_cpu0,
            "client_cpu_s": wres["client_cpu_s"],
            "client_peak_rss": wres["client_peak_rss"],
            "replica_errors": replica.errors()[-5:],
        }
        return _finish(res, replica, cpu0, items)  # server_* fields: the replica's


def _catchup_run(ctx: Ctx, items: int) -> dict[str, Any]:
    """The replica's own pace, not the writer's: ``items`` are written to the active
    first, then a fresh replica is started and timed until it holds (then has persisted)
    all of them — a backfill of every vbucket from the source's disk."""
    sc = ctx.scratch()
    servers: list[OurServer] = []
    try:
        active = ctx.server(sc, "active")
        servers.append(active)
        w = Worker(
            "ours-writer",
            ctx.wparams(port=active.port, items=items, batch=ctx.o.batch),
            ctx.o.log_dir,
        )
        try:
            w.expect("ready", 60)
            w.send("go")
            w.expect("result", ctx.o.timeout)
        finally:
            w.close()
        target, _ = _seqnos(active.port, ctx.o.timeout)
        t0 = time.perf_counter()
        replica = ctx.server(sc, "replica", replica_of=f"127.0.0.1:{active.port}")
        servers.append(replica)
        cpu0 = replica.cpu_split()
        applied_s, persisted_s, high = _until_caught_up(ctx, replica, target, t0)
        if persisted_s is None or applied_s is None:
            raise BenchError(f"the replica did not catch up within {ctx.o.timeout:g}s")
        res = {
            "count": sum(high.values()),
            "expected": items,
            "applied_s": applied_s,
            "persisted_s": persisted_s,
            "applied_rate": items / applied_s,
            "persisted_rate": items / persisted_s,
            "replica_errors": replica.errors()[-5:],
        }
        return _finish(res, replica, cpu0, items)
    finally:
        for srv in reversed(servers):
            srv.stop()
        sc.close()


def _lag_run(ctx: Ctx) -> dict[str, Any]:
    with _pair(ctx) as (active, replica, source):
        wait_replicating(replica, source, ctx.o.vbuckets, ctx.o.timeout)
        w = Worker(
            "ours-latency",
            ctx.wparams(
                port=active.port, dcp_port=replica.port, rate=ctx.o.rate, seconds=ctx.o.seconds
            ),
            ctx.o.log_dir,
        )
        try:
            w.expect("ready", 120)
            cpu0 = replica.cpu_split()
            w.send("go")
            res = w.expect("result", ctx.o.seconds * 3 + ctx.o.timeout)
        finally:
            w.close()
        lag = res["ack_to_delivery_ms"]
        res.update(
            p50_ms=lag["p50"],
            p99_ms=lag["p99"],
            expected=res["count"],
            count=res["delivered"],
        )
        return _finish(res, replica, cpu0, res["count"])


def replication(ctx: Ctx) -> dict[str, Any]:
    items = ctx.o.items
    tput: list[dict[str, Any]] = []
    lags: list[dict[str, Any]] = []
    catchup: list[dict[str, Any]] = []
    for rep in range(ctx.o.reps):
        ctx.step(f"replication: throughput rep {rep + 1}/{ctx.o.reps}")
        tput.append(_throughput_run(ctx, items))
        ctx.step(f"replication: catch-up rep {rep + 1}/{ctx.o.reps}")
        catchup.append(_catchup_run(ctx, items))
        ctx.step(f"replication: lag rep {rep + 1}/{ctx.o.reps}")
        lags.append(_lag_run(ctx))
    ok = all(r["count"] == r["expected"] for r in tput + lags + catchup)
    params = {"items": items, "rate": ctx.o.rate, "seconds": ctx.o.seconds}
    rows = [
        _scenario(
            "replication applied",
            "mutations/s applied on the replica",
            params,
            tput,
            None,
            None,
            ctx,
            ok,
            key="applied_rate",
        ),
        _scenario(
            "replication persisted",
            "mutations/s persisted on the replica",
            params,
            tput,
            None,
            None,
            ctx,
            ok,
            key="persisted_rate",
        ),
        _scenario(
            "replication catch-up",
            "mutations/s applied by a replica started after the writes",
            params,
            catchup,
            None,
            None,
            ctx,
            ok,
            key="applied_rate",
        ),
        _scenario(
            "replication lag",
            "active ack -> replica p99 (ms)",
            params,
            lags,
            None,
            None,
            ctx,
            ok,
            key="p99_ms",
        ),
    ]
    lag = rows[3]["ours"]
    lag["p50_ms"] = statistics.median(r["p50_ms"] for r in lags)
    lag["p99_ms"] = lag["median"]
    applied = rows[0]["ours"]["median"]
    out: dict[str, Any] = {
        "name": "replication",
        "metric": "replica throughput and lag",
        "params": params,
        "rows": rows,
        "ours": summarize(tput, "applied_rate"),
        "peer": None,
        "peer_name": None,
        "peer_skipped": "no peer: replication is between two of our servers",
        "ratio": None,
        "ok": ok,
        "applied_rate": applied,
        "persisted_rate": rows[1]["ours"]["median"],
        "catchup_rate": rows[2]["ours"]["median"],
        "writer_rate": statistics.median(r["writer_rate"] for r in tput),
        "lag_p50_ms": lag["p50_ms"],
        "lag_p99_ms": lag["p99_ms"],
        "goal_ratios": {
            # >= 1 means the goal is met
            "applied_vs_300k": applied / GOAL_APPLIED if applied else None,
            "catchup_vs_300k": rows[2]["ours"]["median"] / GOAL_APPLIED,
            "lag_5ms_vs_p99": GOAL_LAG_P99_MS / max(lag["p99_ms"], 1e-3),
        },
    }
    return out
