"""The benchmark scenarios: each sets up its servers, runs ours and the peer alternately,
and returns a plain dict (see ``bench.py`` for its shape).

Rules of this module:
- A run starts fresh servers in a fresh scratch directory and stops them by PID before
  it returns, also on errors. Every wait has a timeout.
- Server CPU of a run is measured over the measured phase only (psutil on the server's
  PID); client CPU is measured by the worker around the same phase.
- Nothing here asserts speed: goals are evaluated and reported, never enforced.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .procs import (
    MiB,
    OurServer,
    Profiler,
    RedisServer,
    RssSampler,
    Scratch,
    Worker,
    stat,
    wait_persisted,
)

REDIS_STREAM = "Redis Streams, XREAD COUNT 1000 (redis-py + hiredis)"
REDIS_XADD = "Redis Streams, pipelined XADD (redis-py + hiredis)"


class Ctx:
    """What a scenario needs: options, the scratch area, progress, the peer's status."""

    def __init__(self, opts: Any, peer_reason: str | None, progress: Callable[[str], None]) -> None:
        self.o = opts
        self.peer_reason = peer_reason  # None: the Redis peer runs
        self.step = progress

    @property
    def peer(self) -> bool:
        return self.peer_reason is None

    def scratch(self) -> Scratch:
        return Scratch(keep=self.o.keep)

    def wparams(self, **kw: Any) -> dict[str, Any]:
        return {
            "timeout": self.o.timeout,
            "value_size": self.o.value_size,
            "vbuckets": self.o.vbuckets,
            **kw,
        }

    def server_args(self, **extra: Any) -> dict[str, Any]:
        """Flags for ``dcp-server``: the scenario's, then ``--server-arg`` overrides."""
        out = dict(extra)
        for kv in self.o.server_arg or []:
            k, _, v = kv.partition("=")
            out[k.replace("-", "_")] = v
        return out

    def server(self, sc: Scratch, name: str = "data", **extra: Any) -> OurServer:
        return OurServer(
            sc.sub(name),
            self.o.vbuckets,
            self.server_args(**extra),
            log_path=f"{sc.path}/server-{name}.log",
        ).start()


def summarize(runs: list[dict[str, Any]], key: str = "rate") -> dict[str, Any]:
    vals = [r[key] for r in runs]

    def med(k: str) -> float | None:
        xs = [r[k] for r in runs if r.get(k) is not None]
        return statistics.median(xs) if xs else None

    return {
        "runs": runs,
        "median": statistics.median(vals) if vals else None,
        "min": min(vals) if vals else None,
        "max": max(vals) if vals else None,
        "server_cpu_s": med("server_cpu_s"),
        "client_cpu_s": med("client_cpu_s"),
        "server_peak_rss_mib": max((r.get("server_peak_rss_mib") or 0) for r in runs)
        if runs
        else None,
        "client_peak_rss_mib": max((r.get("client_peak_rss_mib") or 0) for r in runs)
        if runs
        else None,
    }


def _alternate(
    ctx: Ctx, reps: int, ours: Callable[[], dict], peer: Callable[[], dict] | None, what: str
) -> tuple[list[dict], list[dict]]:
    """ours, peer, peer, ours, ours, peer... (the order flips every repetition)."""
    a: list[dict] = []
    b: list[dict] = []
    for rep in range(reps):
        order = [("ours", ours), ("peer", peer)]
        if rep % 2:
            order.reverse()
        for side, fn in order:
            if fn is None:
                continue
            ctx.step(f"{what}: {side} rep {rep + 1}/{reps}")
            (a if side == "ours" else b).append(fn())
    return a, b


def _finish(res: dict[str, Any], srv: Any, cpu0: tuple[float, float], n: int) -> dict[str, Any]:
    user, system = srv.cpu_split()
    cpu = user + system - cpu0[0] - cpu0[1]
    res["server_cpu_s"] = cpu
    res["server_cpu_user_s"] = user - cpu0[0]
    res["server_cpu_system_s"] = system - cpu0[1]
    res["server_cpu_us_per_item"] = cpu / n * 1e6 if n else None
    res["server_peak_rss_mib"] = srv.peak_rss() / MiB
    res["client_peak_rss_mib"] = res.pop("client_peak_rss", 0) / MiB
    return res


def _scenario(
    name: str,
    metric: str,
    params: dict,
    ours: list,
    peer: list | None,
    peer_name: str | None,
    ctx: Ctx,
    ok: bool,
    key: str = "rate",
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "metric": metric,
        "params": params,
        "ours": summarize(ours, key),
        "peer": None,
        "peer_name": peer_name,
        "peer_skipped": None,
        "ratio": None,
        "ok": ok,
    }
    if peer_name is not None:
        if peer:
            out["peer"] = summarize(peer, key)
            if out["peer"]["median"]:
                out["ratio"] = out["ours"]["median"] / out["peer"]["median"]
        else:
            out["peer_skipped"] = ctx.peer_reason or "not run"
    return out


# ---------------------------------------------------------------------- write helpers


def _write_ours(
    ctx: Ctx, port: int, items: int, profile: OurServer | None = None, **kw: Any
) -> dict[str, Any]:
    w = Worker(
        "ours-writer", ctx.wparams(port=port, items=items, batch=ctx.o.batch, **kw), ctx.o.log_dir
    )
    try:
        w.expect("ready", 60)
        prof = Profiler()
        if profile is not None:
            prof.start(server=profile.proc.pid, client=w.proc.pid)
        w.send("go")
        res = w.expect("result", ctx.o.timeout)
        prof.stop()
        return res
    finally:
        w.close()


def _write_redis(ctx: Ctx, port: int, items: int) -> dict[str, Any]:
    w = Worker(
        "redis-writer", ctx.wparams(port=port, items=items, batch=ctx.o.batch), ctx.o.log_dir
    )
    try:
        w.expect("ready", 60)
        w.send("go")
        return w.expect("result", ctx.o.timeout)
    finally:
        w.close()


# ---------------------------------------------------------------------- stream-memory


def _memory_quota(items: int, clients: int = 1) -> int:
    return max(256 * MiB, items * 1024)


def _ours_memory_run(ctx: Ctx, items: int, clients: int) -> dict[str, Any]:
    sc = ctx.scratch()
    srv = ctx.server(sc, checkpoint_memory_quota=_memory_quota(items))
    try:
        cons = Worker(
            "ours-consumer",
            ctx.wparams(port=srv.port, expect=items, clients=clients, mode="memory"),
            ctx.o.log_dir,
        )
        try:
            cons.expect("registered", 120)
            _write_ours(ctx, srv.port, items)
            wait_persisted(srv.port, ctx.o.timeout)
            prof = Profiler().start(server=srv.proc.pid, client=cons.proc.pid)
            cpu0 = srv.cpu_split()
            cons.send("go")
            res = cons.expect("result", ctx.o.timeout)
            prof.stop()
        finally:
            cons.close()
        n = sum(res["counts"])
        res.update(
            count=n,
            expected=items * clients,
            rate=items / res["seconds"],
            delivered_rate=n / res["seconds"],
        )
        return _finish(res, srv, cpu0, n)
    finally:
        srv.stop()
        sc.close()


def _redis_memory_run(ctx: Ctx, items: int, clients: int) -> dict[str, Any]:
    sc = ctx.scratch()
    srv = RedisServer(sc.path).start()
    try:
        _write_redis(ctx, srv.port, items)
        r = Worker(
            "redis-reader",
            ctx.wparams(port=srv.port, expect=items, clients=clients, count=1000),
            ctx.o.log_dir,
        )
        try:
            r.expect("ready", 60)
            cpu0 = srv.cpu_split()
            r.send("go")
            res = r.expect("result", ctx.o.timeout)
        finally:
            r.close()
        n = sum(res["counts"])
        res.update(
            count=n,
            expected=items * clients,
            rate=items / res["seconds"],
            delivered_rate=n / res["seconds"],
        )
        return _finish(res, srv, cpu0, n)
    finally:
        srv.stop()
        sc.close()


def stream_memory(ctx: Ctx) -> dict[str, Any]:
    items = ctx.o.items
    ours, peer = _alternate(
        ctx,
        ctx.o.reps,
        lambda: _ours_memory_run(ctx, items, 1),
        (lambda: _redis_memory_run(ctx, items, 1)) if ctx.peer else None,
        "stream-memory",
    )
    ok = all(r["count"] == r["expected"] for r in ours + peer)
    return _scenario(
        "stream-memory", "mutations/s", {"items": items}, ours, peer, REDIS_STREAM, ctx, ok
    )


# ---------------------------------------------------------------------- stream-disk


def _ours_disk_run(ctx: Ctx, items: int) -> dict[str, Any]:
    sc = ctx.scratch()
    data = sc.sub("data")
    srv = OurServer(
        data, ctx.o.vbuckets, ctx.server_args(), log_path=f"{sc.path}/server-1.log"
    ).start()
    try:
        _write_ours(ctx, srv.port, items)
    finally:
        srv.stop()
    srv = OurServer(
        data, ctx.o.vbuckets, ctx.server_args(), log_path=f"{sc.path}/server-2.log"
    ).start()
    try:
        cons = Worker(
            "ours-consumer",
            ctx.wparams(port=srv.port, expect=items, clients=1, mode="disk"),
            ctx.o.log_dir,
        )
        try:
            cons.expect("ready", 60)
            prof = Profiler().start(server=srv.proc.pid, client=cons.proc.pid)
            cpu0 = srv.cpu_split()
            cons.send("go")
            res = cons.expect("result", ctx.o.timeout)
            prof.stop()
        finally:
            cons.close()
        n = sum(res["counts"])
        res.update(count=n, expected=items, rate=n / res["seconds"])
        return _finish(res, srv, cpu0, n)
    finally:
        srv.stop()
        sc.close()


def stream_disk(ctx: Ctx) -> dict[str, Any]:
    items = ctx.o.items
    ours, _ = _alternate(ctx, ctx.o.reps, lambda: _ours_disk_run(ctx, items), None, "stream-disk")
    ok = all(r["count"] == r["expected"] for r in ours)
    out = _scenario("stream-disk", "mutations/s", {"items": items}, ours, None, None, ctx, ok)
    out["peer_skipped"] = "no peer: Redis runs with persistence off and has no disk read path"
    return out


# ---------------------------------------------------------------------- ingest


def _ours_ingest_run(ctx: Ctx, items: int) -> dict[str, Any]:
    sc = ctx.scratch()
    srv = ctx.server(sc)
    try:
        cpu0 = srv.cpu_split()
        t0 = time.perf_counter()
        res = _write_ours(ctx, srv.port, items, profile=srv)
        cpu_acked = srv.cpu() - sum(cpu0)
        wait_persisted(srv.port, ctx.o.timeout)
        res.update(
            expected=items,
            rate=res["count"] / res["seconds"],
            persisted_s=time.perf_counter() - t0,
            server_cpu_acked_s=cpu_acked,
        )
        return _finish(res, srv, cpu0, res["count"])
    finally:
        srv.stop()
        sc.close()


def _redis_ingest_run(ctx: Ctx, items: int) -> dict[str, Any]:
    sc = ctx.scratch()
    srv = RedisServer(sc.path).start()
    try:
        cpu0 = srv.cpu_split()
        res = _write_redis(ctx, srv.port, items)
        res.update(expected=items, rate=res["count"] / res["seconds"])
        return _finish(res, srv, cpu0, res["count"])
    finally:
        srv.stop()
        sc.close()


def ingest(ctx: Ctx) -> dict[str, Any]:
    items = ctx.o.items
    ours, peer = _alternate(
        ctx,
        ctx.o.reps,
        lambda: _ours_ingest_run(ctx, items),
        (lambda: _redis_ingest_run(ctx, items)) if ctx.peer else None,
        "ingest",
    )
    ok = all(r["count"] == r["expected"] for r in ours + peer)
    return _scenario(
        "ingest",
        "writes/s",
        {"items": items, "batch": ctx.o.batch},
        ours,
        peer,
        REDIS_XADD,
        ctx,
        ok,
    )


# ---------------------------------------------------------------------- fanout


def fanout(ctx: Ctx) -> dict[str, Any]:
    items = ctx.o.fanout_items
    counts = ctx.o.clients
    by_n: dict[int, tuple[list, list]] = {}
    for n in counts:
        by_n[n] = _alternate(
            ctx,
            ctx.o.reps,
            lambda n=n: _ours_memory_run(ctx, items, n),
            (lambda n=n: _redis_memory_run(ctx, items, n)) if ctx.peer else None,
            f"fanout x{n}",
        )
    rows = []
    ok = True
    for n, (ours, peer) in by_n.items():
        ok = ok and all(r["count"] == r["expected"] for r in ours + peer)
        row = _scenario(
            f"fanout x{n}",
            "server CPU us per delivered mutation",
            {"items": items, "consumers": n},
            ours,
            peer,
            REDIS_STREAM,
            ctx,
            ok,
            key="server_cpu_us_per_item",
        )
        row["consumers"] = n
        rows.append(row)
    out: dict[str, Any] = {
        "name": "fanout",
        "metric": "server CPU us per extra delivered mutation",
        "params": {"items": items, "consumers": counts},
        "rows": rows,
        "ok": ok,
        "peer_name": REDIS_STREAM,
        "peer_skipped": None if ctx.peer else ctx.peer_reason,
        "ours": None,
        "peer": None,
        "ratio": None,
    }
    lo, hi = min(counts), max(counts)
    if hi > lo:
        # per repetition: (CPU with the most consumers - CPU with the fewest) / extra deliveries
        for side, idx in (("ours", 0), ("peer", 1)):
            a, b = by_n[lo][idx], by_n[hi][idx]
            slopes = [
                {
                    "extra_us": (y["server_cpu_s"] - x["server_cpu_s"]) / ((hi - lo) * items) * 1e6,
                    "count": y["count"],
                    "expected": y["expected"],
                }
                for x, y in zip(a, b, strict=False)
            ]
            if slopes:
                out[side] = summarize(slopes, key="extra_us")
                out[f"{side}_extra_us"] = out[side]["median"]
    if out.get("ours_extra_us") is not None and out.get("peer_extra_us"):
        out["ratio"] = out["ours_extra_us"] / out["peer_extra_us"]
    return out


# ---------------------------------------------------------------------- latency


def _latency_run(ctx: Ctx, side: str) -> dict[str, Any]:
    sc = ctx.scratch()
    srv = ctx.server(sc) if side == "ours" else RedisServer(sc.path).start()
    try:
        w = Worker(
            f"{side}-latency",
            ctx.wparams(port=srv.port, rate=ctx.o.rate, seconds=ctx.o.seconds),
            ctx.o.log_dir,
        )
        try:
            w.expect("ready", 120)
            prof = Profiler()
            if side == "ours":
                prof.start(server=srv.proc.pid, client=w.proc.pid)
            cpu0 = srv.cpu_split()
            w.send("go")
            res = w.expect("result", ctx.o.seconds * 3 + ctx.o.timeout)
            prof.stop()
        finally:
            w.close()
        res["p99_ms"] = res["ack_to_delivery_ms"]["p99"]
        res["expected"] = res["count"]
        res["count"] = res["delivered"]
        return _finish(res, srv, cpu0, res["count"])
    finally:
        srv.stop()
        sc.close()


def latency(ctx: Ctx) -> dict[str, Any]:
    ours, peer = _alternate(
        ctx,
        ctx.o.reps,
        lambda: _latency_run(ctx, "ours"),
        (lambda: _latency_run(ctx, "redis")) if ctx.peer else None,
        "latency",
    )
    ok = all(r["count"] == r["expected"] for r in ours + peer)
    out = _scenario(
        "latency",
        "write-ack -> delivery p99 (ms)",
        {"rate": ctx.o.rate, "seconds": ctx.o.seconds},
        ours,
        peer,
        "Redis Streams, XADD + XREAD BLOCK (redis-py + hiredis)",
        ctx,
        ok,
        key="p99_ms",
    )
    for side in ("ours", "peer"):
        s = out[side]
        if s:
            for q in ("p50", "p99", "p999", "max"):
                s[q + "_ms"] = statistics.median(r["ack_to_delivery_ms"][q] for r in s["runs"])
    return out


# ---------------------------------------------------------------------- slow-consumer


def slow_consumer(ctx: Ctx) -> dict[str, Any]:
    o = ctx.o
    quota = int(o.quota_mib * MiB)
    runs = []
    reps = o.slow_reps or o.reps
    for rep in range(reps):
        ctx.step(f"slow-consumer: ours rep {rep + 1}/{reps}")
        runs.append(_slow_run(ctx, quota))
    ok = all(r["ok"] for r in runs)
    out = _scenario(
        "slow-consumer",
        "peak server RSS (MiB)",
        {"items": o.slow_items, "keys": o.keys, "quota_mib": o.quota_mib},
        runs,
        None,
        None,
        ctx,
        ok,
        key="server_peak_rss_mib",
    )
    out["peer_skipped"] = "no peer: a Redis stream has no quota; an unread stream keeps every entry"
    out["quota_mib"] = o.quota_mib
    out["limit_mib"] = o.quota_mib + 150
    return out


def _slow_run(ctx: Ctx, quota: int) -> dict[str, Any]:
    o = ctx.o
    sc = ctx.scratch()
    srv = ctx.server(sc, checkpoint_memory_quota=quota)
    sampler = RssSampler(srv, 0.25).start()
    try:
        cons = Worker(
            "ours-slow-consumer",
            ctx.wparams(port=srv.port, items=o.slow_items, keys=o.keys),
            ctx.o.log_dir,
        )
        try:
            cons.expect("registered", 120)
            sampler.phase = "write"
            t0 = time.perf_counter()
            wres = _write_ours(ctx, srv.port, o.slow_items, keys=o.keys)
            write_s = time.perf_counter() - t0
            st = stat(srv.port)
            sampler.phase = "drain"
            cons.send("resume")
            res = cons.expect("result", o.timeout)
        finally:
            cons.close()
        sampler.phase = "done"
        time.sleep(0.3)
        samples = sampler.stop()
        peak = srv.peak_rss()
        res.update(
            write_seconds=write_s,
            write_rate=wres["count"] / write_s,
            writes=wres["count"],
            drain_seconds=res["seconds"],
            cursors_dropped=int(st.get("ep_cursors_dropped", 0)),
            server_peak_rss_mib=peak / MiB,
            client_peak_rss_mib=res.pop("client_peak_rss", 0) / MiB,
            rss_samples=[
                (t, round(r / MiB, 1), ph, round(a / MiB, 1), round(f / MiB, 1))
                for t, r, ph, a, f in samples
            ],
            checkpoint_memory_mib_after_writes=int(st.get("ep_checkpoint_memory", 0)) / MiB,
            count=res["keys_final"],
            expected=res["keys_expected"],
        )
        res["ok"] = (
            res["keys_final"] == res["keys_expected"]
            and res["wrong_last_values"] == 0
            and res["regressions"] == 0
        )
        res["within_limit"] = peak <= quota + 150 * MiB
        return res
    finally:
        sampler.stop()
        srv.stop()
        sc.close()


# ---------------------------------------------------------------------- ceiling


def _ceiling_run(ctx: Ctx, items: int, decode: bool) -> dict[str, Any]:
    recv = Worker("ceiling-recv", ctx.wparams(expect=items, decode=decode), ctx.o.log_dir)
    try:
        port = recv.expect("ready", 60)["port"]
        send = Worker("ceiling-send", ctx.wparams(port=port, expect=items), ctx.o.log_dir)
        try:
            frame = send.expect("ready", 120)["frame_bytes"]
            send.send("go")
            res = recv.expect("result", ctx.o.timeout)
            send.expect("result", ctx.o.timeout)
        finally:
            send.close()
    finally:
        recv.close()
    res.update(
        expected=items,
        rate=res["count"] / res["seconds"],
        frame_bytes=frame,
        mb_per_s=res["count"] * frame / res["seconds"] / 1e6,
        client_peak_rss_mib=res.pop("client_peak_rss", 0) / MiB,
    )
    return res


def ceiling(ctx: Ctx) -> dict[str, Any]:
    items = ctx.o.items
    dec, frm = _alternate(
        ctx,
        ctx.o.reps,
        lambda: _ceiling_run(ctx, items, True),
        lambda: _ceiling_run(ctx, items, False),
        "ceiling",
    )
    ok = all(r["count"] == r["expected"] for r in dec + frm)
    out = _scenario("ceiling", "messages/s", {"items": items}, dec, None, None, ctx, ok)
    out["frame_only"] = summarize(frm)
    out["peer_skipped"] = "reference: blocking-socket receiver, pre-encoded frames"
    return out


SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "ceiling": ceiling,
    "stream-memory": stream_memory,
    "stream-disk": stream_disk,
    "ingest": ingest,
    "fanout": fanout,
    "latency": latency,
    "slow-consumer": slow_consumer,
}
