"""In-process micro-benchmarks of the per-item hot paths behind ``bench.py`` (no sockets).

Usage::

    .venv/bin/python -m tools.bench.micro.hotpath fill --items 1000000 --streams 1,4
    .venv/bin/python -m tools.bench.micro.hotpath set --items 200000
    .venv/bin/python -m tools.bench.micro.hotpath flush --items 200000
    .venv/bin/python -m tools.bench.micro.hotpath kvencode --items 200000

fill      a bucket holds N items in its checkpoints (written in random vbucket order, as
          a KV client does); S streams per vbucket (as S consumers) encode everything
          with ``ActiveStream.fill`` into 256 KiB buffers. Reports CPU us per item for the
          first stream and per extra stream (the fan-out cost).
set       pre-encoded SET requests (16-byte keys, 100-byte values, 1024 vbuckets) go
          through a real ``Connection`` (frame parsing, handlers, engine, responses) of
          an in-process server with persistence paused; CPU us per SET.
flush     N writes of new keys (random vbucket order), persisted every ``--batch``
          writes as the server's flusher does (``collect`` -> ``LmdbStorage.write_batch``
          -> ``complete``); then N/2 overwrites of stored keys (each flushed item also
          deletes the version it supersedes). CPU us per item of each step; no fsync
          unless ``--sync``. The server's batches are ~10 k items (~10 per vbucket).
kvencode  ``KvClient`` encoding of pipelined sets (what ``set_many`` does before the
          socket write), us per item.

CPU time is ``process_time`` of this process; GC thresholds as the server sets them.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def _key(i: int) -> bytes:
    return b"key-%012d" % i


def fill(args: argparse.Namespace) -> None:
    import random

    from dcp.producer.active_stream import ActiveStream, StreamOptions
    from dcp.producer.engine import Bucket, EngineConfig
    from dcp.protocol.buffer_log import BufferLog
    from dcp.protocol.codec import vbucket_for_key

    gc.set_threshold(100_000, 50, 100)
    nvb = args.vbuckets
    tmp = Path(tempfile.mkdtemp(prefix="bench-hot-"))
    seq = itertools.count(1)
    cfg = EngineConfig(num_vbuckets=nvb, checkpoint_memory_quota=1 << 40)
    bucket = Bucket.open(tmp / "data", cfg, clock=time.time, uuid_source=lambda: next(seq))
    try:
        keys = [_key(i) for i in range(args.items)]
        random.Random(1).shuffle(keys)
        value = b"v" * args.value_size
        for k in keys:
            bucket.set(vbucket_for_key(k, nvb), k, value)
        del keys
        for nstreams in args.streams:
            streams: list[Any] = []
            for s in range(nstreams):
                for vb in bucket.vbuckets:
                    st = ActiveStream(
                        name=f"c{s}:{vb.vbid}:{nstreams}",
                        vbucket=vb,
                        opaque=1000 + vb.vbid,
                        start_seqno=0,
                        end_seqno=2**64 - 1,
                        options=StreamOptions(),
                        on_backfill=lambda _s: None,
                    )
                    st.activate()
                    st.announced = True
                    streams.append(st)
            bl = BufferLog()
            c0 = time.process_time()
            total = 0
            for st in streams:
                more = True
                while more:
                    buf = bytearray()
                    more = st.fill(buf, bl, 256 * 1024)
                    total += len(buf)
                    if not buf:
                        break
            cpu = time.process_time() - c0
            n = sum(st.items_sent for st in streams)
            for st in streams:
                st.release()
            print(
                f"fill streams/vb={nstreams}: {n:,} items, {total / 2**20:.0f} MiB, "
                f"{cpu:.2f} s CPU -> {cpu / n * 1e6:.3f} us/item"
            )
    finally:
        bucket.close()
        shutil.rmtree(tmp, ignore_errors=True)


def set_path(args: argparse.Namespace) -> None:
    import trio

    from dcp.producer.config import ServerConfig
    from dcp.producer.connection import Connection
    from dcp.producer.server import open_server
    from dcp.protocol import codec
    from dcp.protocol.opcodes import HelloFeature, Opcode

    nvb = args.vbuckets
    value = b"v" * args.value_size
    reqs = bytearray(codec.hello("bench", [int(HelloFeature.MUTATION_SEQNO)], opaque=1))
    for i in range(args.items):
        k = _key(i)
        reqs += codec.request(
            Opcode.SET,
            vbucket=codec.vbucket_for_key(k, nvb),
            opaque=i + 2,
            extras=codec.store_extras(0, 0),
            key=k,
            value=value,
        )
    chunks = [bytes(reqs[i : i + 256 * 1024]) for i in range(0, len(reqs), 256 * 1024)]

    class FakeSocket:
        def getpeername(self) -> tuple[str, int]:
            return ("127.0.0.1", 1)

    class FakeStream:
        socket = FakeSocket()

        def __init__(self) -> None:
            self.i = 0
            self.out = 0

        async def receive_some(self, _n: int) -> bytes:
            await trio.lowlevel.checkpoint()
            if self.i < len(chunks):
                self.i += 1
                return chunks[self.i - 1]
            await trio.sleep(0.2)  # let the writer send the last answers
            return b""

        async def send_all(self, data: Any) -> None:
            self.out += len(data)
            await trio.lowlevel.checkpoint()

        async def aclose(self) -> None:
            pass

    async def main(argv: list[str] | None = None) -> None:
        tmp = tempfile.mkdtemp(prefix="bench-hot-")
        cfg = ServerConfig(port=0, data_dir=tmp, num_vbuckets=nvb)
        try:
            async with open_server(cfg) as server:
                server.pause_persistence()
                gc.set_threshold(100_000, 50, 100)
                stream = FakeStream()
                conn = Connection(server, stream)  # type: ignore[arg-type]
                c0 = time.process_time()
                await conn.run()
                cpu = time.process_time() - c0 - 0.0
                print(
                    f"set: {args.items:,} SETs, {stream.out:,} response bytes, {cpu:.2f} s CPU "
                    f"-> {cpu / args.items * 1e6:.3f} us/SET (includes a 0.2 s idle tail)"
                )
                server.resume_persistence()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    trio.run(main)


def flush(args: argparse.Namespace) -> None:
    import random

    from dcp.producer.engine import Bucket, EngineConfig
    from dcp.protocol.codec import vbucket_for_key

    gc.set_threshold(100_000, 50, 100)
    nvb = args.vbuckets
    tmp = Path(tempfile.mkdtemp(prefix="bench-hot-"))
    seq = itertools.count(1)
    cfg = EngineConfig(
        num_vbuckets=nvb, checkpoint_memory_quota=1 << 40, lmdb_sync=args.sync, map_size=16 << 30
    )
    bucket = Bucket.open(tmp / "data", cfg, clock=time.time, uuid_source=lambda: next(seq))
    try:
        keys = [_key(i) for i in range(args.items)]
        random.Random(1).shuffle(keys)
        value = b"v" * args.value_size
        routed = [(vbucket_for_key(k, nvb), k) for k in keys]
        flusher = bucket.flusher
        storage = bucket.storage
        for phase, writes in (("new keys", routed), ("overwrites", routed[::2])):
            cpu = {"collect": 0.0, "write_batch": 0.0, "complete": 0.0}
            n = 0
            wall = 0.0
            for i in range(0, len(writes), args.batch):
                for vb, k in writes[i : i + args.batch]:
                    bucket.set(vb, k, value)
                w0 = time.perf_counter()
                while True:
                    c0 = time.process_time()
                    batch = flusher.collect(args.batch)
                    c1 = time.process_time()
                    cpu["collect"] += c1 - c0
                    if batch is None:
                        break
                    storage.write_batch(batch)
                    c2 = time.process_time()
                    flusher.complete(batch)
                    c3 = time.process_time()
                    cpu["write_batch"] += c2 - c1
                    cpu["complete"] += c3 - c2
                    n += batch.num_items
                wall += time.perf_counter() - w0
            total = sum(cpu.values())
            print(
                f"flush {phase}: {n:,} items in batches of {args.batch:,}: "
                f"{total / n * 1e6:.3f} us/item CPU ("
                + ", ".join(f"{k} {v / n * 1e6:.3f}" for k, v in cpu.items())
                + f"), wall {wall / n * 1e6:.3f} us/item, sync={args.sync}"
            )
    finally:
        bucket.close()
        shutil.rmtree(tmp, ignore_errors=True)


def kvencode(args: argparse.Namespace) -> None:
    from dcp.consumer.kv import KvClient

    kv = KvClient("127.0.0.1", 1, num_vbuckets=args.vbuckets)
    value = b"v" * args.value_size
    pairs = [(_key(i), value) for i in range(args.items)]
    c0 = time.process_time()
    for i in range(0, len(pairs), 1000):
        ops = kv._set_ops(pairs[i : i + 1000], 0, 0)
        buf = bytearray()
        for j, op in enumerate(ops):
            p = len(buf)
            buf += op.frame
            buf[p + 12 : p + 16] = (j + 1).to_bytes(4, "big")
    cpu = time.process_time() - c0
    print(f"kvencode: {args.items:,} sets -> {cpu / args.items * 1e6:.3f} us/item")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench.micro.hotpath", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("what", choices=["fill", "set", "flush", "kvencode"])
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--vbuckets", type=int, default=1024)
    p.add_argument("--value-size", type=int, default=100)
    p.add_argument("--batch", type=int, default=10_000, help="flush: items per batch")
    p.add_argument("--sync", action="store_true", help="flush: fsync at each commit")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    args = p.parse_args(argv)
    {"fill": fill, "set": set_path, "flush": flush, "kvencode": kvencode}[args.what](args)


if __name__ == "__main__":
    main()
