"""Scenario ``abuse``: clients that try to make the server spend unbounded memory or stall
everyone else, while a well-behaved neighbour measures what the others feel.

Phases, one after the other against one ``dcp-server`` child started with stated limits
(``connection_output_cap``, ``total_output_cap``, ``max_connections``,
``partial_frame_timeout``):

- ``amplification``: one large value is stored, then ``gets`` GETs for it go out in a single
  write on a connection that never reads (a few KB in, gigabytes out if nothing bounds it);
- ``stat_flood``: ``stat_requests`` ``STAT vbucket-seqno`` requests in one write, never read;
- ``slowloris``: ``slowloris`` connections each send a frame header one byte per second;
- ``connection_flood``: ``max_connections + flood_extra`` connections, each asking for a NOOP.

Meanwhile a neighbour sends a NOOP every 100 ms on its own connection and records each
answer's latency, and the server's RSS is sampled from /proc every 50 ms. The report gives,
per phase, the peak RSS and its growth over the phase's start, the neighbour's p50/p99/max,
the connections refused or closed, and at the end whether the server survived.

Rules of this module:
- Bounded in time and count: every phase lasts ``phase_seconds`` (slowloris: until the
  partial-frame timeout plus 2 s), every wait has a deadline, every loop a count; the whole
  default run is under 2 minutes, ``short=True`` (CI) under 20 s.
- A guard SIGKILLs the server when its RSS passes ``rss_guard_mib``, so a server without
  the limits cannot take the machine down with it; the report then says ``killed_by_guard``.
- ``violations`` (the report's failures): the server died or logged a traceback, the
  neighbour waited more than 1 s for an answer, or a phase grew the RSS past its bound
  (``total_output_cap`` + 3 values + 64 MiB: the output the caps allow plus the copies of
  the one frame being written).
- Raw sockets only (``procs.RawClient`` and trio streams), loopback only; every child is
  killed by ``@scenario``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import trio

from dcp.protocol import codec
from dcp.protocol.codec import vbucket_for_key
from dcp.protocol.opcodes import Opcode

from .procs import HOST, HarnessError, RawClient, ServerProcess, free_port, scenario

__all__ = ["NEIGHBOUR_MAX_S", "run_abuse"]

MiB = 1024 * 1024
#: The longest a neighbour's NOOP may wait for its answer before the run fails.
NEIGHBOUR_MAX_S = 1.0
_NOOP_TIMEOUT = 5.0  # a NOOP unanswered this long counts as this long, then reconnects


class Monitor:
    """The neighbour's latencies and the server's RSS, filed under the current phase."""

    def __init__(self, server: ServerProcess, guard_bytes: int) -> None:
        self.server = server
        self.guard_bytes = guard_bytes
        self.phase = "idle"
        self.latency: dict[str, list[float]] = {}
        self.peak: dict[str, int] = {}
        self.start_rss: dict[str, int] = {}
        self.neighbour_reconnects = 0
        self.waiting = False  # a NOOP of the neighbour's is out
        self.killed_by_guard = False

    def enter(self, phase: str) -> None:
        self.phase = phase
        rss = self.rss()
        self.start_rss[phase] = rss
        self.peak[phase] = rss

    def rss(self) -> int:
        try:
            with open(f"/proc/{self.server.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, AssertionError):
            pass
        return 0

    async def sample_rss(self) -> None:
        while self.server.alive():
            rss = self.rss()
            self.peak[self.phase] = max(self.peak.get(self.phase, 0), rss)
            if rss > self.guard_bytes:
                self.killed_by_guard = True
                self.server.kill()
                return
            await trio.sleep(0.05)

    async def neighbour(self, port: int) -> None:
        """A NOOP every 100 ms; the latency of each answer is filed under the phase."""
        client: RawClient | None = None
        while self.server.alive():
            try:
                if client is None:
                    client = await RawClient.connect(port, timeout=_NOOP_TIMEOUT)
                op = client.next_opaque()
                t0 = time.monotonic()
                phase = self.phase
                self.waiting = True
                try:
                    await client.call(
                        codec.request(Opcode.NOOP, opaque=op), op, timeout=_NOOP_TIMEOUT
                    )
                    self.latency.setdefault(phase, []).append(time.monotonic() - t0)
                except trio.TooSlowError:
                    self.latency.setdefault(phase, []).append(_NOOP_TIMEOUT)
                    raise
                finally:
                    self.waiting = False
            except (OSError, EOFError, trio.BrokenResourceError, trio.TooSlowError):
                if client is not None:
                    await client.aclose()
                client = None
                self.neighbour_reconnects += 1
            await trio.sleep(0.1)
        if client is not None:
            await client.aclose()


def _percentiles(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    s = sorted(xs)

    def pick(q: float) -> float:
        return round(s[min(len(s) - 1, math.ceil(q * len(s)) - 1)] * 1000, 2)

    return {
        "count": len(s),
        "p50_ms": pick(0.5),
        "p99_ms": pick(0.99),
        "max_ms": round(s[-1] * 1000, 2),
    }


async def _open(port: int) -> trio.SocketStream:
    with trio.fail_after(5):
        return await trio.open_tcp_stream(HOST, port)


async def _closed_by_server(stream: trio.SocketStream, seconds: float) -> bool:
    """Whether the server ends ``stream`` within ``seconds`` (reading and dropping data)."""
    with trio.move_on_after(seconds):
        try:
            while await stream.receive_some(1 << 16):
                pass
        except (trio.BrokenResourceError, OSError):
            pass
        return True
    return False


# ------------------------------------------------------------------------------- phases


async def amplification(
    port: int, value_bytes: int, gets: int, nvb: int, seconds: float
) -> dict[str, Any]:
    key = b"abuse-large-value"
    vb = vbucket_for_key(key, nvb)
    writer = await RawClient.connect(port)
    try:
        r = await writer.store(key, b"v" * value_bytes, vb)
        if r.status != 0:
            raise HarnessError(f"storing the large value failed: status 0x{r.status:02x}")
    finally:
        await writer.aclose()
    burst = b"".join(codec.request(Opcode.GET, vbucket=vb, opaque=i, key=key) for i in range(gets))
    attacker = await _open(port)
    try:
        await attacker.send_all(burst)  # then never read
        await trio.sleep(seconds)
    finally:
        await trio.aclose_forcefully(attacker)
    return {
        "value_mib": round(value_bytes / MiB, 1),
        "gets": gets,
        "request_bytes": len(burst),
        "unbounded_output_mib": round(gets * value_bytes / MiB),
    }


async def stat_flood(port: int, requests: int, seconds: float) -> dict[str, Any]:
    burst = b"".join(
        codec.request(Opcode.STAT, opaque=i, key=b"vbucket-seqno") for i in range(requests)
    )
    attacker = await _open(port)
    try:
        await attacker.send_all(burst)
        await trio.sleep(seconds)
    finally:
        await trio.aclose_forcefully(attacker)
    return {"requests": requests, "request_bytes": len(burst)}


async def slowloris(port: int, connections: int, seconds: float) -> dict[str, Any]:
    """Each connection sends a GET header one byte per second and never completes it."""
    header = codec.request(Opcode.GET, opaque=1, key=b"k" * 200)[:24]
    closed = 0
    opened = 0

    async def one() -> None:
        nonlocal closed, opened
        try:
            stream = await _open(port)
        except (OSError, trio.TooSlowError):
            return
        opened += 1
        try:
            async with trio.open_nursery() as nursery:

                async def drip() -> None:
                    for b in header:
                        await stream.send_all(bytes([b]))
                        await trio.sleep(1.0)
                    await trio.sleep_forever()  # one frame, never its body

                async def watch() -> None:
                    nonlocal closed
                    if await _closed_by_server(stream, seconds):
                        closed += 1
                    nursery.cancel_scope.cancel()

                nursery.start_soon(drip)
                nursery.start_soon(watch)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            closed += 1
        finally:
            await trio.aclose_forcefully(stream)

    with trio.move_on_after(seconds + 1):
        async with trio.open_nursery() as nursery:
            for _ in range(connections):
                nursery.start_soon(one)
    return {"connections": connections, "opened": opened, "closed_by_server": closed}


async def connection_flood(port: int, count: int, seconds: float) -> dict[str, Any]:
    """Open ``count`` connections, keep them all open, then ask each for a NOOP."""
    streams: list[trio.SocketStream] = []
    refused = answered = closed = unanswered = 0
    deadline = trio.current_time() + seconds
    try:
        for _ in range(count):
            if trio.current_time() > deadline:
                break
            try:
                streams.append(await _open(port))
            except (OSError, trio.TooSlowError):
                refused += 1
        noop = codec.request(Opcode.NOOP, opaque=7)

        async def ask(stream: trio.SocketStream) -> None:
            nonlocal answered, closed, unanswered
            try:
                await stream.send_all(noop)
                with trio.fail_after(max(0.5, deadline - trio.current_time())):
                    data = await stream.receive_some(1 << 16)
                if data:
                    answered += 1
                else:
                    closed += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                closed += 1
            except trio.TooSlowError:
                unanswered += 1

        async with trio.open_nursery() as nursery:
            for s in streams:
                nursery.start_soon(ask, s)
    finally:
        for s in streams:
            await trio.aclose_forcefully(s)
    return {
        "attempted": count,
        "connected": len(streams),
        "refused_at_connect": refused,
        "answered": answered,
        "closed_by_server": closed,
        "unanswered": unanswered,
    }


# ------------------------------------------------------------------------------- the run

SHORT = dict(
    value_mib=4,
    gets=50,
    stat_requests=300,
    slowloris=20,
    flood_extra=32,
    max_connections=128,
    phase_seconds=2.0,
    partial_frame_timeout=2.0,
)
DEFAULT = dict(
    value_mib=20,
    gets=100,
    stat_requests=2000,
    slowloris=100,
    flood_extra=128,
    max_connections=512,
    phase_seconds=12.0,
    partial_frame_timeout=5.0,
)


@scenario
async def run_abuse(
    workdir: Path,
    *,
    short: bool = False,
    seed: int | None = None,
    num_vbuckets: int = 1024,
    connection_output_cap_mib: int = 4,
    total_output_cap_mib: int = 64,
    rss_guard_mib: int = 1536,
    **overrides: Any,
) -> dict[str, Any]:
    """Run every phase against one server; the report's ``violations`` must be empty.

    ``overrides``: any key of ``DEFAULT`` (``value_mib``, ``gets``, ``phase_seconds``...).
    ``seed`` is accepted for the CLI's sake; nothing here is random.
    """
    o = {**(SHORT if short else DEFAULT), **overrides}
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    settings = {
        "connection_output_cap": connection_output_cap_mib * MiB,
        "total_output_cap": total_output_cap_mib * MiB,
        "max_connections": o["max_connections"],
        "partial_frame_timeout": o["partial_frame_timeout"],
        "kv_idle_timeout": 60.0,
        "log_level": "WARNING",
    }
    args = [a for k, v in settings.items() for a in ("--" + k.replace("_", "-"), str(v))]
    server = ServerProcess(
        workdir / "data",
        workdir / "server.log",
        port=free_port(),
        num_vbuckets=num_vbuckets,
        args=args,
    )
    t_start = time.monotonic()
    port = await server.start(timeout=60.0)
    mon = Monitor(server, rss_guard_mib * MiB)
    bound = (total_output_cap_mib + 3 * o["value_mib"] + 64) * MiB
    report: dict[str, Any] = {
        "settings": settings,
        "options": o,
        "phases": {},
        "rss_growth_bound_mib": bound // MiB,
        "neighbour_max_allowed_ms": NEIGHBOUR_MAX_S * 1000,
        "errors": 0,
        "errors_detail": [],
        "findings": [],
    }
    phase_s = o["phase_seconds"]
    phases = [
        (
            "amplification",
            lambda: amplification(port, o["value_mib"] * MiB, o["gets"], num_vbuckets, phase_s),
        ),
        ("stat_flood", lambda: stat_flood(port, o["stat_requests"], phase_s)),
        ("slowloris", lambda: slowloris(port, o["slowloris"], o["partial_frame_timeout"] + 2.0)),
        (
            "connection_flood",
            lambda: connection_flood(port, o["max_connections"] + o["flood_extra"], phase_s),
        ),
    ]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(mon.sample_rss)
        nursery.start_soon(mon.neighbour, port)
        mon.enter("warmup")
        await trio.sleep(0.5)
        for name, run in phases:
            if not server.alive():
                break
            mon.enter(name)
            try:
                detail = await run()
            except (HarnessError, OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                report["errors"] += 1
                report["errors_detail"].append(f"{name}: {type(exc).__name__}: {exc}")
                detail = {}
            await trio.sleep(0.5)  # the neighbour and the sampler see the aftermath
            report["phases"][name] = {
                **detail,
                "peak_rss_mib": round(mon.peak[name] / MiB, 1),
                "rss_growth_mib": round((mon.peak[name] - mon.start_rss[name]) / MiB, 1),
            }
        mon.enter("end")
        survived = server.alive() and await _answers(port)
        with trio.move_on_after(_NOOP_TIMEOUT + 0.5):  # a NOOP still waiting is filed
            while mon.waiting:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    for name, ph in report["phases"].items():  # filed under the phase each NOOP began in
        ph["neighbour"] = _percentiles(mon.latency.get(name, []))
    report.update(_verdict(report, mon, server, survived, bound))
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    await server.terminate()
    return report


async def _answers(port: int) -> bool:
    try:
        c = await RawClient.connect(port, timeout=5)
        try:
            op = c.next_opaque()
            await c.call(codec.request(Opcode.NOOP, opaque=op), op, timeout=5)
            return True
        finally:
            await c.aclose()
    except (OSError, EOFError, trio.BrokenResourceError, trio.TooSlowError):
        return False


def _verdict(
    report: dict[str, Any], mon: Monitor, server: ServerProcess, survived: bool, bound: int
) -> dict[str, Any]:
    findings: list[str] = report["findings"]
    crashes = server.crash_signatures()
    if mon.killed_by_guard:
        findings.append(f"RSS passed the guard ({mon.guard_bytes // MiB} MiB): server killed")
    elif not survived:
        findings.append("the server died or stopped answering")
    findings += [f"traceback in the server's log: {c}" for c in crashes]
    all_lat = [x for v in mon.latency.values() for x in v]
    worst = max(all_lat, default=0.0)
    if worst > NEIGHBOUR_MAX_S:
        findings.append(f"the neighbour waited {worst * 1000:.0f} ms for a NOOP answer")
    for name, ph in report["phases"].items():
        if ph["rss_growth_mib"] * MiB > bound:
            findings.append(
                f"{name}: RSS grew {ph['rss_growth_mib']} MiB, over the bound of {bound // MiB} MiB"
            )
    return {
        "server_survived": survived,
        "killed_by_guard": mon.killed_by_guard,
        "crashes": len(crashes) + (0 if survived else 1),
        "neighbour": {**_percentiles(all_lat), "reconnects": mon.neighbour_reconnects},
        "violations": len(findings),
    }  # a traceback is a violation too (module rules)
