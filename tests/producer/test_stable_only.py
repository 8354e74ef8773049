"""Stable-only streams (control ``stable_only``): the producer's gating, over the wire.

A stand-in monitor (``FakeDurability``) sits at ``server.durability`` so each test moves
the stable seqno itself; test_stable_only_node.py runs the same gating against the
server's own monitor (stable = persisted seqno on a single node).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dcp.protocol import (
    Opcode,
    SnapshotMarkerFlag,
    Status,
    StreamEndStatus,
    StreamRequestFlag,
    codec,
)

from .conftest import client_of, running_server
from .wire import WireClient, items_of, keys_for_vb, markers_of


class FakeDurability:
    """The calls a stable-only stream makes of ``server.durability``."""

    def __init__(self) -> None:
        self.stable: dict[int, int] = {}
        self.waits: list[tuple[int, int, Callable[[], None]]] = []
        self.registered = 0

    def stable_seqno(self, vb: int) -> int:
        return self.stable.get(vb, 0)

    def wait_stable(self, vb: int, seqno: int, wake: Callable[[], None]) -> None:
        self.registered += 1
        self.waits.append((vb, seqno, wake))

    def cancel_wait(self, vb: int, wake: Callable[[], None]) -> int:
        gone = [w for w in self.waits if w[0] == vb and w[2] == wake]
        self.waits = [w for w in self.waits if w not in gone]
        return len(gone)

    def advance(self, vb: int, seqno: int) -> None:
        """Move vb's stable seqno and call the callbacks now due (as the monitor does)."""
        self.stable[vb] = seqno
        due = [w for w in self.waits if w[0] == vb and w[1] <= seqno]
        self.waits = [w for w in self.waits if w not in due]
        for _, _, wake in due:
            wake()


def is_end(f) -> bool:  # type: ignore[no-untyped-def]
    return f.opcode == Opcode.DCP_STREAM_END


def data_seqnos(frames: list) -> list[int]:  # type: ignore[type-arg]
    return [s for _, s, _, _ in items_of(frames)]


async def open_dcp(c: WireClient, name: str, *, stable_only: bool) -> None:
    assert (await c.dcp_open(name)).status == Status.SUCCESS
    if stable_only:
        assert (await c.control("stable_only", "true")).status == Status.SUCCESS


async def quiet(c: WireClient, seconds: float = 0.4) -> list:  # type: ignore[type-arg]
    """Stream frames arriving within ``seconds`` (noops answered, not returned)."""
    out = []
    for f in await c.frames_for(seconds):
        if f.opcode == Opcode.DCP_NOOP and not f.is_response:
            await c.send(codec.response(Opcode.DCP_NOOP, opaque=f.opaque))
        else:
            out.append(f)
    return out


async def test_a_stable_only_stream_waits_for_each_whole_snapshot_a_normal_one_does_not(
    tmp_path: Path,
) -> None:
    async with running_server(tmp_path / "d") as server:
        fake = server.durability = FakeDurability()
        keys = keys_for_vb(1, 6, 4)
        async with client_of(server) as kv, client_of(server) as so, client_of(server) as nm:
            await kv.set_many([(k, b"a") for k in keys[:3]])
            await open_dcp(so, "t-stable", stable_only=True)
            await open_dcp(nm, "t-normal", stable_only=False)
            assert (await so.stream_req(1)).status == Status.SUCCESS
            assert (await nm.stream_req(1)).status == Status.SUCCESS
            normal = await nm.read_stream_until(
                lambda f: bool(items_of([f])) and data_seqnos([f]) == [3]
            )
            assert data_seqnos(normal) == [1, 2, 3]  # not held by its neighbour's gate
            assert await quiet(so) == []  # stable is 0: not even the marker
            await kv.set_many([(k, b"b") for k in keys[3:]])  # woken again, still held
            assert await quiet(so) == []
            assert fake.registered == 1  # one wait, not one per fill call

            fake.advance(1, 2)  # the held snapshot [1, 3] is not stable yet
            assert await quiet(so) == []
            fake.advance(1, 3)  # now it is: exactly that snapshot, whole
            got = await so.read_stream_until(lambda f: data_seqnos([f]) == [3])
            got += await quiet(so)
            assert [(s, e) for s, e, _ in markers_of(got)] == [(1, 3)]
            assert data_seqnos(got) == [1, 2, 3]

            fake.advance(1, 6)  # the rest, in snapshots that end at or below 6
            got = await so.read_stream_until(lambda f: data_seqnos([f]) == [6])
            assert data_seqnos(got) == [4, 5, 6]
            assert all(e <= 6 for _, e, _ in markers_of(got))


async def test_a_stable_only_stream_with_an_end_ends_ok_once_stable_reaches_it(
    tmp_path: Path,
) -> None:
    async with running_server(tmp_path / "d") as server:
        fake = server.durability = FakeDurability()
        keys = keys_for_vb(2, 4, 4)
        async with client_of(server) as kv, client_of(server) as so:
            await kv.set_many([(k, b"x") for k in keys])
            await open_dcp(so, "t-latest", stable_only=True)
            assert (await so.stream_req(2, flags=StreamRequestFlag.TO_LATEST)).status == 0
            fake.advance(2, 3)
            assert await quiet(so) == []  # the snapshot ends at 4
            fake.advance(2, 4)
            frames = await so.read_stream_until(is_end)
            assert data_seqnos(frames) == [1, 2, 3, 4]
            assert codec.parse_stream_end(frames[-1]) == StreamEndStatus.OK


async def test_a_disk_snapshot_is_held_too(tmp_path: Path) -> None:
    keys = keys_for_vb(3, 5, 4)
    async with running_server(tmp_path / "d") as server, client_of(server) as kv:
        await kv.set_many([(k, b"disk") for k in keys])
    async with running_server(tmp_path / "d") as server:  # nothing in memory: a backfill
        fake = server.durability = FakeDurability()
        async with client_of(server) as so:
            await open_dcp(so, "t-disk", stable_only=True)
            assert (await so.stream_req(3, end=5)).status == Status.SUCCESS
            fake.advance(3, 4)
            assert await quiet(so) == []
            assert server.streams_of(3)[0].backfills == 1
            fake.advance(3, 5)
            frames = await so.read_stream_until(is_end)
            ((start, end, flags),) = markers_of(frames)
            assert (start, end) == (1, 5) and flags & SnapshotMarkerFlag.DISK
            assert data_seqnos(frames) == [1, 2, 3, 4, 5]
            assert codec.parse_stream_end(frames[-1]) == StreamEndStatus.OK


async def test_the_control_is_refused_for_a_value_other_than_true_or_false(server, client) -> None:
    await client.dcp_open("t-bad")
    r = await client.control("stable_only", "maybe")
    assert r.status == Status.EINVAL
    assert (await client.control("stable_only", "false")).status == Status.SUCCESS
