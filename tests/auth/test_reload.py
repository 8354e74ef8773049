"""Re-reading the users file (what SIGHUP does): new users and passwords for the next
login, new privileges at once for connected users, a removed user's connection closed,
a DCP connection that lost ``stream`` closed, and a bad file refused (old users kept)."""

from __future__ import annotations

import logging

from dcp.producer.auth import add_user, remove_user
from dcp.protocol import DcpOpenFlag, Opcode, Status

from .conftest import ITERATIONS, connect, logged_in, sasl


async def test_new_user_and_new_password_after_reload(server, users_file):
    add_user(users_file, "newbie", ["read"], "pw-newbie", iterations=ITERATIONS)
    async with connect(server) as c:
        assert (await sasl(c, "PLAIN", "newbie"))[-1].status == Status.AUTH_ERROR
    assert server.authenticator.reload()
    async with connect(server) as c:
        assert (await sasl(c, "SCRAM-SHA256", "newbie"))[-1].status == Status.SUCCESS
    add_user(users_file, "newbie", ["read"], "rotated", iterations=ITERATIONS)
    async with logged_in(server, "newbie", "SCRAM-SHA512") as old_session:
        assert server.authenticator.reload()
        # the session made with the old password goes on; new logins need the new one
        assert (await old_session.get(b"k")).status == Status.KEY_ENOENT
        async with connect(server) as c:
            assert (await sasl(c, "PLAIN", "newbie"))[-1].status == Status.AUTH_ERROR
            assert (await sasl(c, "PLAIN", "newbie", "rotated"))[-1].status == Status.SUCCESS


async def test_connected_users_get_their_new_privileges_at_once(server, users_file):
    async with logged_in(server, "u_read") as c:
        assert (await c.store(Opcode.SET, b"k", b"v")).status == Status.EACCESS
        add_user(users_file, "u_read", ["write"], "pw-u_read", iterations=ITERATIONS)
        assert server.authenticator.reload()
        assert (await c.store(Opcode.SET, b"k", b"v")).status == Status.SUCCESS
        assert (await c.get(b"k")).status == Status.EACCESS


async def test_removed_user_is_disconnected(server, users_file):
    async with logged_in(server, "u_read") as c:
        remove_user(users_file, "u_read")
        assert server.authenticator.reload()
        await c.wait_closed()
    async with connect(server) as c:
        assert (await sasl(c, "PLAIN", "u_read"))[-1].status == Status.AUTH_ERROR


async def test_dcp_connection_that_loses_stream_is_closed(server, users_file):
    async with logged_in(server, "u_stream") as c:
        assert (await c.dcp_open("loses", DcpOpenFlag.PRODUCER)).status == Status.SUCCESS
        add_user(users_file, "u_stream", ["read"], "pw-u_stream", iterations=ITERATIONS)
        assert server.authenticator.reload()
        await c.wait_closed()


async def test_bad_file_is_refused_and_the_old_users_stay(server, users_file, caplog):
    good = users_file.read_text()
    users_file.write_text(good + "\n[users.broken]\nroles = []\n")
    async with logged_in(server, "u_write") as c:
        with caplog.at_level(logging.ERROR, logger="dcp.auth"):
            assert server.authenticator.reload() is False
        assert "users file not reloaded" in caplog.text and "broken" in caplog.text
        assert (await c.store(Opcode.SET, b"k", b"v")).status == Status.SUCCESS
    users_file.unlink()
    assert server.authenticator.reload() is False
    async with connect(server) as c:
        assert (await sasl(c, "SCRAM-SHA512", "u_write"))[-1].status == Status.SUCCESS
