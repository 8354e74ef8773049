"""Scenario ``failover``: a 3-node cluster on etcd under faults — kill -9 of a node, SIGSTOP
of a node past the auto-failover timeout, kill -9 of etcd, kill -9 of a node restarted at
once — while writers write at every
durability level and SDK consumers (normal and stable-only) follow the cluster; then
prove that nothing acknowledged at a majority level was lost, that stable-only consumers
never rolled back, that every consumer ends with the cluster's data, and that no two
nodes took writes for one vbucket at once.

Rules of this module:
- Bounded: ``rounds`` rounds (the first ones one of each kind, then at random), each
  after ``min_up..max_up`` s of traffic; every wait for the cluster to fail over or heal
  is bounded (``heal_timeout``) and a round that does not heal is an error in the report,
  not a hang; the run stops taking rounds at ``time_limit``; the final catch-up waits at
  most ``converge_timeout``.
- A killed or stopped node is always brought back (restarted, continued) and the round
  waits until the cluster has healed by itself: the failover, then the automatic
  rebalance that gives the returning node copies again (docs/cluster.md). etcd is killed
  and restarted on the same data; an outage alone must not fail anyone over.
- Every child (etcd, nodes, consumers) is started here and killed by pid however the run
  ends (``@scenario``, ``ChaosCluster.stop_all``).
- Findings: ``verify.verify_journal`` on each consumer's journal, the final views and
  documents, ``failover_verify`` (lost writes per level, epoch checks); the report counts
  them as ``divergences`` (data), ``violations`` (epochs), ``errors`` (rounds that did
  not heal, consumers that failed) and ``crashes`` (tracebacks in a node's log).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import trio

from dcp.consumer import DcpClient, Deletion, Expiration, KvClient, Mutation, SnapshotBatch

from .crash import ConsumerProc, _fence_keys
from .failover_cluster import ChaosCluster
from .failover_report import report as _report
from .failover_writer import LEVELS, LevelWriter
from .procs import HarnessError, scenario, vb_seqnos
from .writer import Attempt, keys_per_vbucket

__all__ = ["KINDS", "run_failover"]

#: Round kinds: kill -9 of a node, SIGSTOP of a node past the failover, kill -9 of etcd,
#: kill -9 of a node and its restart at once (systemd), before anyone saw it down.
KINDS = ("kill", "stop", "etcd", "restart")


async def cluster_state(bootstrap: str) -> dict[str, str]:
    """The cluster's live documents, by a fresh full stream (``to_latest``) of every
    vbucket from its active."""
    state: dict[str, str | None] = {}
    async with DcpClient(
        bootstrap, to_latest=True, include_expirations=True, retry_timeout=60.0
    ) as client:
        async for item in client:
            if not isinstance(item, SnapshotBatch):
                raise HarnessError(f"a fresh stream from 0 gave {item}")
            for e in item.events:
                key = e.key.decode("latin-1")
                if type(e) is Mutation:
                    state[key] = e.value.decode("latin-1")
                elif type(e) in (Deletion, Expiration):
                    state[key] = None
    return {k: v for k, v in state.items() if v is not None}


async def _get_state(bootstrap: str, keys: list[str], num_vbuckets: int) -> dict[str, str]:
    async with KvClient(bootstrap, num_vbuckets=num_vbuckets, timeout=30.0) as kv:
        got = await kv.get_many(keys)
    return {k.decode("latin-1"): r.value.decode("latin-1") for k, r in got.items()}


class _Run:
    """One run's state: the cluster, writers, consumers and what was seen."""

    def __init__(self, cl: ChaosCluster, rng: random.Random, workdir: Path) -> None:
        self.cl = cl
        self.rng = rng
        self.workdir = workdir
        self.t0 = time.monotonic()
        self.writers: dict[str, int] = {}
        self.log: list[Attempt] = []
        self.rounds: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.findings: list[str] = []
        self.logs_by_vb: dict[int, set[tuple[tuple[int, int], ...]]] = {}

    async def collect_logs(self, when: str = "") -> None:
        """Remember every failover log the running nodes hold (for the epoch checks), and
        append them, with the wall clock of the nodes' logs, to ``failover_logs.jsonl``
        (for a post-mortem of a finding)."""
        seen = await self.cl.logs()
        for logs in seen.values():
            for vb, log in logs.items():
                self.logs_by_vb.setdefault(vb, set()).add(tuple(log))
        with open(self.workdir / "failover_logs.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "when": when, "logs": seen}) + "\n")

    async def fault_round(self, rnd: int, kind: str, heal_timeout: float) -> None:
        cl, rng = self.cl, self.rng
        rec: dict[str, Any] = {"round": rnd, "kind": kind, "at": time.strftime("%H:%M:%S")}
        t0 = trio.current_time()
        if kind == "etcd":
            cl.etcd.kill()
            down = rng.uniform(0.5, 5.0)  # past the fencing point (TTL - margin) or not
            rec["etcd_down_s"] = round(down, 2)
            await trio.sleep(down)
            await cl.etcd.start()
        else:
            vbmap = await cl.read_map()
            holders: list[str] = []
            if vbmap is not None:
                holders = sorted({a for vb in range(vbmap.num_vbuckets) if (a := vbmap.active(vb))})
            victim = rng.choice(holders or cl.names)  # a node that holds actives
            rec["node"] = victim
            if kind == "restart":
                await self.restart_round(rnd, victim, rec, heal_timeout)
            elif kind == "kill":
                cl.kill(victim)
            else:
                cl.pause(victim)
            if kind != "restart":
                took, last = await cl.wait_failed_over(victim, heal_timeout)
                rec["failed_over_s"] = round(took, 2)
                if last:
                    self.errors.append(f"round {rnd} ({kind} {victim}): no failover: {last}")
                await self.collect_logs(f"round {rnd}: {victim} failed over")
            if kind == "kill":
                await cl.start_node(victim)
            elif kind == "stop":
                await trio.sleep(rng.uniform(0.0, 1.0))
                cl.resume(victim)
        took, last = await cl.wait_healed(cl.names, heal_timeout)
        rec["healed_s"] = round(trio.current_time() - t0, 2)
        if last:
            rec["not_healed"] = last
            self.errors.append(f"round {rnd} ({kind}): not healed in {took:.0f} s: {last}")
        await self.collect_logs(f"round {rnd}: healed")
        self.rounds.append(rec)
        for name, node in cl.nodes.items():
            if not node.alive():  # died by itself: a finding, and the run goes on without it
                self.errors.append(f"round {rnd}: {name} exited on its own: {node.log_tail(3)}")
                await cl.start_node(name)

    async def restart_round(
        self, rnd: int, victim: str, rec: dict[str, Any], heal_timeout: float
    ) -> None:
        """kill -9 and an immediate restart: the node must wait, unregistered, to be failed
        over (cluster/rejoin.py) — one more automatic failover — rather than come back
        active on the new branch its warm-up started and roll its replicas back."""
        cl = self.cl
        before = None
        with trio.move_on_after(heal_timeout):
            while (before := await cl.failover_count()) is None:
                await trio.sleep(0.2)
        if before is None:
            self.errors.append(f"round {rnd} (restart {victim}): etcd did not answer")
            return
        cl.kill(victim)
        await cl.start_node(victim)
        took, last = await cl.wait_failover_count(before + 1, heal_timeout)
        rec["failed_over_s"] = round(took, 2)
        if last:
            self.errors.append(f"round {rnd} (restart {victim}): no failover: {last}")
        await self.collect_logs(f"round {rnd}: {victim} restarted, failed over")


def _keys(levels: list[str], per_vb: int, num_vbuckets: int) -> dict[str, list[str]]:
    return {lv: keys_per_vbucket(f"L{i}k", per_vb, num_vbuckets) for i, lv in enumerate(levels)}


async def _converged(
    procs: list[ConsumerProc], target: dict[int, tuple[int, int]], timeout: float
) -> list[str]:
    """Until every consumer's applied position is each vbucket's (high seqno, uuid)."""
    behind: list[str] = []
    with trio.move_on_after(timeout):
        while True:
            behind = []
            for c in procs:
                pos = c.status().get("positions", {})
                for vb, want in target.items():
                    got = pos.get(str(vb))
                    if want[0] and (got is None or tuple(got) != want):
                        behind.append(f"{c.name} vb {vb}: at {got}, cluster at {list(want)}")
            if not behind:
                return []
            await trio.sleep(0.2)
    return behind[:10]


async def _drive(run: _Run, procs: list[ConsumerProc], o: dict[str, Any]) -> dict[str, str]:
    """Start, the rounds, the final catch-up (module rules); returns the final documents."""
    cl, rng, nvb = run.cl, run.rng, o["num_vbuckets"]
    await cl.start()
    _, last = await cl.wait_healed(cl.names, o["heal_timeout"])
    if last:
        raise HarnessError(f"the cluster did not settle at start: {last}")
    await run.collect_logs()
    keys = _keys(list(o["levels"]), o["keys_per_vb"], nvb)
    writers = [
        LevelWriter(
            lv,
            keys[lv],
            cl.bootstrap,
            nvb,
            run.log,
            random.Random(rng.randrange(1 << 32)),
            batch=o["writer_batch"],
            pause=o["writer_pause"],
        )
        for lv in o["levels"]
    ]
    common = ["--bootstrap", cl.bootstrap, "--noop-interval", "1"]
    common += ["--config-poll-interval", "0.5", "--retry-timeout", "300"]
    port = cl.nodes[cl.names[0]].port
    for i in range(o["normal_consumers"]):
        procs.append(ConsumerProc(run.workdir / f"normal{i}", f"chaos-normal-{i}", port, common))
    for i in range(o["stable_consumers"]):
        procs.append(
            ConsumerProc(
                run.workdir / f"stable{i}", f"chaos-stable-{i}", port, [*common, "--stable-only"]
            )
        )
    for c in procs:
        c.start()
    kinds = list(o["kinds"])
    plan = rng.sample(kinds, len(kinds)) + [rng.choice(kinds) for _ in range(o["rounds"])]
    plan = plan[: o["rounds"]]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for w in writers:
            await nursery.start(w.run, stop)
        for rnd, kind in enumerate(plan):
            if time.monotonic() - run.t0 > o["time_limit"]:
                run.errors.append(f"time limit: {len(plan) - rnd} rounds skipped")
                break
            await trio.sleep(rng.uniform(o["min_up"], o["max_up"]))
            await run.fault_round(rnd, kind, o["heal_timeout"])
            for c in procs:
                if not c.alive():  # a consumer must ride through every fault
                    c.reap()
                    run.errors.append(f"{c.name} exited: {c.status().get('error')}")
                    c.start()
        await trio.sleep(rng.uniform(o["min_up"], o["max_up"]))
        stop.set()
    run.writers = {w.level: w.batches for w in writers}
    # one write per vbucket at level none: every consumer then receives a snapshot under
    # each vbucket's final failover log, so its position can be compared with the cluster's
    fence_keys = list(_fence_keys(nvb).values())
    fence = LevelWriter("none", fence_keys, cl.bootstrap, nvb, run.log, rng)
    async with KvClient(cl.bootstrap, num_vbuckets=nvb, timeout=30.0) as kv:
        await fence.write(kv, [fence.attempt(k, "set") for k in fence_keys])
    _, last = await cl.wait_healed(cl.names, o["heal_timeout"])
    if last:
        run.errors.append(f"not healed at the end: {last}")
    await run.collect_logs()
    state = await cluster_state(cl.bootstrap)
    all_keys = [k for ks in keys.values() for k in ks] + fence_keys
    got = await _get_state(cl.bootstrap, all_keys, nvb)
    if got != state:
        diff = sorted(set(got.items()) ^ set(state.items()))[:5]
        run.findings.append(f"cluster: GET and a full stream disagree on {diff}")
    vbmap = await cl.read_map()
    target: dict[int, tuple[int, int]] = {}
    for name in cl.names:
        seqnos = await vb_seqnos(cl.nodes[name].port)
        for vb in range(nvb):
            if vbmap is not None and vbmap.active(vb) == name:
                target[vb] = (seqnos[vb][0], seqnos[vb][1])
    behind = await _converged(procs, target, o["converge_timeout"])
    run.findings += [f"not converged: {b}" for b in behind]
    for c in procs:
        rc = await c.terminate()
        if rc not in (0, None):
            run.errors.append(f"{c.name} exited with {rc}: {c.status().get('error')}")
    return state


@scenario
async def run_failover(
    workdir: Path,
    *,
    rounds: int = 30,
    seed: int | None = None,
    kinds: tuple[str, ...] = KINDS,
    levels: tuple[str, ...] = LEVELS,
    num_vbuckets: int = 16,
    keys_per_vb: int = 6,
    normal_consumers: int = 2,
    stable_consumers: int = 2,
    lease_ttl: int = 2,
    failover_timeout: float = 3.0,
    min_up: float = 1.0,
    max_up: float = 3.0,
    writer_batch: int = 6,
    writer_pause: float = 0.05,
    heal_timeout: float = 60.0,
    converge_timeout: float = 120.0,
    time_limit: float = 1800.0,
) -> dict[str, Any]:
    """The scenario (module rules); returns the report (also ``workdir/report.json``)."""
    o = dict(locals())
    del o["workdir"], o["seed"]
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    seed = random.randrange(1 << 32) if seed is None else seed
    cl = ChaosCluster(
        workdir, num_vbuckets=num_vbuckets, lease_ttl=lease_ttl, failover_timeout=failover_timeout
    )
    run = _Run(cl, random.Random(seed), workdir)
    procs: list[ConsumerProc] = []
    state: dict[str, str] | None = None
    try:
        state = await _drive(run, procs, o)
    except (HarnessError, OSError, trio.TooSlowError) as exc:
        run.errors.append(f"harness: {type(exc).__name__}: {exc}")
    finally:
        for c in procs:
            c.kill()
        crashes = cl.tracebacks()
        await cl.stop_all()
    report = _report(run, procs, state, crashes, seed, o)
    (workdir / "report.json").write_text(json.dumps(report, indent=1))
    return report
