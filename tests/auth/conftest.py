"""An in-process server with a users file written by the test: one user per privilege
(``u_read``... named after it) and ``u_all``, each with the password ``pw-<name>``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dcp.producer.auth import add_user
from dcp.producer.server import DcpServer, ServerConfig
from dcp.producer.users import PRIVILEGES
from dcp.protocol import Frame, Opcode, Status, codec
from dcp.protocol.sasl import SaslClient
from tests.producer.wire import WireClient

#: low: a login costs the client one PBKDF2 derivation
ITERATIONS = 256
USERS = {f"u_{p}": [p] for p in PRIVILEGES} | {"u_all": ["all"]}


def password_of(name: str) -> str:
    return f"pw-{name}"


def write_users(path: Path, users: dict[str, list[str]] = USERS) -> Path:
    for name, roles in users.items():
        add_user(path, name, roles, password_of(name), iterations=ITERATIONS)
    return path


@contextlib.asynccontextmanager
async def auth_server(data_dir: Path, users_file: Path, **overrides) -> AsyncIterator[DcpServer]:
    cfg = ServerConfig(
        port=0, data_dir=str(data_dir), num_vbuckets=4, users_file=str(users_file), **overrides
    )
    async with DcpServer(cfg) as server:
        yield server


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    return write_users(tmp_path / "users.toml")


@pytest.fixture
async def server(tmp_path: Path, users_file: Path) -> AsyncIterator[DcpServer]:
    async with auth_server(tmp_path / "data", users_file) as srv:
        yield srv


@contextlib.asynccontextmanager
async def connect(server: DcpServer) -> AsyncIterator[WireClient]:
    c = await WireClient.connect(server.port, server.bucket.num_vbuckets)
    try:
        yield c
    finally:
        await c.aclose()


async def sasl(
    c: WireClient, mechanism: str, name: str, password: str | None = None
) -> list[Frame]:
    """Authenticate; the server's answers in order (the last one decides)."""
    client = SaslClient(mechanism, name, password_of(name) if password is None else password)
    op = next(c.opaques)
    r = await c.call(codec.sasl_auth(mechanism, client.start(), op), op)
    answers = [r]
    if r.status == Status.AUTH_CONTINUE:
        op = next(c.opaques)
        r = await c.call(codec.sasl_step(mechanism, client.step(bytes(r.value)), op), op)
        answers.append(r)
        if r.status == Status.SUCCESS:
            client.finish(bytes(r.value))
    return answers


@contextlib.asynccontextmanager
async def logged_in(server: DcpServer, name: str, mechanism: str = "PLAIN"):
    async with connect(server) as c:
        answers = await sasl(c, mechanism, name)
        assert answers[-1].status == Status.SUCCESS, answers
        yield c


async def request_status(c: WireClient, frame: bytes, opaque: int) -> int | None:
    """Send ``frame`` and a NOOP behind it: the request's status, or None when it got no
    answer (answers come in request order, so the NOOP's answer ends the wait)."""
    barrier = next(c.opaques)
    await c.send(frame + codec.request(Opcode.NOOP, opaque=barrier))
    status = None
    while True:
        f = await c.next_frame()
        if f.is_response and f.opaque == opaque and status is None:
            status = f.status
        if f.is_response and f.opaque == barrier and f.opcode == Opcode.NOOP:
            return status
