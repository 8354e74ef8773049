"""Only a user with ``replicate`` may speak for a replica node: the DCP control
``consumer_name`` and DCP_SEQNO_ACKNOWLEDGED (0x61) need it (gate.py), because a
replica's ack releases MAJORITY writes and every change consumer holds ``stream``.
Without a users file nothing is checked (tests/producer/test_seqno_ack.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from dcp.producer.auth import add_user
from dcp.producer.server import DcpServer
from dcp.protocol import (
    DcpOpenFlag,
    DurabilityLevel,
    HelloFeature,
    Opcode,
    Status,
    StreamRequestFlag,
    codec,
)
from tests.producer.wire import WireClient, keys_for_vb

from .conftest import ITERATIONS, auth_server, logged_in, request_status, write_users

NVB = 4
VB = 1
USERS = {
    "u_stream": ["stream"],
    "u_repl": ["stream", "replicate"],
    "u_repl2": ["stream", "replicate"],
    "u_app": ["read", "write"],
}


@contextlib.asynccontextmanager
async def _two_copies(tmp_path: Path) -> AsyncIterator[tuple[DcpServer, Path]]:
    """An auth-on server whose map gives every vbucket the chain (this node, B)."""
    users = write_users(tmp_path / "users.toml", USERS)
    async with auth_server(tmp_path / "data", users) as server:
        server.durability.set_topology([("self", "B")] * NVB)
        yield server, users


async def _pending_majority_write(server: DcpServer, w: WireClient) -> int:
    """Send a MAJORITY write on ``VB`` (10 s timeout) and wait until it is applied; its
    answer is still due. Returns the request's opaque."""
    await w.hello([HelloFeature.XERROR, HelloFeature.MUTATION_SEQNO])
    (key,) = keys_for_vb(VB, 1, NVB)
    op = next(w.opaques)
    await w.send(
        codec.request(
            Opcode.SET,
            vbucket=VB,
            opaque=op,
            extras=codec.store_extras(0, 0),
            key=key,
            value=b"v",
            framing_extras=codec.durability_frame_info(DurabilityLevel.MAJORITY, 10_000),
        )
    )
    with trio.fail_after(5):
        while server.bucket.vbucket(VB).high_seqno < 1:
            await trio.sleep(0.01)
    return op


async def _dcp_open(c: WireClient, name: str = "replication:B") -> None:
    assert (await c.dcp_open(name, DcpOpenFlag.PRODUCER)).status == Status.SUCCESS


async def test_a_stream_only_user_cannot_pose_as_a_replica(tmp_path: Path) -> None:
    """The attack: name itself B, stream FROM_LATEST (its stream counts as having been
    sent everything up to the high seqno) and ack seqno 1. Each step is EACCESS and the
    MAJORITY write waits on."""
    async with _two_copies(tmp_path) as (server, _), logged_in(server, "u_app") as w:
        op = await _pending_majority_write(server, w)
        async with logged_in(server, "u_stream") as c:
            await _dcp_open(c)
            r = await c.control("consumer_name", "B")
            assert r.status == Status.EACCESS and b"'replicate'" in bytes(r.value)
            opaque = next(c.opaques)
            r = await c.stream_req(VB, flags=StreamRequestFlag.FROM_LATEST, opaque=opaque)
            assert r.status == Status.SUCCESS  # streaming itself is what `stream` allows
            status = await request_status(c, codec.seqno_acknowledged(VB, opaque, 1, 1), opaque)
            assert status == Status.EACCESS
            assert server.durability.majority_seqno(VB) == 0
            assert not [f for f in await w.frames_for(0.5) if f.opaque == op], "released"
            # the refused requests cost the connection nothing else
            assert (await c.control("enable_noop", "true")).status == Status.SUCCESS


async def test_a_replicate_users_ack_releases_the_write(tmp_path: Path) -> None:
    async with _two_copies(tmp_path) as (server, _), logged_in(server, "u_app") as w:
        op = await _pending_majority_write(server, w)
        async with logged_in(server, "u_repl") as c:
            await _dcp_open(c)
            assert (await c.control("consumer_name", "B")).status == Status.SUCCESS
            opaque = next(c.opaques)
            assert (await c.stream_req(VB, opaque=opaque)).status == Status.SUCCESS
            await c.read_stream_until(lambda f: f.opcode == Opcode.DCP_MUTATION, ack=True)
            await c.send(codec.seqno_acknowledged(VB, opaque, 1, 1))
            r = await w.next_frame(5)
            assert (r.opaque, r.status) == (op, Status.SUCCESS)
            assert server.durability.majority_seqno(VB) == 1


async def test_consumer_name_is_set_once_per_connection(tmp_path: Path) -> None:
    async with _two_copies(tmp_path) as (server, _), logged_in(server, "u_repl") as c:
        await _dcp_open(c)
        assert (await c.control("consumer_name", "B")).status == Status.SUCCESS
        assert (await c.control("consumer_name", "B")).status == Status.SUCCESS  # the same
        r = await c.control("consumer_name", "C")
        assert r.status == Status.EINVAL and b"already acknowledges as 'B'" in bytes(r.value)
        assert server.connections and all(
            conn.consumer_name in (None, "B") for conn in server.connections
        )


async def test_a_replica_that_loses_replicate_is_closed(tmp_path: Path) -> None:
    """A reload that takes ``replicate`` away closes a connection that set
    ``consumer_name`` (its acks must not stay); one that did not set it stays open."""
    async with _two_copies(tmp_path) as (server, users), logged_in(server, "u_repl") as c:
        async with logged_in(server, "u_repl2") as plain:
            await _dcp_open(c)
            await _dcp_open(plain, "a-consumer")  # another name: the same would replace c
            assert (await c.control("consumer_name", "B")).status == Status.SUCCESS
            for name in ("u_repl", "u_repl2"):
                add_user(users, name, ["stream"], f"pw-{name}", iterations=ITERATIONS)
            assert server.authenticator is not None and server.authenticator.reload()
            await c.wait_closed()
            assert (await plain.control("enable_noop", "true")).status == Status.SUCCESS
