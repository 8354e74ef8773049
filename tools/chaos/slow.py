"""Scenario ``slow``: consumers that stall, read slowly or never ack flow control while a
writer writes far more than the checkpoint memory quota; memory must stay bounded, their
cursors must be dropped, and once they resume they must receive everything (by backfill).

Rules of this module:
- Three slow consumers: ``stall`` (a thin shell over ``ClientSession``, 256 KiB
  flow-control window, never acks until resumed), ``trickle`` (the same shell, no flow
  control, reads 4 KiB every 50 ms) and
  ``sdk-paused`` (an SDK ``DcpClient`` whose application does not iterate until resumed).
- Two phases of writes: first with no DCP consumer (the server's own heap peak under
  this ingest), then with the slow consumers connected. Sampled: RSS (psutil; anonymous
  and file-backed parts from /proc: LMDB's map pages are file-backed and evictable),
  ``ep_checkpoint_memory`` and the streams' buffered backfill bytes. Bounds: checkpoint
  memory <= the server's own write-refusal threshold max(2 x quota, quota + 64 MiB) +
  8 MiB (one pipelined batch); the slow consumers may add at most ``overhead_mib`` of
  anonymous RSS over the first phase's peak, whatever the volume written and the number
  of vbuckets streamed.
- "Everything received" = per vbucket, each consumer ends at the server's high seqno and
  its newest version of every key equals the writer's last acknowledged version; every
  item lies inside its snapshot marker, in seqno order.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import trio

from dcp.consumer import DcpClient, KvClient, MemoryOffsetStore
from dcp.protocol import ClientSession, RemoteProtocolError, codec
from dcp.protocol import events as ev
from dcp.protocol.opcodes import DcpOpenFlag

from .procs import HOST, RawClient, ServerProcess, free_port, scenario, vb_seqnos

__all__ = ["run_slow"]


class _Received:
    """What one consumer has seen, per vbucket: newest (seqno, version) per key."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.latest: dict[int, dict[bytes, tuple[int, int]]] = {}
        self.end: dict[int, int] = {}
        self.marker: dict[int, tuple[int, int, int]] = {}
        self.disk_snapshots = 0
        self.items = 0
        self.problems: list[str] = []

    def on_marker(self, vb: int, start: int, end: int, flags: int) -> None:
        self.marker[vb] = (start, end, flags)
        if flags & 0x02:
            self.disk_snapshots += 1

    def on_item(self, vb: int, seqno: int, key: bytes, value: bytes | None) -> None:
        self.items += 1
        m = self.marker.get(vb)
        last = self.end.get(vb, 0)
        if m is None or not m[0] <= seqno <= m[1] or seqno <= last:
            if len(self.problems) < 20:
                self.problems.append(
                    f"{self.name} vb {vb}: item {seqno} outside marker {m} or not after {last}"
                )
        self.end[vb] = max(last, seqno)
        version = int(value.split(b"|", 2)[1]) if value else -1
        self.latest.setdefault(vb, {})[key] = (seqno, version)

    def on_marker_end(self, vb: int) -> None:
        m = self.marker.get(vb)
        if m is not None:
            self.end[vb] = max(self.end.get(vb, 0), m[1])


class RawSlowConsumer:
    """A DCP consumer over a ``ClientSession`` (outside the SDK, so nothing buffers ahead
    of it) that can stall (no acks) or trickle (tiny slow reads)."""

    def __init__(self, name: str, port: int, nv: int, *, window: int, mode: str) -> None:
        self.name = name
        self.port = port
        self.nv = nv
        self.window = window
        self.mode = mode  # stall | trickle
        self.resumed = trio.Event()
        self.got = _Received(name)
        self.unacked = 0
        self.error = ""
        self.send_lock = trio.Lock()

    async def send(self, stream: trio.SocketStream, data: bytes) -> None:
        async with self.send_lock:
            await stream.send_all(data)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        stream = await trio.open_tcp_stream(HOST, self.port)
        # the session frames, answers noops and counts flow control; acks are due only
        # for bytes this consumer reports ``handed`` (never while stalled)
        session = ClientSession(window=self.window, queue_per_chunk=True, max_body_size=64 << 20)
        hs = codec.dcp_open(self.name, DcpOpenFlag.PRODUCER, session.next_opaque())
        hs += codec.dcp_control("connection_buffer_size", str(self.window), session.next_opaque())
        hs += codec.dcp_control("supports_cursor_dropping", "true", session.next_opaque())
        for vb in range(self.nv):
            hs += session.stream_request(vb)[1]
        await stream.send_all(hs)
        task_status.started()

        async def ack_on_resume() -> None:
            await self.resumed.wait()
            if self.unacked:  # the window is full: nothing arrives until we ack
                n, self.unacked = self.unacked, 0
                ack = session.handed(n)
                if ack:
                    await self.send(stream, ack)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ack_on_resume)
                await self._read(stream, session, self.got)
                nursery.cancel_scope.cancel()
        except RemoteProtocolError as exc:
            self.error = f"server broke the protocol: {exc}"
        finally:
            await trio.aclose_forcefully(stream)

    async def _read(
        self, stream: trio.SocketStream, session: ClientSession, got: _Received
    ) -> None:
        while True:
            resumed = self.resumed.is_set()
            size = 4096 if self.mode == "trickle" and not resumed else 1 << 18
            data = await stream.receive_some(size)
            if not data:
                self.error = "server closed the connection"
                return
            for e in session.receive_data(data):
                if isinstance(e, ev.Items):
                    for item in e.items:
                        got.on_item(
                            e.vbucket,
                            item.seqno,
                            item.key,
                            item.value if type(item) is ev.Mutation else None,
                        )
                elif isinstance(e, ev.Marker):
                    got.on_marker(e.vbucket, e.start, e.end, e.flags)
                elif isinstance(e, ev.StreamEnded):
                    self.error = f"unexpected stream end vb {e.vbucket}"
                elif isinstance(e, ev.StreamRefused):
                    self.error = f"stream request vb {e.vbucket}: 0x{e.status:x}"
                elif isinstance(e, ev.StreamRollback):
                    self.error = f"stream request vb {e.vbucket}: rollback to {e.seqno}"
            self.unacked += session.counted
            out = session.data_to_send()  # noop replies
            if self.mode != "stall" or resumed:
                out += session.handed(self.unacked)
                self.unacked = 0
            if out:
                await self.send(stream, out)
            if self.mode == "trickle" and not resumed:
                await trio.sleep(0.05)


class SdkPausedConsumer:
    def __init__(self, name: str, port: int) -> None:
        self.name = name
        self.port = port
        self.resumed = trio.Event()
        self.got = _Received(name)
        self.error = ""
        self.stats: dict[str, Any] = {}

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with DcpClient(
                HOST,
                self.port,
                name=self.name,
                buffer_size=256 * 1024,
                offset_store=MemoryOffsetStore(),
                retry_timeout=120.0,
            ) as c:
                task_status.started()
                got = self.got
                first = await c.getmany(timeout=2.0)  # take a little, then stop consuming
                await self.resumed.wait()
                while True:
                    items = first or await c.getmany(timeout=0.5)
                    first = []
                    for b in items:
                        if not hasattr(b, "events"):
                            self.error = f"unexpected {b!r}"
                            continue
                        got.on_marker(b.vbucket, b.start, b.end, b.flags)
                        for e in b.events:
                            got.on_item(b.vbucket, e.seqno, e.key, getattr(e, "value", None))
                        got.on_marker_end(b.vbucket)
                    await c.commit()
                    self.stats = c.statistics()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"


def _rss_parts(pid: int) -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes: LMDB's map pages are file-backed."""
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, file


async def _stats(port: int, group: str) -> dict[str, str]:
    c = await RawClient.connect(port)
    try:
        return await c.stats(group)
    finally:
        await c.aclose()


@scenario
async def run_slow(
    workdir: Path,
    *,
    seconds: float = 20.0,
    quota_mib: int = 8,
    num_vbuckets: int = 32,
    keys: int = 40000,
    value_bytes: int = 1024,
    overhead_mib: int = 64,
    seed: int | None = None,
    resume_timeout: float = 180.0,
) -> dict[str, Any]:
    """Phase 1 (``seconds``/2): writes with no DCP consumer: the server's own peak heap
    under this ingest (``ingest_anon_max_mib``). Phase 2 (``seconds``/2): the three slow
    consumers connect (streaming every vbucket from 0) and the writes go on. The slow
    consumers may add at most ``overhead_mib`` of heap; then they resume and must
    receive everything."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    seed = random.randrange(1 << 32) if seed is None else seed
    rng = random.Random(seed)
    t0 = time.monotonic()
    quota = quota_mib << 20
    server = ServerProcess(
        workdir / "data",
        workdir / "server.log",
        port=free_port(),
        num_vbuckets=num_vbuckets,
        args=[
            "--checkpoint-memory-quota",
            str(quota),
            "--checkpoint-max-items",
            "1000",
            "--log-level",
            "INFO",
        ],
    )
    port = await server.start()
    await trio.sleep(0.5)
    baseline_rss = _rss_parts(server.pid)[0]
    findings: list[str] = []
    consumers = [
        RawSlowConsumer("slow-stall", port, num_vbuckets, window=256 * 1024, mode="stall"),
        RawSlowConsumer("slow-trickle", port, num_vbuckets, window=0, mode="trickle"),
    ]
    sdk = SdkPausedConsumer("slow-sdk-paused", port)
    everyone = [*consumers, sdk]
    last_version: dict[bytes, int] = {}
    written = {"writes": 0, "bytes": 0, "refused": 0}
    phases = [
        dict.fromkeys(("rss", "anon", "file", "ckpt", "backfill", "samples"), 0) for _ in range(2)
    ]
    dropped_seen: dict[str, int] = {}
    names = [b"slow%06d" % i for i in range(keys)]
    version = 0

    async def write(kv: KvClient, duration: float) -> None:
        nonlocal version
        end = time.monotonic() + duration
        while time.monotonic() < end:
            version += 1
            batch = rng.sample(names, min(500, len(names)))
            pairs = [(k, k + b"|%d|" % version + b"v" * value_bytes) for k in batch]
            try:
                await kv.set_many(pairs)
            except Exception as exc:  # e.g. ETMPFAIL retried past the timeout
                written["refused"] += 1
                findings.append(f"writes failed: {exc!r}"[:300])
                continue
            for k, _ in pairs:
                last_version[k] = version
            written["writes"] += len(pairs)
            written["bytes"] += len(pairs) * (value_bytes + 20)

    async def sample(ph: dict[str, int], done: trio.Event) -> None:
        c = await RawClient.connect(port)
        try:
            while not done.is_set():
                ph["rss"] = max(ph["rss"], server.rss())
                anon, file = _rss_parts(server.pid)
                ph["anon"] = max(ph["anon"], anon)
                ph["file"] = max(ph["file"], file)
                st = await c.stats("")
                ph["ckpt"] = max(ph["ckpt"], int(st["ep_checkpoint_memory"]))
                buffered = 0
                for k, v in (await c.stats("dcp-streams")).items():
                    if k.startswith("stream:"):
                        js = json.loads(v)
                        buffered += int(js.get("backfill_buffered_bytes", 0))
                        if js.get("cursor_dropped") or js.get("cursor_drops"):
                            name = js.get("connection", "")
                            dropped_seen[name] = dropped_seen.get(name, 0) + 1
                ph["backfill"] = max(ph["backfill"], buffered)
                ph["samples"] += 1
                await trio.sleep(0.2)
        finally:
            await c.aclose()

    async with (
        trio.open_nursery() as nursery,
        KvClient(HOST, port, num_vbuckets=num_vbuckets, timeout=60.0) as kv,
    ):
        for i, ph in enumerate(phases):
            if i == 1:
                for c in everyone:
                    await nursery.start(c.run)
            done = trio.Event()
            nursery.start_soon(sample, ph, done)
            await write(kv, seconds / 2)
            done.set()
        # ---- the slow consumers must have lost their cursors
        streams = await _stats(port, "dcp-streams")
        general = await _stats(port, "")
        ckpt = await _stats(port, "checkpoint")
        ckpt_drops = sum(
            1 for k, v in ckpt.items() if k.endswith(":cursor_drops") and v.isdigit() and int(v) > 0
        )
        drops: dict[str, int] = {}
        for k, v in streams.items():
            if not k.startswith("stream:"):
                continue
            js = json.loads(v)
            name = js.get("connection", "")
            drops[name] = (
                drops.get(name, 0) + int(js.get("cursor_drops", 0)) + bool(js.get("cursor_dropped"))
            )
        for c in everyone:
            if not drops.get(c.name) and not dropped_seen.get(c.name):
                findings.append(
                    f"{c.name}: no cursor was dropped (dcp-streams: {drops.get(c.name)})"
                )
        # ---- resume and receive everything
        for c in everyone:
            c.resumed.set()
        target = {vb: h for vb, (h, _u, _p) in (await vb_seqnos(port)).items()}
        deadline = time.monotonic() + resume_timeout
        while time.monotonic() < deadline:
            if all(c.got.end.get(vb, 0) >= h for c in everyone for vb, h in target.items() if h):
                break
            await trio.sleep(0.2)
        nursery.cancel_scope.cancel()

    by_vb: dict[int, dict[bytes, int]] = {}
    for k, v in last_version.items():
        by_vb.setdefault(codec.vbucket_for_key(k, num_vbuckets), {})[k] = v
    per: dict[str, Any] = {}
    for c in everyone:
        g = c.got
        findings += g.problems
        if c.error:
            findings.append(f"{c.name}: {c.error}")
        missing = 0
        stale = 0
        for vb, want in by_vb.items():
            have = g.latest.get(vb, {})
            for k, v in want.items():
                h = have.get(k)
                if h is None:
                    missing += 1
                elif h[1] != v:
                    stale += 1
            if g.end.get(vb, 0) < target.get(vb, 0):
                findings.append(
                    f"{c.name} vb {vb}: ended at {g.end.get(vb, 0)}, server at {target[vb]}"
                )
        if missing or stale:
            findings.append(
                f"{c.name}: {missing} keys never received, {stale} not at their last version"
            )
        if not g.disk_snapshots:
            findings.append(f"{c.name}: never got a disk snapshot (no backfill after the drop)")
        per[c.name] = {
            "items": g.items,
            "disk_snapshots": g.disk_snapshots,
            "cursor_drops": drops.get(c.name, 0),
            "samples_with_cursor_dropped": dropped_seen.get(c.name, 0),
            "missing": missing,
            "stale": stale,
        }
    # The server refuses writes above max(2 x quota, quota + 64 MiB) of checkpoint memory
    # (what is pinned there is unpersisted); one pipelined batch may land on top.
    ckpt_bound = max(2 * quota, quota + (64 << 20)) + (8 << 20)
    ckpt_max = max(ph["ckpt"] for ph in phases)
    if ckpt_max > ckpt_bound:
        findings.append(
            f"checkpoint memory peaked at {ckpt_max >> 20} MiB, bound {ckpt_bound >> 20} MiB"
        )
    ingest, slow = phases
    added = slow["anon"] - ingest["anon"]
    if added > overhead_mib << 20:
        findings.append(
            f"slow consumers added {added >> 20} MiB of server heap (anonymous RSS "
            f"{ingest['anon'] >> 20} -> {slow['anon'] >> 20} MiB), more than the "
            f"fixed {overhead_mib} MiB allowed; buffered backfill peaked at "
            f"{slow['backfill'] >> 20} MiB over {num_vbuckets} vbuckets x 3 "
            f"consumers"
        )
    crashes = 0 if server.alive() else 1
    tracebacks = [f"server traceback: {t}" for t in server.crash_signatures()]
    await server.terminate()
    return {
        "scenario": "slow",
        "seed": seed,
        "seconds": seconds,
        "quota_mib": quota_mib,
        "num_vbuckets": num_vbuckets,
        "keys": keys,
        "value_bytes": value_bytes,
        "writes": written["writes"],
        "written_mib": written["bytes"] >> 20,
        "write_batches_refused": written["refused"],
        "baseline_anon_rss_mib": baseline_rss >> 20,
        "ingest_anon_max_mib": ingest["anon"] >> 20,
        "slow_phase_anon_max_mib": slow["anon"] >> 20,
        "slow_consumers_added_mib": added >> 20,
        "allowed_overhead_mib": overhead_mib,
        "rss_max_mib": max(ph["rss"] for ph in phases) >> 20,
        "rss_file_max_mib": max(ph["file"] for ph in phases) >> 20,
        "backfill_buffered_max_mib": round(slow["backfill"] / 2**20, 1),
        "checkpoint_memory_max_mib": round(ckpt_max / 2**20, 1),
        "checkpoint_memory_bound_mib": ckpt_bound >> 20,
        "samples": ingest["samples"] + slow["samples"],
        "ep_cursors_dropped": general.get("ep_cursors_dropped"),
        "stat_checkpoint_streams_with_cursor_drops": ckpt_drops,
        "consumers": per,
        "crashes": crashes + len(tracebacks),
        "divergences": len(findings),
        "findings": (findings + tracebacks)[:100],
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
