"""Scenario ``fuzz``: malformed and random frames from several connections at a live
server, while a healthy SDK consumer streams alongside and a writer writes.

Rules of this module:
- Frames come from ``frames.FrameFactory``: the project's hypothesis strategies
  built with the construct spec, hand-written templates for every opcode the server
  handles, and their in-sync or breaking mutations. Several connections fuzz at once.
- An episode = one connection: an optional valid prelude (HELLO, DCP_OPEN, controls),
  a burst of frames, then a probe (VERSION with a unique opaque). The server must answer
  the probe or close the connection; after a breaking burst we half-close and it must
  then close. Neither within ``probe_timeout`` = a hung connection (an error). The
  episode then closes its socket, unread data and all (the kernel sends RST), unless
  ``graceful_close`` (half-close and drain first).
- A server that dies is a crash: counted, its traceback kept, and it is started again so
  the run goes on to its frame count.
- The healthy consumer must finish with no reconnect, no stream reopen or retry, no
  rollback, no error, and its journal must verify against the writer's log (nothing
  lost or invented); the server must be alive, log no traceback and answer STAT at the end.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import trio

from dcp.consumer import DcpClient, Deletion, Expiration, MemoryOffsetStore, Mutation
from dcp.protocol import codec
from dcp.protocol.opcodes import DcpOpenFlag, Opcode
from dcp.protocol.raw_session import RawSession

from .frames import FrameFactory, hypothesis_corpus
from .procs import HOST, RawClient, ServerProcess, free_port, scenario, vb_seqnos
from .verify import Truth, check_server_state, verify_journal
from .writer import Writer, keys_per_vbucket

__all__ = ["run_fuzz"]

_PROBE_BASE = 0xF0000000


class _Stats:
    def __init__(self) -> None:
        self.frames = 0
        self.bytes = 0
        self.episodes = 0
        self.answered = 0
        self.closed = 0
        self.closed_after_eof = 0
        self.responses = 0
        self.hung: list[str] = []
        self.resets = 0
        self.connect_failures = 0


async def _episode(
    port: int,
    fac: FrameFactory,
    st: _Stats,
    rng: random.Random,
    probe_timeout: float,
    max_burst: int,
    graceful_close: bool,
) -> None:
    stream = await trio.open_tcp_stream(HOST, port)
    probe = _PROBE_BASE + st.episodes
    st.episodes += 1
    got_probe = trio.Event()
    eof = trio.Event()

    async def read() -> None:
        session = RawSession(max_body_size=64 << 20)
        try:
            while True:
                data = await stream.receive_some(1 << 16)
                if not data:
                    break
                for f in session.receive_data(data):
                    st.responses += 1
                    if f.is_response and f.opaque == probe:
                        got_probe.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            eof.set()

    break_it = rng.random() < 0.3
    prelude = []
    if rng.random() < 0.6:
        prelude.append(codec.hello("fz", [0x07, 0x0B, 0x04, 0x10], fac._op()))
    if rng.random() < 0.5:
        prelude.append(
            codec.dcp_open(b"fz-%x" % rng.randrange(1 << 40), DcpOpenFlag.PRODUCER, fac._op())
        )
        if rng.random() < 0.5:
            prelude.append(codec.dcp_control("enable_noop", "true", fac._op()))
    pre = b"".join(prelude)
    data, n = fac.burst(rng.randint(20, max_burst), break_it)
    outcome = "?"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        try:
            await stream.send_all(pre + data)
            st.frames += n + len(prelude)
            st.bytes += len(pre) + len(data)
            if break_it:
                await stream.send_eof()  # the server may be waiting for a body that never comes
            else:
                await stream.send_all(codec.request(Opcode.VERSION, opaque=probe))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        with trio.move_on_after(probe_timeout):
            while not (got_probe.is_set() or eof.is_set()):
                await trio.sleep(0.005)
        if got_probe.is_set():
            outcome = "answered"
        elif eof.is_set():
            outcome = "closed"
        elif break_it:
            outcome = "hung"
        else:
            try:
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            with trio.move_on_after(probe_timeout):
                await eof.wait()
            outcome = "closed_after_eof" if eof.is_set() else "hung"
        if graceful_close and not eof.is_set():
            # Half-close and read to EOF: no unread data at close, so no RST (the
            # workaround for the reset crash, see tests/chaos/test_regressions.py).
            try:
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            with trio.move_on_after(probe_timeout):
                await eof.wait()
        nursery.cancel_scope.cancel()
    if not graceful_close:
        st.resets += 1
    await trio.aclose_forcefully(stream)  # with unread data pending this sends an RST
    if outcome == "answered":
        st.answered += 1
    elif outcome == "closed":
        st.closed += 1
    elif outcome == "closed_after_eof":
        st.closed_after_eof += 1
        if not break_it:
            st.hung.append(
                f"episode {probe - _PROBE_BASE}: in-sync burst of {n} frames: probe "
                f"unanswered for {probe_timeout}s, closed only after our EOF"
            )
    else:
        st.hung.append(
            f"episode {probe - _PROBE_BASE}: neither answered nor closed "
            f"(breaking={break_it}, {n} frames)"
        )


async def _healthy(port: int, nv: int, ops: list, stop: trio.Event, out: dict[str, Any]) -> None:
    """The healthy consumer: streams everything and journals it in memory."""
    try:
        async with DcpClient(
            HOST,
            port,
            name=f"healthy-{random.randrange(1 << 40):x}",
            offset_store=MemoryOffsetStore(),
            include_expirations=True,
            noop_interval=5.0,
            retry_timeout=60.0,
        ) as client:
            out["client"] = client
            while not stop.is_set():
                for item in await client.getmany(timeout=0.2):
                    events = []
                    for e in item.events:
                        key = e.key.decode("latin-1")
                        if not key.startswith("healthy-doc:"):
                            continue  # documents the fuzzers created
                        t = type(e)
                        if t is Mutation:
                            events.append([e.seqno, "m", key, e.value.decode("latin-1")])
                        elif t is Deletion or t is Expiration:
                            events.append([e.seqno, "d" if t is Deletion else "x", key, None])
                    ops.append(
                        [
                            "b",
                            item.vbucket,
                            item.start,
                            item.end,
                            item.flags,
                            [list(x) for x in item.failover_log],
                            events,
                        ]
                    )
                await client.commit()
            out["stats"] = client.statistics()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"


@scenario
async def run_fuzz(
    workdir: Path,
    *,
    frames: int = 1_000_000,
    connections: int = 4,
    num_vbuckets: int = 16,
    seed: int | None = None,
    time_limit: float = 900.0,
    corpus_size: int = 400,
    probe_timeout: float = 10.0,
    max_burst: int = 3000,
    log_level: str = "WARNING",
    graceful_close: bool = False,
) -> dict[str, Any]:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    seed = random.randrange(1 << 32) if seed is None else seed
    rng = random.Random(seed)
    t0 = time.monotonic()
    corpus = hypothesis_corpus(corpus_size, seed)
    server = ServerProcess(
        workdir / "data",
        workdir / "server.log",
        port=free_port(),
        num_vbuckets=num_vbuckets,
        args=["--log-level", log_level, "--expiry-interval", "1"],
    )
    port = await server.start()
    keys = keys_per_vbucket("healthy-doc:", 16, num_vbuckets)
    writer = Writer(
        port,
        keys,
        num_vbuckets,
        random.Random(rng.randrange(1 << 32)),
        batch=8,
        pause=0.02,
        timeout=30.0,
    )
    writer.epoch = 1
    st = _Stats()
    ops: list = []
    healthy: dict[str, Any] = {}
    stop_healthy = trio.Event()
    crashes = 0
    errors: list[str] = []

    async def fuzzer(i: int) -> None:
        frng = random.Random(rng.randrange(1 << 32))
        fac = FrameFactory(frng, num_vbuckets, corpus)
        while st.frames < frames and time.monotonic() - t0 < time_limit:
            try:
                await _episode(port, fac, st, frng, probe_timeout, max_burst, graceful_close)
            except OSError:  # the server is down (the watchdog restarts it)
                st.connect_failures += 1
                await trio.sleep(0.2)

    async def watchdog() -> None:
        """A dead server is a crash: count it, keep its traceback, start it again."""
        nonlocal crashes
        while True:
            await trio.sleep(0.2)
            if not server.alive():
                crashes += 1
                errors.append(
                    f"server died (exit {server.proc.returncode}) after "  # type: ignore[union-attr]
                    f"{st.frames} frames; restarted"
                )
                await server.start()
                writer.epoch += 1

    async with trio.open_nursery() as outer:
        outer.start_soon(watchdog)
        outer.start_soon(writer.run)
        outer.start_soon(_healthy, port, num_vbuckets, ops, stop_healthy, healthy)
        async with trio.open_nursery() as fz:
            for i in range(connections):
                fz.start_soon(fuzzer, i)
        writer.stop.set()
        await trio.sleep(0.5)
        exp_until = max([a.expires_at for a in writer.log.attempts if a.op == "exp"], default=0.0)
        await trio.sleep(max(0.0, exp_until + 2.5 - time.time()))
        # let the healthy consumer catch up with the high seqnos
        target = {vb: h for vb, (h, _u, _p) in (await vb_seqnos(port)).items()}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ends: dict[int, int] = {}
            for op in ops:
                ends[op[1]] = max(ends.get(op[1], 0), op[3])
            if all(ends.get(vb, 0) >= h for vb, h in target.items() if h):
                break
            await trio.sleep(0.2)
        else:
            errors.append("healthy consumer did not reach the high seqnos in 60 s")
        stop_healthy.set()
        await trio.sleep(0.5)
        outer.cancel_scope.cancel()

    answers = False
    if server.alive():
        try:
            c = await RawClient.connect(port)
            try:
                answers = bool(await c.stats(""))
            finally:
                await c.aclose()
        except Exception as exc:
            errors.append(f"server does not answer STAT at the end: {exc!r}")
    else:
        crashes = max(crashes, 1)
    sigs = server.crash_signatures()  # the log spans every restart
    tracebacks = [f"server traceback: {t}" for t in sigs]
    await server.terminate()
    truth = Truth(writer.log.attempts, num_vbuckets)
    view, found, counts = verify_journal("healthy", [ops], truth)
    found += check_server_state(view.state(), truth, final_epoch=writer.epoch, now=time.time())
    hstats = healthy.get("stats", {})
    healthy_errors = list(found)
    if healthy.get("error"):
        healthy_errors.append("healthy consumer raised " + healthy["error"])
    for k in ("reconnects", "stream_reopens", "stream_retries", "rollbacks"):
        if hstats.get(k):
            healthy_errors.append(f"healthy consumer {k} = {hstats[k]}")
    if not hstats:
        healthy_errors.append("healthy consumer reported no statistics")
    elapsed = time.monotonic() - t0
    report = {
        "scenario": "fuzz",
        "seed": seed,
        "frames_sent": st.frames,
        "bytes_sent": st.bytes,
        "frames_per_s": round(st.frames / elapsed),
        "connections": connections,
        "episodes": st.episodes,
        "corpus_frames_from_hypothesis": len(corpus),
        "probe_answered": st.answered,
        "closed_by_server": st.closed,
        "closed_after_client_eof": st.closed_after_eof,
        "frames_received": st.responses,
        "hung_connections": len(st.hung),
        "abortive_closes": st.resets,
        "connect_failures": st.connect_failures,
        "graceful_close_workaround": graceful_close,
        "crashes": crashes,
        "server_answers_at_end": answers,
        "healthy_writes_acked": writer.log.counts().get("acked", 0),
        "healthy_snapshots_verified": counts["batches"],
        "healthy_acked_writes_checked": counts["checked_writes"],
        "healthy_client_stats": {
            k: hstats.get(k)
            for k in (
                "connects",
                "reconnects",
                "stream_reopens",
                "stream_retries",
                "rollbacks",
                "batches",
                "items",
            )
        },
        "healthy_stream_errors": len(healthy_errors),
        "server_tracebacks": len(tracebacks),
        "errors": len(errors)
        - crashes
        + len(st.hung)
        + (0 if answers else 1)
        + (len(tracebacks) if not crashes else 0),
        "findings": (errors + healthy_errors + st.hung + tracebacks)[:100],
        "elapsed_s": round(elapsed, 1),
    }
    return report
