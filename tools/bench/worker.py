"""Client side of the benchmark: one role per process, driven by ``python -m tools.bench``.

Run as ``python tools/bench/worker.py ROLE '{json params}'``. A worker prints JSON lines
(``{"event": "ready"|"registered"|"result"|"error", ...}``) on stdout and reads commands
(``{"cmd": "go"|"resume"}``) from stdin. Timing, CPU (``process_time``) and peak RSS
are measured here, around the measured phase only.

Rules of this file:
- Keys are 16 bytes (``key-%012d``), values ``value_size`` bytes (100 by default) whose
  first 16 bytes are the write's sequence number, so consumers can check what they got.
- Every loop is bounded: by an item count and by the ``timeout`` parameter.
- ``memory`` consumers register their streams, report ``registered`` and then block the
  whole process on stdin (the event loop does not run, nothing is read from the socket)
  until ``go``: the items written meanwhile wait in the server's checkpoints.
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time
from typing import Any

# ---------------------------------------------------------------------- helpers


def emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def read_cmd() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("stdin closed")
    return json.loads(line)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def key_of(i: int) -> bytes:
    return b"key-%012d" % i


def value_of(j: int, size: int) -> bytes:
    v = b"%016d" % j
    return v + b"x" * (size - 16) if size > 16 else v[:size]


def batches(p: dict[str, Any]):
    """(key, value) lists of ``p['batch']`` writes: write j goes to key j % keys."""
    n, b, keys, size = p["items"], p["batch"], p.get("keys") or p["items"], p["value_size"]
    start = p.get("start", 0)
    for i in range(start, start + n, b):
        yield [(key_of(j % keys), value_of(j, size)) for j in range(i, min(start + n, i + b))]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "p999": 0.0, "max": 0.0, "mean": 0.0}
    s = sorted(values)
    n = len(s)

    def q(f: float) -> float:
        return s[min(n - 1, int(f * n))]

    return {"p50": q(0.50), "p99": q(0.99), "p999": q(0.999), "max": s[-1], "mean": sum(s) / n}


class Meter:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.c0 = time.process_time()

    def result(self, **data: Any) -> dict[str, Any]:
        return {
            "seconds": time.perf_counter() - self.t0,
            "client_cpu_s": time.process_time() - self.c0,
            "client_peak_rss": peak_rss(),
            **data,
        }


# ---------------------------------------------------------------------- our SDK


async def _registered(clients: list[Any], nvb: int, timeout: float) -> None:
    """Wait until every client's streams are accepted by the server (bench-only look at
    the connection's stream table)."""
    import trio

    from dcp.consumer.snapshot_buffer import StreamState

    with trio.fail_after(timeout):
        while True:
            ok = 0
            for c in clients:
                conn = c._conn
                if (
                    conn is not None
                    and len(conn._streams) == nvb
                    and all(st.state == StreamState.STREAMING for st in conn._streams.values())
                ):
                    ok += 1
            if ok == len(clients):
                return
            await trio.sleep(0.02)


async def _drain(client: Any, expect: int, out: list[int]) -> None:
    """Consume whole snapshots until ``expect`` mutations arrived (touching every value)."""
    n = 0
    nbytes = 0
    async for batch in client:
        for e in batch.events:
            nbytes += len(e.value)
        n += len(batch.events)
        if n >= expect:
            break
    out.append(n)


async def ours_consumer(p: dict[str, Any]) -> None:
    import contextlib

    import trio

    from dcp.consumer import DcpClient

    port, nvb, expect = p["port"], p["vbuckets"], p["expect"]
    timeout = p["timeout"]
    if p["mode"] == "disk":
        emit("ready")
        await trio.to_thread.run_sync(read_cmd)
        m = Meter()
        counts: list[int] = []
        with trio.fail_after(timeout):
            async with DcpClient("127.0.0.1", port, to_latest=True, name="bench-disk") as client:
                await _drain(client, expect, counts)
        emit("result", **m.result(counts=counts))
        return
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(DcpClient("127.0.0.1", port, name=f"bench-{i}"))
            for i in range(p["clients"])
        ]
        await _registered(clients, nvb, timeout)
        emit("registered")
        read_cmd()  # blocks the event loop on purpose: see the module rules
        m = Meter()
        counts = []
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                for c in clients:
                    nursery.start_soon(_drain, c, expect, counts)
        emit("result", **m.result(counts=counts))


async def ours_writer(p: dict[str, Any]) -> None:
    import trio

    from dcp.consumer import KvClient

    async with KvClient(
        "127.0.0.1", p["port"], num_vbuckets=p["vbuckets"], timeout=p["timeout"]
    ) as kv:
        emit("ready")
        await trio.to_thread.run_sync(read_cmd)
        m = Meter()
        n = 0
        last = None
        with trio.fail_after(p["timeout"]):
            for batch in batches(p):
                res = await kv.set_many(batch)
                n += len(res)
                last = res[-1]
        emit("result", **m.result(count=n, last_seqno=last.seqno if last else 0))


async def ours_slow_consumer(p: dict[str, Any]) -> None:
    """Registers, stalls (no iteration: flow control stops the server) until ``resume``,
    then consumes until every key shows its final value."""
    import trio

    from dcp.consumer import DcpClient

    items, keys = p["items"], p["keys"]
    nkeys = min(items, keys)
    final = {key_of(k): k + keys * ((items - 1 - k) // keys) for k in range(nkeys)}
    async with DcpClient("127.0.0.1", p["port"], name="bench-stalled") as client:
        await _registered([client], p["vbuckets"], p["timeout"])
        emit("registered")
        await trio.to_thread.run_sync(read_cmd)
        m = Meter()
        seen: dict[bytes, int] = {}
        events = 0
        regressions = 0
        done = 0
        with trio.fail_after(p["timeout"]):
            async for batch in client:
                for e in batch.events:
                    j = int(e.value[:16])
                    k = e.key
                    old = seen.get(k, -1)
                    if j < old:
                        regressions += 1
                    seen[k] = j
                    if j == final.get(k) and old != j:
                        done += 1
                events += len(batch.events)
                if done >= nkeys:
                    break
        wrong = sum(1 for k, j in final.items() if seen.get(k) != j)
        emit(
            "result",
            **m.result(
                events=events,
                keys_seen=len(seen),
                keys_final=done,
                keys_expected=nkeys,
                wrong_last_values=wrong,
                regressions=regressions,
            ),
        )


async def ours_latency(p: dict[str, Any]) -> None:
    """Writes at ``rate``/s for ``seconds`` (KvClient) while a DcpClient in the same
    process records when each write is delivered. ``dcp_port`` (default ``port``): the
    server the DcpClient streams from (the replication scenario: the replica)."""
    import trio

    from dcp.consumer import DcpClient, KvClient

    rate, seconds, size = p["rate"], p["seconds"], p["value_size"]
    total = int(rate * seconds)
    sent = [0.0] * total
    acked = [0.0] * total
    delivered = [0.0] * total
    got = 0
    perf = time.perf_counter

    async def consume(client: Any, done: trio.Event) -> None:
        nonlocal got
        async for batch in client:
            t = perf()
            for e in batch.events:
                j = int(e.value[:16])
                if not delivered[j]:
                    delivered[j] = t
                    got += 1
            if got >= total:
                break
        done.set()

    async with (
        KvClient("127.0.0.1", p["port"], num_vbuckets=p["vbuckets"]) as kv,
        DcpClient("127.0.0.1", p.get("dcp_port", p["port"]), name="bench-latency") as client,
    ):
        await _registered([client], p["vbuckets"], p["timeout"])
        emit("ready")
        await trio.to_thread.run_sync(read_cmd)
        m = Meter()
        done = trio.Event()
        with trio.fail_after(seconds + p["timeout"]):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, client, done)
                t0 = perf()
                j = 0
                tick = 0.001
                while j < total:
                    due = min(total, int((perf() - t0) * rate) + 1)
                    if due > j:
                        batch = [(key_of(i), value_of(i, size)) for i in range(j, due)]
                        ts = perf()
                        await kv.set_many(batch)
                        ta = perf()
                        for i in range(j, due):
                            sent[i] = ts
                            acked[i] = ta
                        j = due
                    nxt = t0 + (j / rate)
                    await trio.sleep(max(0.0, min(tick, nxt - perf())))
                write_s = perf() - t0
                with trio.move_on_after(p["timeout"]):
                    await done.wait()
                nursery.cancel_scope.cancel()
    _latency_result(m, total, sent, acked, delivered, write_s)


def _latency_result(
    m: Meter,
    total: int,
    sent: list[float],
    acked: list[float],
    delivered: list[float],
    write_s: float,
) -> None:
    # A write delivered before its writer saw the ack counts as 0 (and is counted).
    early = sum(1 for i in range(total) if delivered[i] and delivered[i] < acked[i])
    ack_d = [max(0.0, delivered[i] - acked[i]) * 1e3 for i in range(total) if delivered[i]]
    e2e = [(delivered[i] - sent[i]) * 1e3 for i in range(total) if delivered[i]]
    write = [(acked[i] - sent[i]) * 1e3 for i in range(total) if acked[i]]
    emit(
        "result",
        **m.result(
            count=total,
            delivered=sum(1 for d in delivered if d),
            write_seconds=write_s,
            achieved_rate=total / write_s,
            ack_to_delivery_ms=percentiles(ack_d),
            send_to_delivery_ms=percentiles(e2e),
            write_ack_ms=percentiles(write),
            delivered_before_ack=early,
        ),
    )


# ---------------------------------------------------------------------- redis


def _redis(port: int) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=port)


def _parser() -> str:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:  # pragma: no cover
        return "?"
    return "hiredis" if HIREDIS_AVAILABLE else "python"


def _xread_entries(resp: Any) -> list:
    if not resp:
        return []
    if isinstance(resp, dict):  # RESP3
        (entries,) = resp.values()
        return entries[0] if entries and isinstance(entries[0], list) else entries
    return resp[0][1]  # RESP2: [[stream, entries]]


def redis_writer(p: dict[str, Any]) -> None:
    r = _redis(p["port"])
    r.ping()
    emit("ready", parser=_parser())
    read_cmd()
    m = Meter()
    n = 0
    deadline = time.monotonic() + p["timeout"]
    for batch in batches(p):
        pipe = r.pipeline(transaction=False)
        for _k, v in batch:
            pipe.xadd("bench", {"v": v})
        n += len(pipe.execute())
        if time.monotonic() > deadline:
            raise TimeoutError("redis writer timed out")
    emit("result", **m.result(count=n, parser=_parser()))


def redis_reader(p: dict[str, Any]) -> None:
    """``readers`` connections each XREAD COUNT ``count`` the whole stream, round robin."""
    conns = [_redis(p["port"]) for _ in range(p["clients"])]
    for c in conns:
        c.ping()
    emit("ready", parser=_parser())
    read_cmd()
    m = Meter()
    expect = p["expect"]
    last = [b"0-0"] * len(conns)
    counts = [0] * len(conns)
    nbytes = 0
    deadline = time.monotonic() + p["timeout"]
    active = list(range(len(conns)))
    while active:
        for i in list(active):
            entries = _xread_entries(conns[i].xread({"bench": last[i]}, count=p["count"]))
            for _id, fields in entries:
                nbytes += len(fields[b"v"])
            if entries:
                counts[i] += len(entries)
                last[i] = entries[-1][0]
            if counts[i] >= expect:
                active.remove(i)
        if time.monotonic() > deadline:
            raise TimeoutError("redis reader timed out")
    emit("result", **m.result(counts=counts, parser=_parser()))


def redis_latency(p: dict[str, Any]) -> None:
    rate, seconds, size = p["rate"], p["seconds"], p["value_size"]
    total = int(rate * seconds)
    sent = [0.0] * total
    acked = [0.0] * total
    delivered = [0.0] * total
    perf = time.perf_counter
    reader = _redis(p["port"])
    writer = _redis(p["port"])
    reader.ping()
    writer.ping()
    emit("ready", parser=_parser())
    read_cmd()
    m = Meter()
    finished = threading.Event()

    def read() -> None:
        last = b"0-0"
        got = 0
        deadline = time.monotonic() + seconds + p["timeout"]
        while got < total and time.monotonic() < deadline:
            entries = _xread_entries(reader.xread({"lat": last}, count=1000, block=500))
            t = perf()
            for eid, fields in entries:
                j = int(fields[b"v"][:16])
                if not delivered[j]:
                    delivered[j] = t
                    got += 1
                last = eid
        finished.set()

    th = threading.Thread(target=read, daemon=True)
    th.start()
    t0 = perf()
    j = 0
    while j < total:
        due = min(total, int((perf() - t0) * rate) + 1)
        if due > j:
            pipe = writer.pipeline(transaction=False)
            for i in range(j, due):
                pipe.xadd("lat", {"v": value_of(i, size)})
            ts = perf()
            pipe.execute()
            ta = perf()
            for i in range(j, due):
                sent[i] = ts
                acked[i] = ta
            j = due
        nxt = t0 + j / rate
        time.sleep(max(0.0, min(0.001, nxt - perf())))
    write_s = perf() - t0
    finished.wait(p["timeout"])
    _latency_result(m, total, sent, acked, delivered, write_s)


# ---------------------------------------------------------------------- ceiling


def ceiling_recv(p: dict[str, Any]) -> None:
    """Frame (and with ``decode``: unpack header + extras, slice key and value of) every
    message of a blocking socket, 256 KiB reads; time from the first byte.

    Its layouts are spelled here on purpose, not taken from ``dcp.protocol.layout``: the
    ceiling is what a bare receiver owing nothing to our code reaches, and this worker
    also runs against older checkouts (``--code-root``) that have no layout module."""
    import socket
    import struct

    n_expect = p["expect"]
    decode = p["decode"]
    bodylen = struct.Struct(">I").unpack_from
    hdr = struct.Struct(">BBHBBHIIQQQIIIHB").unpack_from
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(p["timeout"])
    emit("ready", port=srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.settimeout(p["timeout"])
    rest = b""
    n = 0
    m = None
    nbytes = 0
    while n < n_expect:
        data = conn.recv(262144)
        if not data:
            break
        if m is None:
            m = Meter()
        if rest:
            data = rest + data
        o = 0
        end_all = len(data)
        if decode:
            while end_all - o >= 24:
                end = o + 24 + bodylen(data, o + 8)[0]
                if end > end_all:
                    break
                (
                    _mg,
                    _op,
                    kl,
                    _el,
                    _dt,
                    _vb,
                    _bl,
                    _oq,
                    _cas,
                    _seq,
                    _rev,
                    _fl,
                    _ex,
                    _lk,
                    _nm,
                    _nru,
                ) = hdr(data, o)
                _key = data[o + 55 : o + 55 + kl]
                nbytes += len(data[o + 55 + kl : end])
                n += 1
                o = end
        else:
            while end_all - o >= 24:
                end = o + 24 + bodylen(data, o + 8)[0]
                if end > end_all:
                    break
                _frame = data[o:end]
                n += 1
                o = end
        rest = data[o:]
    assert m is not None
    emit("result", **m.result(count=n))


def ceiling_send(p: dict[str, Any]) -> None:
    import socket

    from dcp.protocol import codec

    n = p["expect"]
    value = b"v" * p["value_size"]
    frame = codec.mutation(0, 1, 1, 1, key_of(0), value, cas=1)
    blob = frame * n  # pre-encoded: the sender does no work per message
    sock = socket.create_connection(("127.0.0.1", p["port"]), timeout=p["timeout"])
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    emit("ready", frame_bytes=len(frame))
    read_cmd()
    view = memoryview(blob)
    step = 262144
    for i in range(0, len(blob), step):
        sock.sendall(view[i : i + step])
    sock.close()
    emit("result", count=n)


# ---------------------------------------------------------------------- main

ROLES = {
    "ours-consumer": ours_consumer,
    "ours-writer": ours_writer,
    "ours-slow-consumer": ours_slow_consumer,
    "ours-latency": ours_latency,
    "redis-writer": redis_writer,
    "redis-reader": redis_reader,
    "redis-latency": redis_latency,
    "ceiling-recv": ceiling_recv,
    "ceiling-send": ceiling_send,
}


def main() -> None:
    import gc
    import inspect

    role, params = sys.argv[1], json.loads(sys.argv[2])
    if params.get("gc_threshold"):
        gc.set_threshold(*params["gc_threshold"])
    fn = ROLES[role]
    try:
        if inspect.iscoroutinefunction(fn):
            import trio

            trio.run(fn, params)
        else:
            fn(params)
    except BaseException as exc:  # report, then exit non-zero
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        emit("error", error=f"{type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    main()
