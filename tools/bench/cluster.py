"""The ``cluster`` benchmark: failover time and rebalance rate of a cluster on etcd.

- **failover**: three nodes settled on their map, some data loaded, then one node (not
  the orchestrator) killed with SIGKILL. Measured from the kill: when etcd drops its
  lease (``nodes/<name>`` gone), when the map no longer names it, and when *every*
  vbucket is writable again, found by probing one write per vbucket (each probe is
  routed by the map in etcd, re-read every 50 ms, and gives up on a node after 0.2 s:
  that is the resolution). Goal: writable again within ``auto_failover_timeout`` + 2 s.
- **rebalance**: three nodes, ``--items`` distinct keys loaded (routed writes) and
  replicated, then a fourth node started; timed until the map is settled over four nodes
  (balanced, no move in flight, every node holding what it names). Items moved = per
  vbucket, the items it holds times the copies the new map puts on nodes that had none.
  Rate = items moved / seconds from the fourth node's registration to settled. Goal:
  >= 200 k items/s moved on loopback.

Rules of this module: as ``scenarios.py`` (fresh processes per run in a fresh scratch
directory, every one stopped by PID, every wait bounded, nothing asserted about speed);
the settings used (lease TTL, auto-failover timeout, vbuckets, replicas) are printed
with the figures: the failover time is mostly those settings. Defaults: lease TTL 2 s,
auto-failover after 5 s; ``--server-arg cluster_lease_ttl=5`` etc. change them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import trio

from dcp.consumer import DcpClientError
from dcp.producer.cluster.store import EtcdStore, StoreUnavailable
from dcp.protocol.errors import StatusError
from dcp.protocol.layout import vbucket_for_key

from .cluster_procs import (
    Cluster,
    Router,
    cluster,
    current_map,
    high_seqnos,
    is_live,
    status,
    wait_settled,
)
from .procs import BenchError
from .scenarios import Ctx, _scenario

__all__ = ["GOAL_FAILOVER_MARGIN", "GOAL_MOVED_RATE", "cluster_bench", "summary"]

GOAL_FAILOVER_MARGIN = 2.0  # seconds over auto_failover_timeout
GOAL_MOVED_RATE = 200_000  # items moved per second
SETTINGS = {"cluster_lease_ttl": 2, "auto_failover_timeout": 5.0}
THREE = ["n1", "n2", "n3"]


def _settings(ctx: Ctx) -> dict[str, Any]:
    return ctx.server_args(**SETTINGS, log_level="WARNING")


async def _load(cl: Cluster, store: EtcdStore, items: int, timeout: float) -> float:
    """Write ``items`` distinct keys through the map, 10 k per round; returns seconds."""
    t0 = time.perf_counter()
    async with Router(cl, store, op_timeout=30) as router:
        batch = 10_000
        for start in range(0, items, batch):
            part = {
                f"item{i:010d}".encode(): b"v" * 100
                for i in range(start, min(items, start + batch))
            }
            await router.write_many(part, give_up=timeout)
    return time.perf_counter() - t0


async def _caught_up(cl: Cluster, store: EtcdStore, timeout: float) -> dict[int, int]:
    """Until every copy holds its active's high seqno; returns vb -> items it holds."""
    deadline = trio.current_time() + timeout
    while trio.current_time() < deadline:
        vbmap, _ = await current_map(store)
        assert vbmap is not None
        highs = {n: await trio.to_thread.run_sync(high_seqnos, cl.nodes[n]) for n in cl.nodes}
        per_vb = {vb: highs[vbmap.active(vb) or ""].get(vb, 0) for vb in range(cl.vbuckets)}
        if all(
            highs[n].get(vb) == per_vb[vb]
            for vb in range(cl.vbuckets)
            for n in vbmap.names(vb)
            if n
        ):
            return per_vb
        await trio.sleep(0.2)
    raise BenchError(f"the replicas did not catch up within {timeout:g} s")


# ---------------------------------------------------------------------- failover


async def _probe_all(router: Router, give_up: float) -> float:
    """One write per vbucket, each re-routed until taken; seconds until the last was."""
    vbs = router.cl.vbuckets
    keys: dict[int, bytes] = {}
    i = 0
    while len(keys) < vbs:
        k = f"probe{i}".encode()
        keys.setdefault(vbucket_for_key(k, vbs), k)
        i += 1
    t0 = trio.current_time()
    took: list[float] = []

    async def probe(vb: int) -> None:
        while trio.current_time() - t0 < give_up:
            name = router.vbmap.active(vb) if router.vbmap else None
            if name is not None:
                try:
                    await (await router.client(name)).set(keys[vb], b"probe")
                except (DcpClientError, StatusError, OSError):
                    pass
                else:
                    took.append(trio.current_time() - t0)
                    return
            await trio.sleep(0.01)

    async def watch(done: trio.CancelScope) -> None:
        with done:
            while True:
                await router.refresh()
                await trio.sleep(0.05)

    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, scope)
        async with trio.open_nursery() as probes:
            for vb in keys:
                probes.start_soon(probe, vb)
        scope.cancel()
    if len(took) < vbs:
        raise BenchError(f"{vbs - len(took)} vbuckets took no write within {give_up:g} s")
    return max(took)


async def _failover_async(cl: Cluster, o: Any) -> dict[str, Any]:
    store = cl.store()
    try:
        await wait_settled(cl, store, THREE, o.timeout)
        await _load(cl, store, max(1, o.items // 10), o.timeout)
        await _caught_up(cl, store, o.timeout)
        orchestrator = (await status(store)).get("orchestrator")
        victim = next(n for n in THREE if n != orchestrator)
        async with Router(cl, store, op_timeout=0.2) as router:
            await router.client(victim)  # connected before the kill, as a client would be
            await _probe_all(router, o.timeout)  # every vbucket writable before
            marks: dict[str, float] = {}
            t0 = trio.current_time()
            cl.nodes[victim].proc.kill()

            async def lease_gone() -> None:
                while await _safe(is_live(store, victim)) is not False:
                    await trio.sleep(0.02)
                marks["lease_gone_s"] = trio.current_time() - t0
                while True:
                    vbmap, _ = await current_map(store)
                    if vbmap and all(vbmap.active(vb) != victim for vb in range(cl.vbuckets)):
                        marks["map_s"] = trio.current_time() - t0
                        return
                    await trio.sleep(0.02)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(lease_gone)
                writable = await _probe_all(router, o.timeout)
        return {
            "failover_s": writable,
            "lease_gone_s": marks.get("lease_gone_s"),
            "map_s": marks.get("map_s"),
            "after_lease_s": writable - marks.get("lease_gone_s", 0.0),
            "victim": victim,
        }
    finally:
        await store.aclose()


async def _safe(aw: Any) -> Any:
    try:
        return await aw
    except StoreUnavailable:
        return None


def _failover_run(ctx: Ctx) -> dict[str, Any]:
    sc = ctx.scratch()
    try:
        with cluster(sc, ctx.o.vbuckets, _settings(ctx), ctx.o.log_dir, THREE) as cl:
            return trio.run(_failover_async, cl, ctx.o)
    finally:
        sc.close()


# ---------------------------------------------------------------------- rebalance


async def _rebalance_async(cl: Cluster, o: Any) -> dict[str, Any]:
    store = cl.store()
    try:
        before = await wait_settled(cl, store, THREE, o.timeout)
        load_s = await _load(cl, store, o.items, o.timeout)
        per_vb = await _caught_up(cl, store, o.timeout)
        t0 = time.perf_counter()
        await trio.to_thread.run_sync(cl.start, "n4")
        while not await _safe(is_live(store, "n4")):
            await trio.sleep(0.02)
        joined = time.perf_counter()
        after = await wait_settled(cl, store, [*THREE, "n4"], o.timeout, poll=0.05)
        done = time.perf_counter()
        moved_copies = 0
        moved = 0
        for vb in range(cl.vbuckets):
            new = {n for n in after.names(vb) if n} - {n for n in before.names(vb) if n}
            moved_copies += len(new)
            moved += len(new) * per_vb[vb]
        held = await _caught_up(cl, store, o.timeout)  # and the moved copies hold it all
        seconds = done - joined
        return {
            "items": sum(per_vb.values()),
            "ok": held == per_vb and sum(per_vb.values()) >= o.items,
            "load_s": load_s,
            "start_s": joined - t0,
            "rebalance_s": seconds,
            "vbuckets_moved": moved_copies,
            "items_moved": moved,
            "rate": moved / seconds if seconds > 0 else None,
            "rebalance_status": (await status(store)).get("rebalance"),
        }
    finally:
        await store.aclose()


def _rebalance_run(ctx: Ctx) -> dict[str, Any]:
    sc = ctx.scratch()
    try:
        with cluster(sc, ctx.o.vbuckets, _settings(ctx), ctx.o.log_dir, THREE) as cl:
            return trio.run(_rebalance_async, cl, ctx.o)
    finally:
        sc.close()


# ---------------------------------------------------------------------- the scenario


def cluster_bench(ctx: Ctx) -> dict[str, Any]:
    only = (getattr(ctx.o, "only", None) or "failover,rebalance").split(",")
    settings = _settings(ctx)
    fails: list[dict[str, Any]] = []
    rebs: list[dict[str, Any]] = []
    for rep in range(ctx.o.reps):
        if "failover" in only:
            ctx.step(f"cluster: failover rep {rep + 1}/{ctx.o.reps}")
            fails.append(_failover_run(ctx))
        if "rebalance" in only:
            ctx.step(f"cluster: rebalance rep {rep + 1}/{ctx.o.reps}")
            rebs.append(_rebalance_run(ctx))
    timeout = float(settings["auto_failover_timeout"])
    params = {
        "items": ctx.o.items,
        "vbuckets": ctx.o.vbuckets,
        "replicas": 1,
        "lease_ttl_s": int(settings["cluster_lease_ttl"]),
        "auto_failover_timeout_s": timeout,
    }
    rows = []
    out: dict[str, Any] = {"name": "cluster", "params": params, "goal_ratios": {}, "goals_met": {}}
    if fails:
        rows.append(
            _scenario(
                "cluster failover",
                "s from kill -9 to every vbucket writable",
                params,
                fails,
                None,
                None,
                ctx,
                True,
                key="failover_s",
            )
        )
        med = statistics.median(r["failover_s"] for r in fails)
        out["failover_s"] = med
        out["lease_gone_s"] = statistics.median(r["lease_gone_s"] or 0 for r in fails)
        out["goal_ratios"]["failover_vs_goal"] = (timeout + GOAL_FAILOVER_MARGIN) / med
        out["goals_met"]["failover"] = med <= timeout + GOAL_FAILOVER_MARGIN
    if rebs:
        rows.append(
            _scenario(
                "cluster rebalance",
                "items moved/s (3 -> 4 nodes)",
                params,
                rebs,
                None,
                None,
                ctx,
                all(r["ok"] for r in rebs),
                key="rate",
            )
        )
        med = statistics.median(r["rate"] for r in rebs)
        out["moved_rate"] = med
        out["goal_ratios"]["moved_vs_200k"] = med / GOAL_MOVED_RATE
        out["goals_met"]["rebalance"] = med >= GOAL_MOVED_RATE
    out.update(
        metric="failover time and rebalance rate",
        rows=rows,
        ours=rows[0]["ours"] if rows else None,
        peer=None,
        peer_name=None,
        peer_skipped="no peer: a cluster of our own nodes",
        ratio=None,
        ok=all(r["ok"] for r in rows),
    )
    out["summary"] = summary(out)
    return out


def summary(res: dict[str, Any]) -> list[str]:
    """The figures beside their goals and the settings they were measured with."""
    p = res["params"]
    lines = [
        f"cluster settings: lease TTL {p['lease_ttl_s']} s, auto_failover_timeout "
        f"{p['auto_failover_timeout_s']:g} s, {p['vbuckets']} vbuckets, {p['replicas']} replica"
    ]
    if "failover_s" in res:
        goal = p["auto_failover_timeout_s"] + GOAL_FAILOVER_MARGIN
        lines.append(
            f"failover: every vbucket writable {res['failover_s']:.2f} s after kill -9 "
            f"(lease gone at {res['lease_gone_s']:.2f} s); goal <= {goal:g} s: "
            f"{'met' if res['goals_met']['failover'] else 'NOT met'}"
        )
    if "moved_rate" in res:
        lines.append(
            f"rebalance: {res['moved_rate'] / 1000:.1f} k items moved/s ({p['items']} items, "
            f"3 -> 4 nodes); goal >= {GOAL_MOVED_RATE // 1000} k/s: "
            f"{'met' if res['goals_met']['rebalance'] else 'NOT met'}"
        )
    return lines
