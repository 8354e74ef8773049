"""A durable write is answered by its deadline even when persistence cannot proceed
(docs/operations.md, "Connection limits and output memory").

The deadline is the timeout of the durability frame info (u16 ms after the level; 0 =
the default) or ``durability_timeout``. Past it the answer is SYNC_WRITE_AMBIGUOUS (the
write may still become durable), ETMPFAIL for a client that did not negotiate XERROR,
and the answers queued behind it follow at once.
"""

from __future__ import annotations

from pathlib import Path

import trio

from dcp.protocol import DurabilityLevel, HelloFeature, Opcode, Status, codec

from .conftest import client_of, running_server
from .wire import WireClient, keys_for_vb


def _durable_set(client: WireClient, key: bytes, timeout_ms: int | None) -> tuple[int, bytes]:
    op = next(client.opaques)
    return op, codec.request(
        Opcode.SET,
        vbucket=client.vb(key),
        opaque=op,
        extras=codec.store_extras(0, 0),
        key=key,
        value=b"durable",
        framing_extras=codec.durability_frame_info(DurabilityLevel.PERSIST_TO_MAJORITY, timeout_ms),
    )


async def test_a_durable_write_with_a_1000_ms_timeout_is_answered_ambiguous_in_time(
    tmp_path: Path,
) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as client:
        await client.hello([HelloFeature.XERROR, HelloFeature.MUTATION_SEQNO])
        server.pause_persistence()  # persistence cannot proceed
        k1, k2 = keys_for_vb(1, 2, 4)
        op, frame = _durable_set(client, k1, 1000)
        noop_op = next(client.opaques)
        t0 = trio.current_time()
        # a pipelined NOOP behind the durable write
        await client.send(frame + codec.request(Opcode.NOOP, opaque=noop_op))
        r = await client.next_frame(5)
        waited = trio.current_time() - t0
        assert r.opaque == op and r.status == Status.SYNC_WRITE_AMBIGUOUS, r
        assert 0.9 <= waited <= 1.5, waited  # the bound the server promises: +0.5 s
        assert b"durability timeout" in bytes(r.value)
        n = await client.next_frame(1)
        assert n.opaque == noop_op and n.status == Status.SUCCESS
        # later requests on the same connection are answered at once
        assert (await client.set(k2, b"plain")).status == Status.SUCCESS
        assert bytes((await client.get(k1)).value) == b"durable"  # ambiguous: it was applied
        assert server.metrics.durable_timeouts == 1
        assert (await client.stats())["durable_write_timeouts"] == "1"
        server.resume_persistence()
        op, frame = _durable_set(client, k1, 1000)
        r = await client.call(frame, op)
        assert r.status == Status.SUCCESS


async def test_without_xerror_the_timeout_is_etmpfail_and_the_default_applies(
    tmp_path: Path,
) -> None:
    """No timeout in the frame info: ``durability_timeout`` (here 0.8 s) applies, and a
    client that did not ask for extended errors gets ETMPFAIL."""
    async with (
        running_server(tmp_path / "d", durability_timeout=0.8) as server,
        client_of(server) as client,
    ):
        server.pause_persistence()
        (k,) = keys_for_vb(2, 1, 4)
        for timeout_ms in (None, 0):  # no timeout, and 0 = the default
            op, frame = _durable_set(client, k, timeout_ms)
            t0 = trio.current_time()
            r = await client.call(frame, op, timeout=5)
            assert r.status == Status.ETMPFAIL, r
            assert 0.7 <= trio.current_time() - t0 <= 0.8 + 1.5  # a loaded CI's slack


async def test_a_later_durable_write_with_a_shorter_timeout_waits_only_for_the_first(
    tmp_path: Path,
) -> None:
    """Answers stay in order: the second write (0.3 s) is answered right after the first
    (1 s) times out, not after its own deadline and not later."""
    async with running_server(tmp_path / "d") as server, client_of(server) as client:
        await client.hello([HelloFeature.XERROR])
        server.pause_persistence()
        k1, k2 = keys_for_vb(0, 2, 4)
        op1, f1 = _durable_set(client, k1, 1000)
        op2, f2 = _durable_set(client, k2, 300)
        t0 = trio.current_time()
        await client.send(f1 + f2)
        r1 = await client.next_frame(5)
        r2 = await client.next_frame(1)
        assert [r1.opaque, r2.opaque] == [op1, op2]
        assert r1.status == r2.status == Status.SYNC_WRITE_AMBIGUOUS
        assert trio.current_time() - t0 <= 1.0 + 1.5  # the first deadline + slack


async def test_a_durable_write_persisted_before_its_deadline_succeeds(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as client:
        await client.hello([HelloFeature.XERROR])
        server.pause_persistence()
        (k,) = keys_for_vb(3, 1, 4)
        op, frame = _durable_set(client, k, 3000)
        await client.send(frame)
        assert not await client.frames_for(0.3)
        server.resume_persistence()
        r = await client.next_frame(3)
        assert r.opaque == op and r.status == Status.SUCCESS
        assert server.metrics.durable_timeouts == 0


async def test_the_reserved_timeout_0xffff_is_refused(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as client:
        (k,) = keys_for_vb(3, 1, 4)
        op, frame = _durable_set(client, k, 0xFFFF)
        r = await client.call(frame, op)
        assert r.status == Status.DURABILITY_INVALID_LEVEL
        assert (await client.get(k)).status == Status.KEY_ENOENT


async def test_a_durable_write_accepted_as_the_disk_fills_is_answered_by_its_deadline(
    tmp_path: Path,
) -> None:
    """The flusher's commits fail (a full map, simulated as the storage tests do) after
    the write was accepted: the old server never answered it; now it is ambiguous at
    its deadline, and the plain request pipelined behind it is answered too."""
    import lmdb

    async with running_server(tmp_path / "d") as server, client_of(server) as client:
        await client.hello([HelloFeature.XERROR])
        k1, k2 = keys_for_vb(1, 2, 4)

        def full(_batch: object) -> None:
            raise lmdb.MapFullError("simulated: map full")

        server.bucket.storage.before_commit = full
        try:
            op, frame = _durable_set(client, k1, 1000)
            get_op = next(client.opaques)
            t0 = trio.current_time()
            await client.send(
                frame + codec.request(Opcode.GET, vbucket=client.vb(k2), opaque=get_op, key=k2)
            )
            r = await client.next_frame(5)
            assert r.opaque == op and r.status == Status.SYNC_WRITE_AMBIGUOUS, r
            assert trio.current_time() - t0 <= 1.0 + 1.5  # the first deadline + slack
            g = await client.next_frame(1)
            assert g.opaque == get_op and g.status == Status.KEY_ENOENT
            assert server.storage_error  # the failure was real, not a pause
        finally:
            server.bucket.storage.before_commit = None
