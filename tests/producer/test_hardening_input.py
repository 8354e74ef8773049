"""Input memory is bounded server-wide (docs/operations.md, "Connection limits and output
memory").

Each connection may buffer most of one frame of up to ``max_item_size`` + 4 KiB while it
arrives; thousands of clients each sending most of a big frame would hold gigabytes for
the whole partial-frame timeout. Buffered input counts against ``total_output_cap`` with
unsent output: the connections holding the most are closed first.
"""

from __future__ import annotations

from pathlib import Path

import trio

from dcp.protocol import Opcode, codec

from .hardening_support import ServerProcess, open_hog, rss_bytes
from .wire import WireClient

MiB = 1 << 20


def _partial_set(i: int, sent: int) -> bytes:
    """The first ``sent`` bytes of an 8 MiB SET request (header checked, body awaited)."""
    key = b"big-%d" % i
    frame = codec.request(
        Opcode.SET,
        opaque=i,
        extras=codec.store_extras(0, 0),
        key=key,
        value=bytes(8 * MiB - 8 - len(key)),
    )
    return frame[:sent]


async def test_connections_holding_the_most_partial_input_are_closed_and_rss_is_bounded(
    tmp_path: Path,
) -> None:
    """48 clients each send 2..5 MiB of an 8 MiB SET and stop (168 MiB in all; the old
    server held every byte, for the 30 s partial-frame timeout). With a 16 MiB
    ``total_output_cap`` the biggest holders are closed, with a log line and a count; the
    smallest ones and a neighbour are left alone, and RSS grows by about the cap."""
    total_cap = 16 * MiB
    bound = total_cap + 48 * MiB  # the cap, the reads in flight, the allocator's slack
    sizes = [2 * MiB + i * 64 * 1024 for i in range(48)]
    srv = ServerProcess(
        tmp_path / "d", "--connection-output-cap", str(MiB), "--total-output-cap", str(total_cap)
    )
    await srv.start()
    hogs: list[trio.SocketStream] = []
    try:
        neighbour = await WireClient.connect(srv.port, 8)
        await neighbour.stats()
        await trio.sleep(0.3)
        base = rss_bytes(srv.pid)
        peak = 0
        for i, size in enumerate(sizes):
            hog = await open_hog(srv.port, rcvbuf=None)
            hogs.append(hog)
            try:
                await hog.send_all(_partial_set(i, size))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # closed by the server while sending: one of the biggest holders
            peak = max(peak, rss_bytes(srv.pid) - base)
        await trio.sleep(1.0)  # the server has read everything sent
        peak = max(peak, rss_bytes(srv.pid) - base)
        assert peak <= bound, f"RSS grew by {peak / MiB:.0f} MiB (bound {bound / MiB:.0f})"
        closed = []
        for i, hog in enumerate(hogs):
            with trio.move_on_after(0.2):
                try:
                    if await hog.receive_some(4096) == b"":
                        closed.append(i)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    closed.append(i)
        # at most 7 of the smallest (>= 2 MiB each) fit in 16 MiB with the one arriving
        assert len(closed) >= len(sizes) - 7, closed
        assert 0 not in closed and 1 not in closed, "the smallest holders were closed"
        st = await neighbour.stats()
        assert int(st["conns_closed_output_memory"]) == len(closed)
        shed_lines = [
            x
            for x in srv.log().splitlines()
            if "(unsent output + buffered input) is over total_output_cap=" in x
        ]
        assert len(shed_lines) == len(closed), shed_lines[:3]
        print(f"RSS growth {peak / MiB:.0f} MiB, {len(closed)} of {len(sizes)} closed")
    finally:
        for hog in hogs:
            await hog.aclose()
        srv.stop()
