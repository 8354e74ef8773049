"""Scenario ``crash``: SIGKILL the server (and consumers) at random moments while a writer
writes and SDK consumers keep rollback-safe views; then prove nothing was lost,
invented, exposed half-done, or kept after the server lost it.

Rules of this module:
- Bounded: ``rounds`` rounds, each after ``min_up..max_up`` seconds of traffic, end with
  a SIGKILL of the server, or (``graceful_prob``) a SIGTERM, or (``freeze_prob``) a
  SIGSTOP of 2-5 s; the final convergence waits at most ``converge_timeout``; the whole
  run stops at ``time_limit`` (the rounds left are skipped and the report says so).
- Consumers are SIGKILLed at random too; the last one (the "sleeper") stays down for
  ``sleeper_rounds`` rounds, more than the 25 entries a failover log keeps.
- After a graceful stop the failover log must be unchanged and every write acknowledged
  before the old process exited must still be there.
- Every child (server, consumers) is started here and killed here, by pid.
- The findings come from ``verify.py``; the report counts them as ``divergences``,
  and tracebacks in the server's log as ``crashes``.
"""

from __future__ import annotations

import itertools
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from dcp.consumer import DcpClient, Deletion, Expiration, KvClient, Mutation, RollbackEvent

from .procs import (
    HOST,
    HarnessError,
    ServerProcess,
    failover_logs,
    free_port,
    scenario,
    track,
    vb_seqnos,
)
from .verify import Truth, check_server_state, verify_journal
from .view import read_journal
from .writer import Writer, keys_per_vbucket

__all__ = ["ConsumerProc", "run_crash", "stream_state"]

#: The repository root: the consumer child runs ``python -m tools.chaos.consumer`` from there.
ROOT = Path(__file__).resolve().parents[2]


class ConsumerProc:
    """``python -m tools.chaos.consumer`` as a child process."""

    def __init__(self, dir: Path, name: str, port: int, args: list[str] | None = None) -> None:
        self.dir = Path(dir)
        self.name = name
        self.port = port
        self.args = args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.kills = 0
        self.exits: list[int] = []

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "stderr.log", "ab") as log:
            self.proc = track(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tools.chaos.consumer",
                        "--port",
                        str(self.port),
                        "--dir",
                        str(self.dir),
                        "--name",
                        self.name,
                        *self.args,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    cwd=ROOT,
                )
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap(self) -> None:
        if (
            self.proc is not None
            and self.proc.poll() is not None
            and self.proc.returncode not in (None, -signal.SIGKILL)
        ):
            self.exits.append(self.proc.returncode)

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.kills += 1

    async def terminate(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                await trio.sleep(0.05)
            if self.proc.poll() is None:
                self.kill()
        return self.proc.returncode

    def status(self) -> dict[str, Any]:
        try:
            return json.loads((self.dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}


async def stream_state(port: int, num_vbuckets: int) -> tuple[dict[str, str], dict[int, int]]:
    """The server's live documents by a fresh full stream (to_latest), and per vbucket the
    newest uuid of the log it was streamed under."""
    state: dict[str, str | None] = {}
    uuids: dict[int, int] = {}
    async with DcpClient(
        HOST, port, to_latest=True, include_expirations=True, retry_timeout=30.0
    ) as client:
        async for item in client:
            if isinstance(item, RollbackEvent):
                raise HarnessError(f"a fresh stream from 0 was told to roll back: {item}")
            uuids[item.vbucket] = item.vb_uuid
            for e in item.events:
                t = type(e)
                if t is Mutation:
                    state[e.key.decode("latin-1")] = e.value.decode("latin-1")
                elif t is Deletion or t is Expiration:
                    state[e.key.decode("latin-1")] = None
    return {k: v for k, v in state.items() if v is not None}, uuids


async def _get_state(port: int, keys: list[str], num_vbuckets: int) -> dict[str, str]:
    async with KvClient(HOST, port, num_vbuckets=num_vbuckets, timeout=30.0) as kv:
        got = await kv.get_many(keys)
    return {k.decode("latin-1"): r.value.decode("latin-1") for k, r in got.items()}


async def _wait_converged(
    consumers: list[ConsumerProc], target: dict[int, tuple[int, int]], timeout: float
) -> list[str]:
    deadline = time.monotonic() + timeout
    behind: list[str] = []
    while time.monotonic() < deadline:
        behind = []
        for c in consumers:
            if not c.alive():
                c.reap()
                c.start()
            pos = c.status().get("positions", {})
            for vb, (high, uuid) in target.items():
                got = pos.get(str(vb))
                if high and (got is None or got[0] != high or got[1] != uuid):
                    behind.append(f"{c.name} vb {vb}: at {got}, server at {[high, uuid]}")
        if not behind:
            return []
        await trio.sleep(0.2)
    return behind[:10]


def _lost_writes(
    writer: Writer,
    history: list[tuple[int, dict[int, list[tuple[int, int]]]]],
) -> tuple[int, list[str]]:
    """Acknowledged writes that a restart discarded (above the new failover entry), and
    findings for the durable ones among them."""
    lost = 0
    findings: list[str] = []
    for (_, before), (epoch, after) in itertools.pairwise(history):
        for vb, log in after.items():
            prev = before.get(vb)
            if not prev or not log or log[0][0] == prev[0][0]:
                continue
            branch = log[0][1]
            for a in writer.log.attempts:
                if a.status == "acked" and a.vb == vb and a.uuid == prev[0][0] and a.seqno > branch:
                    lost += 1
                    if a.durable:
                        findings.append(
                            f"server: restart {epoch} put vb {vb}'s failover entry at {branch}, "
                            f"below durable {a.op}:{a.key} v{a.version} acknowledged at seqno "
                            f"{a.seqno}"
                        )
    return lost, findings


def _acked_tops(writer: Writer, logs: dict[int, list[tuple[int, int]]]) -> dict[int, int]:
    """Per vbucket, the highest seqno acknowledged on its current branch so far."""
    top: dict[int, int] = {}
    for a in writer.log.attempts:
        if a.status == "acked" and logs.get(a.vb) and a.uuid == logs[a.vb][0][0]:
            top[a.vb] = max(top.get(a.vb, 0), a.seqno)
    return top


async def _check_clean_restart(
    port: int,
    top: dict[int, int],
    before: dict[int, list[tuple[int, int]]],
    after: dict[int, list[tuple[int, int]]],
    rnd: int,
) -> list[str]:
    """After a graceful stop: no new failover entry, and every write acknowledged before
    the old process exited (``top``, taken then: later acks come from the new one) is
    still there (the stop flushed everything)."""
    out = []
    seqnos = await vb_seqnos(port)
    for vb, log in after.items():
        if before.get(vb) != log:
            out.append(
                f"server: graceful restart in round {rnd} changed vb {vb}'s failover "
                f"log {before.get(vb, [])[:2]} -> {log[:2]}"
            )
    for vb, s in top.items():
        if seqnos[vb][0] < s:
            out.append(
                f"server: after a graceful restart in round {rnd} vb {vb} is at seqno "
                f"{seqnos[vb][0]}, below the acknowledged {s}"
            )
    return out


@scenario
async def run_crash(
    workdir: Path,
    *,
    rounds: int = 50,
    consumers: int = 3,
    num_vbuckets: int = 16,
    keys_per_vb: int = 40,
    seed: int | None = None,
    min_up: float = 0.4,
    max_up: float = 2.0,
    consumer_kill_prob: float = 0.35,
    converge_timeout: float = 120.0,
    time_limit: float = 1200.0,
    graceful_prob: float = 0.15,
    freeze_prob: float = 0.08,
    sleeper_rounds: int = 30,
    writer_batch: int = 16,
    consumer_fault: str = "none",
    server_args: list[str] | None = None,
    consumer_args: list[str] | None = None,
) -> dict[str, Any]:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    seed = random.randrange(1 << 32) if seed is None else seed
    rng = random.Random(seed)
    t0 = time.monotonic()
    port = free_port()
    server = ServerProcess(
        workdir / "data",
        workdir / "server.log",
        port=port,
        num_vbuckets=num_vbuckets,
        args=["--expiry-interval", "1", "--log-level", "INFO", *(server_args or [])],
    )
    await server.start()
    keys = keys_per_vbucket("k", keys_per_vb, num_vbuckets)
    fence_keys = _fence_keys(num_vbuckets)
    writer = Writer(
        port, keys, num_vbuckets, random.Random(rng.randrange(1 << 32)), batch=writer_batch
    )
    writer.epoch = 1
    history = [(1, await failover_logs(port))]
    procs = [
        ConsumerProc(
            workdir / f"consumer{i}",
            f"chaos-consumer-{i}",
            port,
            ["--fault", consumer_fault, *(consumer_args or [])],
        )
        for i in range(consumers)
    ]
    for c in procs:
        c.start()
    server_kills = 0
    graceful_stops = 0
    freezes = 0
    sleeper = (
        procs[-1] if sleeper_rounds and consumers >= 2 and rounds >= sleeper_rounds + 5 else None
    )
    rounds_done = 0
    findings: list[str] = []
    writer_done = trio.Event()

    async def write() -> None:
        try:
            await writer.run()
        finally:
            writer_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        for rnd in range(rounds):
            if time.monotonic() - t0 > time_limit:
                break
            up = rng.uniform(min_up, max_up)
            victim = None
            if sleeper is not None and rnd == 2:
                sleeper.kill()  # sleeps through more restarts than a failover log holds
            if sleeper is not None and rnd == 2 + sleeper_rounds:
                sleeper.start()
            awake = [c for c in procs if c is not sleeper or not 2 <= rnd < 2 + sleeper_rounds]
            if rng.random() < consumer_kill_prob:
                t_c = rng.uniform(0, up)
                await trio.sleep(t_c)
                victim = rng.choice(awake)
                victim.kill()
                await trio.sleep(up - t_c)
            else:
                await trio.sleep(up)
            if rng.random() < freeze_prob:
                pause = rng.uniform(2.0, 5.0)  # SIGSTOP: consumers must detect a dead peer
                server.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
                await trio.sleep(pause)
                server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
                freezes += 1
                if victim is not None:
                    victim.start()
                rounds_done += 1
                continue
            graceful = rng.random() < graceful_prob
            top: dict[int, int] = {}
            if graceful:
                rc = await server.terminate()
                top = _acked_tops(writer, history[-1][1])
                graceful_stops += 1
                if rc != 0:
                    findings.append(f"server: graceful stop in round {rnd} exited with {rc}")
            else:
                server.kill()
                server_kills += 1
            for c in awake:
                if not c.alive():
                    c.reap()
                    if c is not victim:  # died by itself: that is a finding
                        findings.append(f"{c.name} exited on its own: {c.status().get('error')}")
            if victim is not None and rng.random() < 0.5:
                victim.start()  # starts while the server is down
            await trio.sleep(rng.uniform(0.0, 0.3))
            await server.start()
            writer.epoch = rnd + 2
            history.append((rnd + 2, await failover_logs(port)))
            if graceful:
                findings += await _check_clean_restart(
                    port, top, history[-2][1], history[-1][1], rnd
                )
            if victim is not None and not victim.alive():
                victim.start()
            rounds_done += 1
        # ---- final phase: quiesce, converge, compare
        writer.stop.set()
        with trio.fail_after(60):
            await writer_done.wait()
        async with KvClient(HOST, port, num_vbuckets=num_vbuckets, timeout=30.0) as kv:
            await writer.fence(kv, fence_keys)
        exp_until = max([a.expires_at for a in writer.log.attempts if a.op == "exp"], default=0.0)
        await trio.sleep(max(0.0, exp_until + 2.5 - time.time()))
        nursery.cancel_scope.cancel()

    seqnos = await vb_seqnos(port)
    target = {vb: (h, u) for vb, (h, u, _p) in seqnos.items()}
    behind = await _wait_converged(procs, target, converge_timeout)
    findings += [f"not converged: {b}" for b in behind]
    for c in procs:
        rc = await c.terminate()
        if rc not in (0, None, -signal.SIGKILL):
            findings.append(f"{c.name} exited with {rc}: {c.status().get('error')}")
    server_state, stream_uuids = await stream_state(port, num_vbuckets)
    get_state = await _get_state(port, keys + list(fence_keys.values()), num_vbuckets)
    if get_state != server_state:
        diff = sorted(set(get_state.items()) ^ set(server_state.items()))[:5]
        findings.append(f"server: GET and a full stream disagree on {diff}")
    alive_at_end = server.alive()
    await server.terminate()
    crash_sigs = server.crash_signatures()
    if not alive_at_end:
        findings.append("server: not running at the end")

    writer.log.dump(workdir / "writer.jsonl")
    truth = Truth(writer.log.attempts, num_vbuckets)
    findings += check_server_state(server_state, truth, final_epoch=writer.epoch, now=time.time())
    lost, durable_findings = _lost_writes(writer, history)
    findings += durable_findings
    totals: dict[str, int] = {}
    per_consumer: dict[str, Any] = {}
    for c in procs:
        view, found, counts = verify_journal(c.name, read_journal(c.dir / "journal.jsonl"), truth)
        findings += found
        state = view.state()
        if state != server_state:
            diff = sorted(set(state.items()) ^ set(server_state.items()))[:5]
            findings.append(
                f"{c.name}: final view differs from the server on "
                f"{len(set(state.items()) ^ set(server_state.items()))} "
                f"documents, e.g. {diff}"
            )
        try:
            saved = json.loads((c.dir / "view.json").read_text())["state"]
            if saved != state:
                findings.append(f"{c.name}: view.json differs from its journal replay")
        except (OSError, ValueError, KeyError):
            findings.append(f"{c.name}: no view.json written at exit")
        for vb, u in stream_uuids.items():
            got = view.vbs.get(vb)
            if got is not None and got.log and got.log[0][0] != u:
                findings.append(f"{c.name}: vb {vb} ends on uuid {got.log[0][0]}, server {u}")
        st = c.status().get("counts", {})
        counts["starts"] = st.get("starts", 0)
        counts["kills"] = c.kills
        per_consumer[c.name] = counts
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
    writes = writer.log.counts()
    report = {
        "scenario": "crash",
        "seed": seed,
        "rounds": rounds_done,
        "rounds_asked": rounds,
        "server_args": server_args or [],
        "consumer_args": consumer_args or [],
        "server_kills": server_kills,
        "graceful_stops": graceful_stops,
        "server_freezes": freezes,
        "sleeper": None
        if sleeper is None
        else f"{sleeper.name} down for rounds 2..{1 + sleeper_rounds}",
        "server_starts": server.starts,
        "consumer_kills": sum(c.kills for c in procs),
        "consumers": consumers,
        "num_vbuckets": num_vbuckets,
        "keys": len(keys),
        "writes": writes,
        "acked_writes_lost_in_crashes": lost,
        "rollbacks_seen": totals.get("rollbacks", 0),
        "snapshots_verified": totals.get("batches", 0),
        "events_verified": totals.get("events", 0),
        "acked_writes_checked": totals.get("checked_writes", 0),
        "disk_snapshots": totals.get("disk_snapshots", 0),
        "view_cuts": totals.get("cuts", 0),
        "final_documents": len(server_state),
        "per_consumer": per_consumer,
        "crashes": len(crash_sigs),
        "divergences": len(findings),
        "findings": ([f"server traceback: {t}" for t in crash_sigs] + findings)[:200],
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    (workdir / "report.json").write_text(json.dumps(report, indent=1))
    return report


def _fence_keys(num_vbuckets: int) -> dict[int, str]:
    from dcp.protocol import codec

    out: dict[int, str] = {}
    i = 0
    while len(out) < num_vbuckets:
        k = f"fence{i:05d}"
        out.setdefault(codec.vbucket_for_key(k.encode(), num_vbuckets), k)
        i += 1
    return out
