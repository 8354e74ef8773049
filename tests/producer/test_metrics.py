"""The Prometheus endpoint (``--metrics-port``): scraped over a raw socket while the
server takes writes, streams, backfills, answers a rollback and drops a cursor."""

from __future__ import annotations

import socket
from pathlib import Path

import trio
from prometheus_client.parser import text_string_to_metric_families

from dcp.producer.metrics import MAX_METRICS_CONNECTIONS
from dcp.producer.server import DcpServer, ServerConfig
from dcp.protocol import DcpOpenFlag, Opcode, Status, codec

from .wire import WireClient, keys_for_vb

NVB = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _get(port: int, request: bytes) -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = await _get(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def m(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _config(tmp_path: Path, **kw: object) -> ServerConfig:
    return ServerConfig(
        port=0, data_dir=str(tmp_path / "data"), num_vbuckets=NVB, metrics_port=_free_port(), **kw
    )  # type: ignore[arg-type]


async def _dcp(server: DcpServer, name: str) -> WireClient:
    c = await WireClient.connect(server.port, NVB)
    assert (await c.dcp_open(name, DcpOpenFlag.PRODUCER)).status == Status.SUCCESS
    return c


async def test_metrics_follow_writes_streams_backfills_and_rollbacks(tmp_path: Path) -> None:
    cfg = _config(tmp_path, checkpoint_retain_seconds=0)  # persisted -> freed -> backfill
    async with DcpServer(cfg) as server:
        port = server.metrics_port
        assert port == cfg.metrics_port
        kv = await WireClient.connect(server.port, NVB)
        keys0 = keys_for_vb(0, 10, NVB)
        for k in keys0:
            await kv.set(k, b"v" * 100)
        assert (await kv.get(keys0[0])).status == Status.SUCCESS
        assert (await kv.get(keys0[1])).status == Status.SUCCESS
        assert (await kv.delete(keys0[0])).status == Status.SUCCESS
        s = await scrape(port)
        assert m(s, "dcp_ops_total", op="set") == 10
        assert m(s, "dcp_ops_total", op="get") == 2
        assert m(s, "dcp_ops_total", op="delete") == 1
        assert m(s, "dcp_items_queued_total") == 11  # sum of high seqnos
        assert m(s, "dcp_checkpoint_memory_bytes") > 0
        assert m(s, "dcp_checkpoint_memory_quota_bytes") == cfg.checkpoint_memory_quota
        assert m(s, "dcp_connections", type="kv") == 1
        assert m(s, "dcp_connections", type="dcp") == 0
        assert m(s, "dcp_connections_accepted_total") == 1

        server.pause_persistence()
        await kv.set(keys_for_vb(3, 1, NVB)[0], b"late")
        s = await scrape(port)
        assert m(s, "dcp_flusher_lag_items") >= 1 and m(s, "dcp_flusher_queue_items") >= 1
        server.resume_persistence()
        await server.flush_all()
        s = await scrape(port)
        assert m(s, "dcp_items_persisted_total") == 12 == m(s, "dcp_items_queued_total")
        assert m(s, "dcp_flusher_lag_items") == 0 and m(s, "dcp_flusher_queue_items") == 0
        assert m(s, "dcp_flushes_total") >= 1 and m(s, "dcp_flush_errors_total") == 0
        assert 11 <= m(s, "dcp_flusher_items_written_total") <= 12
        sent_before = m(s, "dcp_bytes_sent_total")
        assert sent_before > 0  # responses count too

        # an in-memory stream, and a rollback answer for a uuid the server never had
        live = await _dcp(server, "live")
        assert (await live.stream_req(0)).status == Status.SUCCESS
        await live.read_stream_until(lambda f: f.opcode == Opcode.DCP_DELETION)
        r = await live.stream_req(1, start=5, uuid=12345)
        assert r.status == Status.ROLLBACK
        s = await scrape(port)
        assert m(s, "dcp_rollbacks_answered_total") == 1
        assert m(s, "dcp_streams", phase="in-memory") == 1
        assert m(s, "dcp_streams", phase="backfilling") == 0
        assert m(s, "dcp_connections", type="dcp") == 1
        assert m(s, "dcp_bytes_sent_total") > sent_before
        assert m(s, "dcp_backfills_started_total") == 0

        # memory no longer holds vb 0 from seqno 1: a new stream backfills from disk
        op = next(kv.opaques)
        await kv.call(codec.request(Opcode.GET_ALL_VB_SEQNOS, opaque=op), op)  # closes ckpts
        await server.flush_all()
        assert server.bucket.vbucket(0).checkpoints.memory_start_seqno > 1
        disk = await _dcp(server, "disk")
        assert (await disk.stream_req(0, end=11)).status == Status.SUCCESS
        await disk.read_stream_until(lambda f: f.opcode == Opcode.DCP_STREAM_END)
        s = await scrape(port)
        assert m(s, "dcp_backfills_started_total") == 1
        assert m(s, "dcp_backfills_completed_total") == 1
        assert m(s, "dcp_connections", type="dcp") == 2
        for c in (kv, live, disk):
            await c.aclose()


async def test_dropped_cursors_stay_counted_after_their_stream_is_gone(tmp_path: Path) -> None:
    cfg = _config(tmp_path, checkpoint_memory_quota=100_000, checkpoint_max_items=20)
    async with DcpServer(cfg) as server:
        slow = await _dcp(server, "slow")
        assert (await slow.control("connection_buffer_size", "2048")).status == Status.SUCCESS
        assert (await slow.stream_req(2)).status == Status.SUCCESS
        kv = await WireClient.connect(server.port, NVB)
        await kv.set_many([(k, b"x" * 5000) for k in keys_for_vb(2, 600, NVB)])
        with trio.fail_after(10):
            while server.bucket.cursors_dropped == 0:
                await trio.sleep(0.02)
        s = await scrape(server.metrics_port)
        assert m(s, "dcp_cursors_dropped_total") >= 1
        dropped = m(s, "dcp_cursors_dropped_total")
        await slow.aclose()  # the stream that lost its cursor ends with its connection
        with trio.fail_after(5):
            while server.streams():
                await trio.sleep(0.02)
        s = await scrape(server.metrics_port)
        assert m(s, "dcp_cursors_dropped_total") == dropped  # a counter never goes down
        assert m(s, "dcp_streams", phase="in-memory") == 0
        await kv.aclose()


async def test_retained_checkpoint_memory_is_reported_then_freed(tmp_path: Path) -> None:
    cfg = _config(tmp_path, checkpoint_retain_seconds=0.3)
    async with DcpServer(cfg) as server:
        kv = await WireClient.connect(server.port, NVB)
        await kv.set_many([(k, b"x" * 100) for k in keys_for_vb(1, 50, NVB)])
        server.bucket.vbucket(1).checkpoints.create_checkpoint()
        await server.flush_all()
        s = await scrape(server.metrics_port)
        retained = m(s, "dcp_checkpoint_retained_bytes")
        assert retained > 50 * 100 and retained <= m(s, "dcp_checkpoint_memory_bytes")
        assert int((await kv.stats())["ep_checkpoint_memory_retained"]) == retained
        with trio.fail_after(5):  # housekeeping frees it once its time is up
            while m(await scrape(server.metrics_port), "dcp_checkpoint_retained_bytes"):
                await trio.sleep(0.05)
        await kv.aclose()


async def test_only_get_metrics_is_served(tmp_path: Path) -> None:
    async with DcpServer(_config(tmp_path)) as server:
        port = server.metrics_port
        status, body = await _get(port, b"GET /other HTTP/1.1\r\n\r\n")
        assert (status, body) == (404, b"not found\n")
        assert (await _get(port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 404
        assert (await _get(port, b"GET / HTTP/1.0\r\n\r\n"))[0] == 404
        status, body = await _get(port, b"GET /metrics?x=1 HTTP/1.1\r\n\r\n")
        assert status == 200 and b"# TYPE dcp_ops_total counter" in body


async def test_metrics_are_off_unless_a_port_is_given(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=str(tmp_path / "data"), num_vbuckets=NVB)
    async with DcpServer(cfg) as server:
        assert cfg.metrics_port == 0 and server.metrics_port == 0


async def test_metrics_connections_beyond_the_limit_are_closed_at_once(tmp_path: Path) -> None:
    """Silent connections hold scrape slots (5 s each); past ``MAX_METRICS_CONNECTIONS``
    a new one is closed at accept, and a scrape works again once the others go."""
    async with DcpServer(_config(tmp_path)) as server:
        port = server.metrics_port
        idle = [
            await trio.open_tcp_stream("127.0.0.1", port) for _ in range(MAX_METRICS_CONNECTIONS)
        ]
        await trio.sleep(0.2)  # all accepted and waiting for a request
        extra = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(2):  # closed without an answer, well before the 5 s
            try:
                assert await extra.receive_some(1024) == b""
            except trio.BrokenResourceError:
                pass
        await extra.aclose()
        for s in idle:
            await s.aclose()
        await trio.sleep(0.2)
        status, _ = await _get(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert status == 200
