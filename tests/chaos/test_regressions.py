"""Defects the reliability harness (``python -m tools.chaos``) found, one test each.

Each test reproduces its defect on a small scale, in-process, with the raw wire
(``tools.chaos.procs.RawClient``) so it fails on the server's behaviour alone. The scenario
that found it and the figures are in ``docs/reliability.md``.
"""

from __future__ import annotations

import trio

from dcp.producer.engine import StorageError
from dcp.protocol import codec
from dcp.protocol.frames import FrameReader
from dcp.protocol.opcodes import DcpOpenFlag, Opcode, Status
from tools.chaos.procs import RawClient

from .conftest import running_server


def _keys(vb: int, n: int, num_vbuckets: int, prefix: str = "r") -> list[bytes]:
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        k = f"{prefix}{i:06d}".encode()
        if codec.vbucket_for_key(k, num_vbuckets) == vb:
            out.append(k)
        i += 1
    return out


async def _set_all(c: RawClient, pairs: list[tuple[bytes, bytes]], num_vbuckets: int) -> None:
    buf = bytearray()
    ops = []
    for k, v in pairs:
        op = c.next_opaque()
        ops.append(op)
        buf += codec.request(
            Opcode.SET,
            vbucket=codec.vbucket_for_key(k, num_vbuckets),
            opaque=op,
            extras=codec.store_extras(0, 0),
            key=k,
            value=v,
        )
    await c.stream.send_all(bytes(buf))
    with trio.fail_after(30):
        for op in ops:
            while True:
                f = next((x for x in c.stash if x.is_response and x.opaque == op), None)
                if f is not None:
                    c.stash.remove(f)
                    assert f.status == Status.SUCCESS, f
                    break
                await c._fill()


class _DcpReader:
    """A raw DCP connection that acks only when told to."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.reader = FrameReader(max_body_size=64 << 20)
        self.unacked = 0
        self.seqnos: dict[int, int] = {}

    async def open(self, name: str, window: int, vbuckets: range) -> None:
        hs = codec.dcp_open(name, DcpOpenFlag.PRODUCER, 1)
        hs += codec.dcp_control("connection_buffer_size", str(window), 2)
        for vb in vbuckets:
            hs += codec.stream_request(vb, 100 + vb)
        await self.stream.send_all(hs)

    async def read_for(self, seconds: float, ack: bool) -> None:
        if ack and self.unacked:  # the window may be full: nothing arrives until we ack
            n, self.unacked = self.unacked, 0
            await self.stream.send_all(codec.buffer_ack(n))
        with trio.move_on_after(seconds):
            while True:
                data = await self.stream.receive_some(1 << 16)
                if not data:
                    return
                self.reader.feed(data)
                for f in self.reader.read_frames():
                    if f.is_response:
                        continue
                    if f.opcode != Opcode.DCP_NOOP:
                        self.unacked += f.size
                    if f.opcode == Opcode.DCP_MUTATION:
                        self.seqnos[f.vbucket] = codec.parse_mutation(f)[0]
                if ack and self.unacked:
                    n, self.unacked = self.unacked, 0
                    await self.stream.send_all(codec.buffer_ack(n))


async def test_stream_whose_dropped_cursor_is_placed_back_in_memory_keeps_sending(tmp_path) -> None:
    """Found by ``chaos.py slow`` (a stalled consumer stopped 26 items short of the high
    seqno for good). When memory pressure drops a stream's cursor and re-registering it
    finds the items still in memory (another cursor pins them), ``ActiveStream._refill``
    returns False after ``_cursor_dropped``; the writer then forgets the stream, which sends
    nothing more until the next write to its vbucket."""
    async with running_server(tmp_path / "d", num_vbuckets=1) as server:
        kv = await RawClient.connect(server.port)
        keys = _keys(0, 20, 1)
        await _set_all(kv, [(k, b"first" * 20) for k in keys[:10]], 1)
        consumer = _DcpReader(await trio.open_tcp_stream("127.0.0.1", server.port))
        await consumer.open("regression-drop", 300, range(1))
        await consumer.read_for(0.5, ack=False)  # the window fills, the stream stalls
        await _set_all(kv, [(k, b"second" * 20) for k in keys[10:]], 1)
        await server.flush_all()
        (stream,) = server.streams()
        # What Bucket._memory_pressure does to a slow stream's cursor:
        server.bucket.vbucket(0).checkpoints.drop_cursor(stream.cursor)
        assert stream.cursor.dropped
        await consumer.read_for(3.0, ack=True)  # resume: ack everything as it arrives
        high = server.bucket.vbucket(0).high_seqno
        assert high == 20
        assert consumer.seqnos.get(0) == high, (
            f"stream stalled at seqno {consumer.seqnos.get(0)} of {high} after its cursor was "
            f"dropped and re-registered in memory"
        )
        await kv.aclose()


async def test_stalled_consumer_buffers_a_bounded_amount_of_backfill_whatever_the_vbucket_count(
    tmp_path,
) -> None:
    """Found by ``chaos.py slow`` (3 slow consumers added 333 MiB of server heap with an
    8 MiB checkpoint quota; 123 MiB of it buffered backfill). The scan of each stream pauses
    at ``backfill_buffer_bytes``, but a scan that has read its whole range ends and frees
    its ``max_concurrent_backfills`` slot while its items stay buffered for a consumer that
    does not read them (``Backfills.run``): one stalled consumer of N vbuckets pins up
    to N x backfill_buffer_bytes, i.e. the data set, not a fixed budget."""
    nv = 32
    opts = dict(num_vbuckets=nv, backfill_buffer_bytes=256 * 1024, max_concurrent_backfills=2)
    async with running_server(tmp_path / "d", **opts) as server:
        kv = await RawClient.connect(server.port)
        pairs = [(k, b"v" * 300) for vb in range(nv) for k in _keys(vb, 200, nv)]
        await _set_all(kv, pairs, nv)  # ~2 MiB on disk, 64 KiB per vbucket
        await kv.aclose()
    async with running_server(tmp_path / "d", **opts) as server:  # nothing left in memory
        consumer = _DcpReader(await trio.open_tcp_stream("127.0.0.1", server.port))
        await consumer.open("regression-stalled", 64 * 1024, range(nv))
        await consumer.read_for(2.0, ack=False)  # never acks: the window stays full
        buffered = sum(s.backfill_bytes for s in server.streams())
        # Each running scan may overshoot its pause point by one chunk; only
        # max_concurrent_backfills scans run at once.
        budget = 2 * (256 * 1024 + 64 * 1024)
        assert buffered <= budget, (
            f"{buffered >> 10} KiB of backfill buffered for one stalled consumer "
            f"(budget {budget >> 10} KiB for 2 concurrent scans)"
        )


async def test_writes_acknowledged_before_the_map_filled_survive_a_graceful_restart_with_a_larger_map(  # noqa: E501
    tmp_path,
) -> None:
    """Found by ``chaos.py storage`` (4-25 acknowledged writes lost per run, and streaming
    consumers told to roll back). Writes acknowledged in memory between the last flush
    that fit and the first MDB_MAP_FULL stay queued; the documented remedy (stop, restart
    with a larger ``--map-size``) loses them: the graceful stop cannot flush them, writes
    no clean marker, exits 1, and warm-up starts a new branch below them."""
    acked: dict[bytes, bytes] = {}
    nv = 4
    stop_error = None
    try:
        async with running_server(tmp_path / "d", num_vbuckets=nv, map_size=2 << 20) as server:
            c = await RawClient.connect(server.port)
            for i in range(100_000):
                k = b"m%07d" % i
                v = b"%07d" % i + b"x" * 512
                r = await c.store(k, v, codec.vbucket_for_key(k, nv))
                if r.status != Status.SUCCESS:
                    assert r.status == Status.ETMPFAIL
                    break
                acked[k] = v
            await c.aclose()
            assert server.storage_error, "the map never filled"
    except* StorageError as eg:  # the graceful stop could not flush what was queued
        stop_error = eg.exceptions[0]
    async with running_server(tmp_path / "d", num_vbuckets=nv, map_size=64 << 20) as server:
        c = await RawClient.connect(server.port)
        lost = []
        for k, v in acked.items():
            g = await c.get(k, codec.vbucket_for_key(k, nv))
            if g.status != Status.SUCCESS or bytes(g.value) != v:
                lost.append(k)
        await c.aclose()
    assert not lost, (
        f"{len(lost)} of {len(acked)} acknowledged writes lost, e.g. {lost[:3]} "
        f"(the graceful stop failed with: {stop_error})"
    )


async def test_a_client_resetting_its_connection_while_the_server_writes_to_it_does_not_crash_the_server(  # noqa: E501
    tmp_path,
) -> None:
    """Found by ``chaos.py fuzz`` (the server exited 1 after 620 k frames). A connection
    whose client stops reading and then resets (RST) while the server is sending: the
    writer task's ``BrokenResourceError`` leaves ``Connection.run``'s nursery wrapped in
    an ``ExceptionGroup``, which ``except (trio.BrokenResourceError, ...)`` does not catch;
    it escapes ``serve_listeners`` and stops the whole server. (The reader never sees the
    reset: it stopped reading at ``connection_output_cap``.)"""
    crashed: list[BaseException] = []
    try:
        async with running_server(
            tmp_path / "d", num_vbuckets=1, connection_output_cap=1 << 20
        ) as server:
            kv = await RawClient.connect(server.port)
            key = b"big"
            assert (await kv.store(key, b"x" * (512 << 10), 0)).status == Status.SUCCESS
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", server.port))
            gets = b"".join(
                codec.request(Opcode.GET, vbucket=0, opaque=i, key=key) for i in range(64)
            )  # 32 MiB of answers nobody reads
            await sock.send(gets)
            await trio.sleep(0.5)
            sock.setsockopt(
                trio.socket.SOL_SOCKET,
                trio.socket.SO_LINGER,
                (1).to_bytes(4, "little") + (0).to_bytes(4, "little"),
            )
            sock.close()  # abortive close: RST
            await trio.sleep(0.5)
            r = await kv.get(key, 0)  # the server still serves everyone else
            assert r.status == Status.SUCCESS
            await kv.aclose()
    except BaseException as exc:  # the server's nursery died with the connection's error
        crashed.append(exc)
    assert not crashed, f"the server stopped: {crashed[0]!r}"
