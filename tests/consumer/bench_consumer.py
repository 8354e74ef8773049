"""Benchmark: mutations/s a DcpClient consumes from memory over loopback.

Run: ``.venv/bin/python tests/consumer/bench_consumer.py [items] [vbuckets] [snapshot]``
(not a test: pytest does not collect it). A separate process plays a minimal producer
with plain blocking sockets and pre-encoded frames (64 KiB writes), so the number
measures the consumer: decoding, snapshot assembly, batch hand-off, flow-control acks.
"""

from __future__ import annotations

import multiprocessing
import socket
import sys
import time

ITEM_VALUE = b"v" * 79  # 150-byte messages with 16-byte keys, as tools.bench uses


def _producer(port_q, items: int, vbuckets: int, snap: int) -> None:
    from dcp.protocol import codec
    from dcp.protocol.frames import FrameReader
    from dcp.protocol.opcodes import Opcode

    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = FrameReader()
    opaques: dict[int, int] = {}
    while len(opaques) < vbuckets:
        reader.feed(conn.recv(65536))
        out = bytearray()
        for f in reader.read_frames():
            if f.opcode == Opcode.DCP_STREAM_REQ:
                opaques[f.vbucket] = f.opaque
                out += codec.response(
                    f.opcode, opaque=f.opaque, value=codec.failover_log_value([(1234, 0)])
                )
            elif f.opcode == Opcode.GET_ALL_VB_SEQNOS:
                pairs = [(vb, items // vbuckets) for vb in range(vbuckets)]
                out += codec.response(
                    f.opcode, opaque=f.opaque, value=codec.all_vb_seqnos_value(pairs)
                )
            elif f.magic == 0x80:
                out += codec.response(f.opcode, opaque=f.opaque)
        conn.sendall(out)
    per_vb = items // vbuckets
    buf = bytearray()
    seq = {vb: 0 for vb in range(vbuckets)}
    done = 0
    while done < per_vb * vbuckets:
        for vb in range(vbuckets):
            s = seq[vb]
            if s >= per_vb:
                continue
            n = min(snap, per_vb - s)
            opq = opaques[vb]
            buf += codec.snapshot_marker(vb, opq, s + 1, s + n, 1)
            for i in range(s + 1, s + n + 1):
                buf += codec.mutation(vb, opq, i, 1, b"key-%011d" % i, ITEM_VALUE, cas=i)
            seq[vb] = s + n
            done += n
            if len(buf) >= 65536:
                conn.sendall(buf)
                buf = bytearray()
    for vb in range(vbuckets):
        buf += codec.stream_end(vb, opaques[vb], 0)
    conn.sendall(buf)
    conn.settimeout(30)
    try:
        while conn.recv(65536):
            pass
    except OSError:
        pass


async def _consume(port: int, items: int, vbuckets: int) -> tuple[float, int, dict]:
    import trio

    from dcp.consumer import DcpClient

    n = 0
    async with DcpClient(
        "127.0.0.1",
        port,
        vbuckets=range(vbuckets),
        to_latest=True,
        noop_interval=None,
        buffer_size=20 * 1024 * 1024,
    ) as client:
        t0 = trio.current_time()
        while True:
            got = await client.getmany()
            if not got:
                break
            for b in got:
                n += len(b.events)
        elapsed = trio.current_time() - t0
        stats = client.statistics()
    return elapsed, n, stats


def main() -> None:
    import trio

    items = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    vbuckets = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    snap = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    q: multiprocessing.Queue = multiprocessing.Queue()
    proc = multiprocessing.Process(target=_producer, args=(q, items, vbuckets, snap))
    proc.start()
    port = q.get()
    cpu0 = time.process_time()
    elapsed, n, stats = trio.run(_consume, port, items, vbuckets)
    cpu = time.process_time() - cpu0
    proc.join(5)
    if proc.is_alive():
        proc.kill()
    print(
        f"{n} mutations, {vbuckets} vbuckets, snapshots of {snap}: {elapsed:.2f} s wall, "
        f"{cpu:.2f} s CPU -> {n / elapsed / 1e3:.0f} k/s wall, {n / cpu / 1e3:.0f} k/s per "
        f"CPU-second; batches={stats['batches']} acks={stats['buffer_acks']}"
    )


if __name__ == "__main__":
    main()
