"""SASL on the wire against an in-process server with a users file: the exact frames of
SASL_LIST_MECHS, PLAIN and both SCRAM flows, bad credentials, the close after three
failures, SASL refused after DCP_OPEN, authenticating again, and a server without
users (no gate)."""

from __future__ import annotations

import base64
import re
import struct

import pytest
import trio

from dcp.producer.auth import Authenticator, handlers_for, is_loopback
from dcp.producer.dispatch import HANDLERS
from dcp.producer.request_reader import AwaitBeforeNext
from dcp.producer.users import Users
from dcp.protocol import DcpOpenFlag, FrameReader, Opcode, Status, codec
from dcp.protocol.sasl import SaslClient
from tests.producer.conftest import client_of, running_server

from .conftest import ITERATIONS, connect, logged_in, sasl

HEADER = struct.Struct(">BBHBBHIIQ")


def header(frame) -> tuple:
    """(magic, opcode, key length, extras length, datatype, status, body length, opaque, cas)"""
    return (
        frame.magic,
        frame.opcode,
        len(frame.key),
        len(frame.extras),
        frame.datatype,
        frame.status,
        len(frame.key) + len(frame.extras) + len(frame.value),
        frame.opaque,
        frame.cas,
    )


async def raw_answer(c, request: bytes) -> bytes:
    """The server's exact bytes for one request (one response expected)."""
    await c.send(request)
    data = b""
    while len(data) < 24 or len(data) < 24 + HEADER.unpack_from(data)[6]:
        chunk = await c.stream.receive_some(4096)
        assert chunk, "server closed"
        data += chunk
    return data


async def test_list_mechs_exact_frame(server):
    async with connect(server) as c:
        data = await raw_answer(c, codec.sasl_list_mechs(opaque=7))
    value = b"SCRAM-SHA512 SCRAM-SHA256 PLAIN"  # loopback: PLAIN offered
    assert data == HEADER.pack(0x81, 0x20, 0, 0, 0, 0, len(value), 7, 0) + value


async def test_plain_flow_exact_frames(server):
    async with connect(server) as c:
        request = codec.sasl_auth("PLAIN", b"\0u_read\0pw-u_read", opaque=9)
        assert request == (
            HEADER.pack(0x80, 0x21, 5, 0, 0, 0, 5 + 17, 9, 0) + b"PLAIN" + b"\0u_read\0pw-u_read"
        )
        assert await raw_answer(c, request) == HEADER.pack(0x81, 0x21, 0, 0, 0, 0, 0, 9, 0)
        assert (await c.get(b"k")).status == Status.KEY_ENOENT  # read: allowed


@pytest.mark.parametrize("mechanism, size", [("SCRAM-SHA512", 64), ("SCRAM-SHA256", 32)])
async def test_scram_flow_exact_frames(server, users_file, mechanism, size):
    creds = Users.load(users_file).credentials("u_all", mechanism)
    assert creds is not None
    client = SaslClient(mechanism, "u_all", "pw-u_all", nonce_source=lambda n: b"\x01" * n)
    first = client.start()
    assert first == b"n,,n=u_all,r=" + base64.b64encode(b"\x01" * 18)
    async with connect(server) as c:
        await c.send(codec.sasl_auth(mechanism, first, opaque=1))
        challenge = await c.next_frame()
        assert header(challenge)[:2] == (0x81, Opcode.SASL_AUTH)
        assert header(challenge)[2:6] == (0, 0, 0, Status.AUTH_CONTINUE)
        assert challenge.opaque == 1
        salt = base64.b64encode(creds.salt).decode()
        cnonce = base64.b64encode(b"\x01" * 18).decode()
        assert re.fullmatch(
            rf"r={re.escape(cnonce)}[0-9a-f]{{32}},s={re.escape(salt)},i={ITERATIONS}",
            bytes(challenge.value).decode(),
        )
        final = client.step(bytes(challenge.value))
        await c.send(codec.sasl_step(mechanism, final, opaque=2))
        ok = await c.next_frame()
        assert header(ok)[:6] == (0x81, Opcode.SASL_STEP, 0, 0, 0, Status.SUCCESS)
        assert ok.opaque == 2 and bytes(ok.value).startswith(b"v=")
        assert len(base64.b64decode(bytes(ok.value)[2:])) == size
        client.finish(bytes(ok.value))  # the server proved it holds the keys
        op = next(c.opaques)
        r = await c.call(codec.request(Opcode.SET_VBUCKET_STATE, opaque=op, extras=b"\x01"), op)
        assert r.status == Status.SUCCESS  # admin via "all"


async def test_wrong_password_unknown_user_and_mechanism(server):
    async with connect(server) as c:
        assert (await sasl(c, "SCRAM-SHA512", "u_read", "nope"))[-1].status == Status.AUTH_ERROR
        assert (await sasl(c, "SCRAM-SHA256", "ghost", "pw"))[-1].status == Status.AUTH_ERROR
    async with connect(server) as c:
        op = next(c.opaques)
        r = await c.call(codec.sasl_auth("SCRAM-SHA1", b"n,,n=u_read,r=abc", op), op)
        assert r.status == Status.AUTH_ERROR
        op = next(c.opaques)
        r = await c.call(codec.sasl_auth("SCRAM-SHA512", b"n,,n=u_read,r=" + b"a" * 1100, op), op)
        assert r.status == Status.EINVAL
        op = next(c.opaques)  # a SASL_STEP without an exchange
        r = await c.call(codec.sasl_step("SCRAM-SHA512", b"c=biws,r=a,p=AAAA", op), op)
        assert r.status == Status.EINVAL
        await c.wait_closed()  # that was the third failure


async def test_three_failures_close_the_connection_after_the_answer(server):
    async with connect(server) as c:
        for _ in range(3):
            answers = await sasl(c, "PLAIN", "u_read", "wrong")
            assert [a.status for a in answers] == [Status.AUTH_ERROR]
        await c.wait_closed()
    async with connect(server) as c:  # two failures, then success: the count restarts
        for _ in range(2):
            assert (await sasl(c, "PLAIN", "u_read", "wrong"))[-1].status == Status.AUTH_ERROR
        assert (await sasl(c, "SCRAM-SHA512", "u_read"))[-1].status == Status.SUCCESS
        for _ in range(2):
            assert (await sasl(c, "PLAIN", "u_read", "wrong"))[-1].status == Status.AUTH_ERROR
        assert (await sasl(c, "PLAIN", "u_read"))[-1].status == Status.SUCCESS
        assert (await c.get(b"k")).status == Status.KEY_ENOENT


async def test_sasl_frames_with_extras_are_einval(server):
    async with connect(server) as c:
        op = next(c.opaques)
        frame = codec.request(
            Opcode.SASL_AUTH, opaque=op, extras=b"\0\0\0\0", key=b"PLAIN", value=b"\0u\0p"
        )
        assert (await c.call(frame, op)).status == Status.EINVAL


async def test_no_sasl_after_dcp_open(server):
    async with logged_in(server, "u_stream") as c:
        assert (await c.dcp_open("after-open", DcpOpenFlag.PRODUCER)).status == Status.SUCCESS
        op = next(c.opaques)
        r = await c.call(codec.sasl_auth("PLAIN", b"\0u_all\0pw-u_all", op), op)
        assert r.status == Status.NOT_SUPPORTED


async def test_authenticating_again_replaces_the_user(server):
    async with logged_in(server, "u_read") as c:
        assert (await c.get(b"k")).status == Status.KEY_ENOENT
        assert (await sasl(c, "PLAIN", "u_write"))[-1].status == Status.SUCCESS
        assert (await c.get(b"k")).status == Status.EACCESS
        assert (await c.store(Opcode.SET, b"k", b"v")).status == Status.SUCCESS
        # a failed attempt leaves the connection unauthenticated
        assert (await sasl(c, "PLAIN", "u_write", "bad"))[-1].status == Status.AUTH_ERROR
        assert (await c.store(Opcode.SET, b"k", b"v")).status == Status.EACCESS


async def test_without_users_there_is_no_gate(tmp_path):
    async with running_server(tmp_path / "data") as srv, client_of(srv) as c:
        assert srv.handlers is HANDLERS
        assert handlers_for(HANDLERS, None, c.stream) is HANDLERS
        op = next(c.opaques)
        r = await c.call(codec.sasl_list_mechs(op), op)
        assert r.status == Status.UNKNOWN_COMMAND
        assert (await c.store(Opcode.SET, b"k", b"v")).status == Status.SUCCESS


class _Sock:
    def __init__(self, host: str) -> None:
        self.host = host

    def getpeername(self):
        return (self.host, 1234)


class _Stream:
    def __init__(self, host: str) -> None:
        self.socket = _Sock(host)


class _TlsStream:
    def __init__(self, host: str) -> None:
        self.transport_stream = _Stream(host)


class _Conn:
    """What the gate's SASL handlers use of a connection."""

    id = 1
    peer = "10.1.2.3:1234"
    dcp_name = None

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def respond(self, frame: bytes) -> None:
        self.out.append(frame)

    def error(self, opcode: int, status: int, opaque: int, message: str = "") -> None:
        self.out.append(codec.response(opcode, status, opaque=opaque, value=message.encode()))


def _frames(data: bytes):
    reader = FrameReader()
    reader.feed(data)
    return reader.read_frames()


def test_loopback_detection():
    assert is_loopback(_Stream("127.0.0.1")) and is_loopback(_Stream("::1"))
    assert is_loopback(_TlsStream("127.0.0.5"))
    assert not is_loopback(_Stream("10.1.2.3")) and not is_loopback(_Stream("::ffff:10.0.0.1"))
    assert not is_loopback(object()) and not is_loopback(None)


@pytest.mark.parametrize("tls, plain_ok", [(False, False), (True, True)])
async def test_plain_needs_tls_or_loopback(users_file, tls, plain_ok):
    table = handlers_for(
        HANDLERS, Authenticator(Users.load(users_file)), _Stream("10.1.2.3"), tls=tls
    )
    conn = _Conn()
    for frame in _frames(
        codec.sasl_list_mechs(1) + codec.sasl_auth("PLAIN", b"\0u_read\0pw-u_read", 2)
    ):
        try:
            table.requests[frame.opcode](conn, frame)  # type: ignore[arg-type]
        except AwaitBeforeNext as later:  # PLAIN: the derivation runs in a thread
            await later.work()
    mechs, auth = (_frames(f)[0] for f in conn.out)
    assert (b"PLAIN" in bytes(mechs.value)) is plain_ok
    assert auth.status == (Status.SUCCESS if plain_ok else Status.AUTH_ERROR)


async def test_a_plain_login_does_not_stall_other_connections(tmp_path):
    """PLAIN derives the key from the password (PBKDF2 at the user's iterations): that
    runs in a worker thread, so another connection's NOOP is answered meanwhile."""
    from dcp.producer.auth import add_user

    from .conftest import auth_server

    users = tmp_path / "users.toml"
    add_user(users, "slow", ["read"], "pw", iterations=400_000)
    answered: dict[str, float] = {}
    async with auth_server(tmp_path / "data", users) as srv:
        async with connect(srv) as a, connect(srv) as b:

            async def login() -> None:
                r = await a.call(codec.sasl_auth("PLAIN", b"\0slow\0pw", 1), 1, timeout=30)
                assert r.status == Status.SUCCESS
                answered["login"] = trio.current_time()

            async def noop() -> None:
                await trio.sleep(0.05)  # the login is being derived by now
                r = await b.call(codec.request(Opcode.NOOP, opaque=2), 2, timeout=30)
                assert r.status == Status.SUCCESS
                answered["noop"] = trio.current_time()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(login)
                nursery.start_soon(noop)
    assert answered["noop"] < answered["login"], answered
