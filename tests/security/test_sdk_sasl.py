"""The SDK's SASL driver (``dcp.consumer.security.authenticate``) against the protocol's
server state machine, wire bytes included: which requests it sends, what it accepts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dcp.consumer import AuthenticationError, UsageError
from dcp.consumer.security import Credentials, authenticate, resolve
from dcp.protocol import Opcode, Status
from dcp.protocol.sasl import SaslServer, ScramCredentials, make_credentials

STORED = {m: make_credentials(m, "s3cret", iterations=64) for m in ("SCRAM-SHA512", "SCRAM-SHA256")}


def _lookup(user: str, mech: str) -> ScramCredentials | None:
    return STORED.get(mech) if user == "alice" else None


class Wire:
    """A ``security.Ask`` that decodes each request frame and answers it with a
    ``SaslServer``; it records (opcode, key) of every request."""

    def __init__(self, *, allow_plain: bool = False, tamper: bool = False) -> None:
        self.server = SaslServer(_lookup, allow_plain=allow_plain)
        self.sent: list[tuple[int, bytes]] = []
        self.tamper = tamper

    async def __call__(self, build: Callable[[int], bytes]) -> tuple[int, bytes]:
        data = build(77)
        assert data[0] == 0x80 and int.from_bytes(data[12:16], "big") == 77
        key_len = int.from_bytes(data[2:4], "big")
        extras_len = data[4]
        key = data[24 + extras_len : 24 + extras_len + key_len]
        value = data[24 + extras_len + key_len :]
        self.sent.append((data[1], key))
        if data[1] == Opcode.SASL_AUTH:
            r = self.server.start(key.decode(), value)
        else:
            r = self.server.step(key.decode(), value)
        value = r.value
        if self.tamper and r.status == Status.SUCCESS and value.startswith(b"v="):
            value = b"v=" + bytes(reversed(value[2:]))
        return int(r.status), value


@pytest.mark.parametrize("mech", ["SCRAM-SHA512", "SCRAM-SHA256"])
async def test_scram_succeeds_with_the_right_password(mech: str) -> None:
    wire = Wire()
    await authenticate(wire, Credentials("alice", "s3cret", mech))
    assert wire.sent == [(Opcode.SASL_AUTH, mech.encode()), (Opcode.SASL_STEP, mech.encode())]


async def test_wrong_password_names_user_and_mechanism() -> None:
    with pytest.raises(AuthenticationError, match="user 'alice' with SCRAM-SHA512") as info:
        await authenticate(Wire(), Credentials("alice", "wrong"))
    assert info.value.status == Status.AUTH_ERROR
    with pytest.raises(AuthenticationError, match="user 'mallory'"):
        await authenticate(Wire(), Credentials("mallory", "s3cret"))


async def test_a_server_without_our_keys_is_not_trusted() -> None:
    # the server accepts, but its signature is wrong: it does not hold alice's keys
    with pytest.raises(AuthenticationError, match="signature"):
        await authenticate(Wire(tamper=True), Credentials("alice", "s3cret"))


async def test_plain_only_when_asked_and_allowed() -> None:
    wire = Wire(allow_plain=True)
    await authenticate(wire, Credentials("alice", "s3cret", "PLAIN"))
    assert wire.sent == [(Opcode.SASL_AUTH, b"PLAIN")]
    with pytest.raises(AuthenticationError, match="PLAIN"):
        await authenticate(Wire(allow_plain=False), Credentials("alice", "s3cret", "PLAIN"))


def test_credentials_from_arguments_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    def res(**kw: object) -> Credentials | None:
        args: dict = dict(
            username=None, password=None, mechanism=None, tls=False, tls_ca=None, tls_cert=None
        )
        args.update(kw)
        return resolve("h", **args).credentials

    monkeypatch.delenv("DCP_USERNAME", raising=False)
    monkeypatch.delenv("DCP_PASSWORD", raising=False)
    assert res() is None
    c = res(username="bob", password="pw")
    assert c == Credentials("bob", "pw", "SCRAM-SHA512") and "pw" not in repr(c)
    assert res(username="bob", password="pw", mechanism="scram-sha-256").mechanism == "SCRAM-SHA256"
    with pytest.raises(UsageError, match="no password for user 'bob'"):
        res(username="bob")
    with pytest.raises(UsageError, match="without a username"):
        res(password="pw")
    with pytest.raises(UsageError, match="mechanism must be one of"):
        res(username="bob", password="pw", mechanism="MD5")
    monkeypatch.setenv("DCP_USERNAME", "carol")
    monkeypatch.setenv("DCP_PASSWORD", "envpw")
    assert res() == Credentials("carol", "envpw")
    assert res(username="dave", password="x") == Credentials("dave", "x")
