"""Output memory is bounded against clients that never read (docs/operations.md,
"Connection limits and output memory").

A request whose answer is bigger than itself (a GET of a large value, a STAT group over
every vbucket) lets a client make the server hold far more than it sent. The server
stops processing a connection's input, frame by frame, while its unsent output is over
``connection_output_cap``, produces STAT groups in steps, and closes the connections
holding the most output when all of it goes over ``total_output_cap``. The RSS tests run
a real ``dcp-server`` process and sample /proc/PID/status while the client never reads.
"""

from __future__ import annotations

from pathlib import Path

import trio

from dcp.protocol import Opcode, Status, codec

from .conftest import client_of, running_server
from .hardening_support import ServerProcess, gets, open_hog, read_answers, rss_bytes, stats
from .wire import WireClient, keys_for_vb

MiB = 1 << 20


async def _noop_latency(client: WireClient) -> float:
    op = next(client.opaques)
    t0 = trio.current_time()
    r = await client.call(codec.request(Opcode.NOOP, opaque=op), op, timeout=10)
    assert r.status == Status.SUCCESS
    return trio.current_time() - t0


async def _watch(
    pid: int, base: int, bound: int, neighbour: WireClient, seconds: float
) -> tuple[int, float]:
    """Sample RSS growth and a neighbour's NOOP latency for ``seconds``; stop early once
    the growth is over ``bound`` (the old server would go on to gigabytes)."""
    peak = 0
    worst = 0.0
    deadline = trio.current_time() + seconds
    while trio.current_time() < deadline:
        worst = max(worst, await _noop_latency(neighbour))
        peak = max(peak, rss_bytes(pid) - base)
        if peak > bound:
            break
        await trio.sleep(0.1)
    return peak, worst


async def test_gets_of_a_large_value_never_read_keep_server_memory_near_the_cap(
    tmp_path: Path,
) -> None:
    """One 20 MiB value, then 100 GETs of it in one 2.4 KB write from a client that
    never reads: the old server queued every answer (2 GB). Now it holds about one
    answer; a neighbour is served meanwhile; the held GETs are answered once the client
    reads."""
    cap = 4 * MiB
    value_size = 20 * MiB - 4096
    # one answer being sent, the value as stored and as read, one answer being built,
    # plus the allocator's slack
    bound = cap + 4 * value_size + 48 * MiB
    srv = ServerProcess(
        tmp_path / "d", "--connection-output-cap", str(cap), "--total-output-cap", str(512 * MiB)
    )
    await srv.start()
    try:
        pid = srv.pid
        writer = await WireClient.connect(srv.port, 8)
        neighbour = await WireClient.connect(srv.port, 8)
        (key,) = keys_for_vb(5, 1, 8)
        await writer.set(key, b"v" * value_size)
        await writer.aclose()
        await trio.sleep(0.5)  # persisted; the SET's buffers freed
        base = rss_bytes(pid)
        hog = await open_hog(srv.port, rcvbuf=None)
        burst = gets(key, 5, 100)
        assert len(burst) < 3000
        await hog.send_all(burst)
        peak, worst = await _watch(pid, base, bound, neighbour, 4.0)
        assert peak <= bound, f"RSS grew by {peak / MiB:.0f} MiB (bound {bound / MiB:.0f})"
        assert worst < 1.0, f"a neighbour's NOOP waited {worst:.2f} s"
        # the requests were held, not dropped: reading lets the server go on with the GETs
        # it holds. Before the client read, at most ~3 answers existed (one queued, one
        # being sent, what the socket buffers take), so 10 answers mean it resumed; all
        # 100 (2 GB over loopback) would prove no more.
        with trio.fail_after(60):
            answers = await read_answers(hog, 10)
        assert all(
            op == Opcode.GET and st == Status.SUCCESS and body == value_size + 4
            for op, st, body in answers
        )
        await hog.aclose()
        await neighbour.aclose()
    finally:
        srv.stop()


async def test_a_stat_flood_never_read_is_bounded_and_does_not_stall_others(tmp_path: Path) -> None:
    """1000 ``STAT vbucket-seqno`` over 1024 vbuckets (37 KB of requests, ~300 MB of
    answers): the old server built them all at once (416 MB, every client stalled for
    seconds). Now a group is produced in steps, against the cap."""
    cap = 4 * MiB
    bound = cap + 48 * MiB
    srv = ServerProcess(
        tmp_path / "d",
        "--num-vbuckets",
        "1024",
        "--connection-output-cap",
        str(cap),
        "--total-output-cap",
        str(512 * MiB),
    )
    await srv.start()
    try:
        pid = srv.pid
        neighbour = await WireClient.connect(srv.port, 1024)
        await _noop_latency(neighbour)
        await trio.sleep(0.3)
        base = rss_bytes(pid)
        hog = await open_hog(srv.port)
        burst = stats("vbucket-seqno", 1000)
        assert len(burst) < 40_000
        await hog.send_all(burst)
        peak, worst = await _watch(pid, base, bound, neighbour, 4.0)
        assert peak <= bound, f"RSS grew by {peak / MiB:.0f} MiB (bound {bound / MiB:.0f})"
        assert worst < 1.0, f"a neighbour's NOOP waited {worst:.2f} s"
        # the hog's first group is whole and in order once it reads
        first = await read_answers(hog, 1024 * 4 + 1)
        assert all(op == Opcode.STAT and st == Status.SUCCESS for op, st, _ in first)
        await hog.aclose()
        assert (await neighbour.stats("vbucket-seqno 7"))["vb_7:high_seqno"] == "0"
        await neighbour.aclose()
    finally:
        srv.stop()


async def test_input_is_held_per_frame_at_the_cap_and_resumes_when_drained(tmp_path: Path) -> None:
    """In process: the reader stops between two frames of one read once the answers
    are over the cap (the old reader handled the whole read: 40 answers queued)."""
    cap = 2 * MiB
    async with running_server(tmp_path / "d", connection_output_cap=cap) as server:
        async with client_of(server) as c:
            (key,) = keys_for_vb(1, 1, 4)
            await c.set(key, b"v" * MiB)
        hog = await open_hog(server.port)
        await hog.send_all(gets(key, 1, 40))
        await trio.sleep(0.5)
        (conn,) = [x for x in server.connections]
        assert conn.frames_in < 20, f"{conn.frames_in} of 40 GETs handled"
        assert conn.unsent_bytes <= cap + MiB + 64
        answers = await read_answers(hog, 40)  # reading lets the rest through
        assert [st for _, st, _ in answers] == [Status.SUCCESS] * 40
        assert conn.frames_in == 40
        await hog.aclose()


async def test_over_the_total_output_cap_the_biggest_holders_are_closed(tmp_path: Path) -> None:
    """Three clients each hold an 8 MiB answer they never read (each over its own cap,
    24 MiB together): the server closes the biggest holders until the rest fit in
    12 MiB, and a neighbour holding little is left alone."""
    cap = MiB
    total = 12 * MiB
    async with running_server(
        tmp_path / "d", connection_output_cap=cap, total_output_cap=total
    ) as server:
        async with client_of(server) as c:
            (key,) = keys_for_vb(2, 1, 4)
            await c.set(key, b"v" * (8 * MiB))
            before = set(server.connections)
            hogs = [await open_hog(server.port) for _ in range(3)]
            with trio.fail_after(5):
                while len(server.connections) < len(before) + 3:
                    await trio.sleep(0.01)
            mine = [x for x in server.connections if x not in before]
            for h in hogs:
                await h.send_all(gets(key, 2, 4))
            with trio.fail_after(5):
                while server.metrics.connections_shed < 1:
                    await trio.sleep(0.05)
            await trio.sleep(0.5)
            assert server.output_bytes() <= total
            # the neighbour that reads is untouched and still served
            (small,) = keys_for_vb(3, 1, 4)
            await c.set(small, b"s")
            assert bytes((await c.get(small)).value) == b"s"
            assert not any(x.closed for x in before)
            st = await c.stats()
            assert int(st["conns_closed_output_memory"]) == server.metrics.connections_shed
            shed = [x for x in mine if x.closed]
            assert len(shed) == server.metrics.connections_shed
            assert all("memory over total_output_cap" in x.close_reason for x in shed)
            for h in hogs:
                await h.aclose()
