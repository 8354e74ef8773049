"""Connection limits (docs/operations.md, "Connection limits and output memory"):
partial-frame timeout, KV idle timeout, max_connections, accept under EMFILE, and GET's
extras check."""

from __future__ import annotations

import resource
import socket
from pathlib import Path

import trio

from dcp.protocol import Opcode, Status, codec

from .conftest import client_of, running_server
from .hardening_support import ServerProcess
from .wire import WireClient, keys_for_vb


async def test_a_slowloris_frame_is_closed_after_the_partial_frame_timeout(tmp_path: Path) -> None:
    """One byte every 0.2 s of a frame announcing 1000 body bytes: the old server kept
    the connection (and its buffer) forever. A client sending whole frames slowly is
    not affected."""
    async with running_server(tmp_path / "d", partial_frame_timeout=1.0) as server:
        slow_but_whole = await WireClient.connect(server.port)
        loris = await WireClient.connect(server.port)
        frame = codec.request(
            Opcode.SET, vbucket=0, opaque=7, extras=codec.store_extras(), key=b"k", value=b"v" * 991
        )
        t0 = trio.current_time()
        closed_after = None
        with trio.move_on_after(5):
            for i in range(len(frame) - 1):
                try:
                    await loris.send(frame[i : i + 1])
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    closed_after = trio.current_time() - t0
                    break
                if i % 2 == 0:
                    op = next(slow_but_whole.opaques)
                    r = await slow_but_whole.call(codec.request(Opcode.NOOP, opaque=op), op)
                    assert r.status == Status.SUCCESS
                await trio.sleep(0.2)
        if closed_after is None:  # our sends may still fit in buffers: look for EOF
            await loris.wait_closed(1.0)
            closed_after = trio.current_time() - t0
        assert 1.0 <= closed_after <= 3.0, closed_after  # + a 0.5 s timer tick + slack
        assert server.metrics.partial_frame_closed == 1
        st = await slow_but_whole.stats()
        assert st["conns_closed_partial_frame"] == "1"
        await slow_but_whole.aclose()
        await loris.aclose()


async def test_an_idle_kv_connection_is_closed_but_one_with_a_stream_is_not(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d", kv_idle_timeout=1.0) as server:
        t0 = trio.current_time()
        idle = await WireClient.connect(server.port)
        dcp = await WireClient.connect(server.port)
        assert (await dcp.dcp_open("idle-test")).status == Status.SUCCESS
        assert (await dcp.stream_req(0)).status == Status.SUCCESS
        await idle.wait_closed(5.0)
        assert 1.0 <= trio.current_time() - t0 <= 3.0  # + a 0.5 s timer tick + slack
        assert server.metrics.idle_closed == 1
        await trio.sleep(0.5)  # the streaming connection outlives the timeout
        assert (await dcp.stats())["conns_closed_idle"] == "1"
        await dcp.aclose()
        await idle.aclose()


async def test_connections_over_max_connections_are_refused_and_counted(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d", max_connections=2) as server:
        async with client_of(server) as a, client_of(server) as b:
            await a.stats()  # both are being served
            await b.stats()
            extra = await WireClient.connect(server.port)
            await extra.wait_closed(2.0)  # closed at once, no byte read or sent
            await extra.aclose()
            st = await a.stats()
            assert st["rejected_conns"] == "1" and st["curr_connections"] == "2"
            assert server.metrics.connections_refused == 1
        with trio.fail_after(2):
            while server.connections:
                await trio.sleep(0.01)
        async with client_of(server) as c:  # room again
            assert (await c.stats())["max_connections"] == "2"


async def test_get_with_extras_or_a_value_is_einval(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as client:
        (k,) = keys_for_vb(1, 1, 4)
        await client.set(k, b"v")
        for extras, value in ((b"\0\0\0\0", b""), (b"", b"x")):
            op = next(client.opaques)
            r = await client.call(
                codec.request(Opcode.GET, vbucket=1, opaque=op, key=k, extras=extras, value=value),
                op,
            )
            assert r.status == Status.EINVAL, r
        assert bytes((await client.get(k)).value) == b"v"  # the connection goes on


def _limit_fds(n: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


async def test_out_of_descriptors_at_accept_logs_once_backs_off_and_recovers(
    tmp_path: Path,
) -> None:
    """A real server with few descriptors: connections beyond them wait in the backlog;
    the server logs the condition once (not a traceback every 0.1 s) and serves them
    when descriptors free up."""
    srv = ServerProcess(tmp_path / "d", preexec_fn=lambda: _limit_fds(48))
    await srv.start()
    socks: list[socket.socket] = []
    try:
        for _ in range(60):
            socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        await trio.sleep(3.0)  # the server keeps failing to accept meanwhile
        log = srv.log()
        assert "Traceback" not in log, log[-3000:]
        assert log.count("cannot accept connections") == 1, log[-3000:]
        for s in socks:
            s.close()
        socks.clear()
        client = await WireClient.connect(srv.port, 8)
        with trio.fail_after(10):
            st = await client.stats()
        assert int(st["accept_errors"]) >= 1
        await client.aclose()
    finally:
        for s in socks:
            s.close()
        srv.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_the_metrics_port_out_of_descriptors_backs_off_and_logs_once(tmp_path: Path) -> None:
    """The metrics listener accepts with the same loop: out of descriptors it logs once
    (trio's serve_listeners logged a traceback every 0.1 s) and scrapes work again once
    descriptors free up."""
    mport = _free_port()
    srv = ServerProcess(
        tmp_path / "d", "--metrics-port", str(mport), preexec_fn=lambda: _limit_fds(48)
    )
    await srv.start()
    socks: list[socket.socket] = []
    try:
        for _ in range(60):  # every descriptor taken, the rest waits in the backlog
            socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        await trio.sleep(0.5)  # the server has taken what it can
        for _ in range(3):  # scrapers waiting on the metrics port
            socks.append(socket.create_connection(("127.0.0.1", mport), timeout=5))
        await trio.sleep(2.0)
        log = srv.log()
        assert "Traceback" not in log, log[-3000:]
        assert log.count("cannot accept metrics connections") == 1, log[-3000:]
        for s in socks:
            s.close()
        socks.clear()
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", mport)
            async with stream:
                await stream.send_all(b"GET /metrics HTTP/1.1\r\n\r\n")
                data = b""
                while chunk := await stream.receive_some(65536):
                    data += chunk
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        errors = [ln for ln in data.decode().splitlines() if ln.startswith("dcp_accept_errors")]
        assert errors and float(errors[0].split()[-1]) >= 1, errors
    finally:
        for s in socks:
            s.close()
        srv.stop()
