"""What an unauthenticated or hostile peer can cost the server: bodies over 64 KiB before
login close the connection, an unauthenticated connection is closed after ``auth_timeout``
(NOOPs do not keep it), PLAIN derivations cannot take the worker threads the flusher
needs, failure lines are rate-limited, and a closed connection is freed without a full
garbage collection."""

from __future__ import annotations

import gc
import logging
import struct
import weakref
from pathlib import Path

import pytest
import trio

from dcp.producer.auth import PLAIN_DERIVATIONS, PRE_AUTH_MAX_BODY, add_user
from dcp.producer.config import ConfigError, ServerConfig
from dcp.protocol import Opcode, Status, codec

from .conftest import auth_server, connect, logged_in, password_of

HEADER = struct.Struct(">BBHBBHIIQ")


def set_header(body: int, opaque: int = 1) -> bytes:
    """A SET request's header announcing ``body`` bytes (8 of extras, 2 of key)."""
    return HEADER.pack(0x80, Opcode.SET, 2, 8, 0, 0, body, opaque, 0)


async def test_a_big_body_before_login_closes_without_being_read(server):
    async with connect(server) as c:
        await c.send(set_header(PRE_AUTH_MAX_BODY + 1))  # the body itself never comes
        f = await c.next_frame()
        assert f.status == Status.EINVAL
        await c.wait_closed(timeout=5)


async def test_a_body_at_the_limit_is_read_and_after_login_big_ones_are_fine(server):
    value = b"x" * (PRE_AUTH_MAX_BODY - 10)
    async with connect(server) as c:
        request = codec.request(
            Opcode.SET, vbucket=c.vb(b"k1"), opaque=3, extras=codec.store_extras(), key=b"k1"
        )
        big = codec.request(
            Opcode.SET,
            vbucket=c.vb(b"k1"),
            opaque=4,
            extras=codec.store_extras(),
            key=b"k1",
            value=value,
        )
        assert (await c.call(request, 3)).status == Status.EACCESS
        assert (await c.call(big, 4)).status == Status.EACCESS  # read and refused, not closed
    async with logged_in(server, "u_write") as c:
        r = await c.set(b"big", b"y" * (4 * PRE_AUTH_MAX_BODY))
        assert r.status == Status.SUCCESS


async def test_an_unauthenticated_connection_is_closed_after_auth_timeout(tmp_path, users_file):
    async with auth_server(tmp_path / "data", users_file, auth_timeout=0.6) as srv:
        async with connect(srv) as idle, logged_in(srv, "u_read") as ok:
            with trio.fail_after(10):
                while not idle.eof:  # NOOPs every 0.1 s do not keep it open
                    await idle.send(codec.request(Opcode.NOOP, opaque=1))
                    with trio.move_on_after(0.1):
                        await idle.wait_closed(timeout=100)
            assert (await ok.get(b"nothing")).status == Status.KEY_ENOENT  # still open


def test_auth_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="auth_timeout"):
        ServerConfig(auth_timeout=0).validate()


def test_replication_user_needs_a_password():
    with pytest.raises(ConfigError, match="replication_password"):
        ServerConfig(replication_user="repl").validate()
    ServerConfig(replication_user="repl", replication_password="pw").validate()


async def test_plain_logins_cannot_take_the_default_worker_threads(tmp_path: Path):
    """Many concurrent PLAIN logins (each a PBKDF2 derivation in a worker thread) use
    their own limiter: trio's default one, which the flusher and backfills use, keeps
    its threads, so a durable write is flushed while the logins wait."""
    users = tmp_path / "users.toml"
    add_user(users, "slow", ["all"], password_of("slow"), iterations=60_000)
    limiter = trio.to_thread.current_default_thread_limiter()
    most = 0
    async with auth_server(tmp_path / "data", users) as srv:
        done = 0

        async def login() -> None:
            nonlocal done
            async with connect(srv) as c:
                await c.send(codec.sasl_auth("PLAIN", b"\0slow\0wrong", 1))
                assert (await c.next_frame(timeout=120)).status == Status.AUTH_ERROR
            done += 1

        async def sample() -> None:
            nonlocal most
            while done < 45:
                most = max(most, limiter.borrowed_tokens)
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            for _ in range(45):
                nursery.start_soon(login)
            await trio.sleep(0.3)  # all of them are waiting for a derivation by now
            async with logged_in(srv, "slow", "SCRAM-SHA512") as c:  # SCRAM: no server PBKDF2
                assert (await c.set(b"k", b"v")).status == Status.SUCCESS
                start = trio.current_time()
                await srv.flush_all()
                flushed_in = trio.current_time() - start
    assert most <= 2, most  # the flusher's own thread at most, never the logins
    assert flushed_in < 5, flushed_in
    assert srv.authenticator is not None
    assert srv.authenticator.plain_limiter.total_tokens == PLAIN_DERIVATIONS


async def test_failure_lines_are_rate_limited(server, caplog):
    caplog.set_level(logging.INFO, logger="dcp.auth")
    for _ in range(4):
        async with connect(server) as c:
            for i in range(3):
                await c.send(codec.sasl_auth("PLAIN", b"\0u_read\0wrong", i))
                assert (await c.next_frame()).status == Status.AUTH_ERROR
            await c.wait_closed()
    failed = [r for r in caplog.records if "authentication failed" in r.getMessage()]
    assert len(failed) == 5, [r.getMessage() for r in failed]  # 12 failures, 5 lines


async def test_a_closed_connection_is_freed_without_a_full_collection(server):
    """The gate must not hold its connection in a reference cycle: with the collector
    off, the server's Connection object goes when the connection closes."""
    gc.collect()
    gc.disable()
    try:
        async with logged_in(server, "u_read") as c:
            await c.get(b"k")
            (conn,) = server.connections
            ref = weakref.ref(conn)
            del conn
        with trio.fail_after(5):
            while server.connections:
                await trio.sleep(0.01)
        await trio.sleep(0.05)
        assert ref() is None, gc.get_referrers(ref())
    finally:
        gc.enable()


async def test_a_removed_user_is_still_closed_through_the_weak_reference(server, users_file):
    """Reloading without the user closes its connection (the gate's weak reference to
    the connection still reaches it while it is open)."""
    from dcp.producer.auth import remove_user

    async with logged_in(server, "u_read") as c:
        assert remove_user(users_file, "u_read")
        assert server.authenticator is not None and server.authenticator.reload()
        await c.wait_closed()
    assert password_of("u_read")
