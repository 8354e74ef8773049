"""Authentication and privileges: the gate in front of a connection's handler table.

Rules of this module:
- Off unless a users file is configured (``users_file``): then ``Authenticator`` holds
  the users (users.py) and ``handlers_for`` gives each connection its own handler table;
  without one ``handlers_for`` returns the server's table itself, so a server without
  users pays nothing per request.
- Before a connection has authenticated its table holds HELLO, NOOP and the three SASL
  opcodes; every other request (the pipelined-SET fast path included) is answered
  EACCESS. After SASL succeeds the table is rebuilt in place (the reader holds the same
  dict) from ``OPCODE_PRIVILEGES``: an opcode whose privilege the user lacks is answered
  EACCESS, the others go straight to the server's handlers (no check per request).
- ``OPCODE_PRIVILEGES`` is the one table of what each served opcode needs (a test checks
  it covers every opcode the server serves); an opcode missing from it needs ``admin``.
- SASL (``dcp.protocol.sasl``) runs here: PLAIN only on TLS or loopback connections
  (its PBKDF2 derivation in a worker thread: ``AwaitBeforeNext``), SASL refused after
  DCP_OPEN, and the third failed authentication (AUTH_ERROR or EINVAL) closes the
  connection once its answer is sent (logged at INFO, the closing one at WARNING).
- ``Authenticator.reload`` (SIGHUP) re-reads the file; a bad file is logged and the old
  users stay. Connected users get their new privileges at once; a removed user's
  connection is closed, and so is a DCP connection whose user lost ``stream``. A new
  password only matters to the next authentication.

Wiring (server side): ``DcpServer.authenticator = Authenticator.from_config(config)``
(None when auth is off) and, for each accepted connection,
``Connection(server, stream, handlers_for(server.handlers, server.authenticator, stream,
tls=...))``.
"""

from __future__ import annotations

import ipaddress
import logging
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..protocol import codec
from ..protocol.frames import Frame
from ..protocol.opcodes import Opcode, Status
from ..protocol.sasl import SaslResult, SaslServer
from .dispatch import Handler, HandlerTable
from .request_reader import AwaitBeforeNext, CloseAfterAnswer
from .users import PRIVILEGES, User, Users, UsersFileError, add_user, remove_user

if TYPE_CHECKING:
    from .config import ServerConfig
    from .connection import Connection

__all__ = [
    "MAX_FAILURES",
    "OPCODE_PRIVILEGES",
    "PRE_AUTH_OPCODES",
    "PRIVILEGES",
    "Authenticator",
    "User",
    "Users",
    "UsersFileError",
    "add_user",
    "handlers_for",
    "is_loopback",
    "remove_user",
]

log = logging.getLogger("dcp.auth")

#: Failed authentications after which a connection is closed.
MAX_FAILURES = 3

#: What each opcode the server serves needs once authenticated (None: nothing).
OPCODE_PRIVILEGES: Mapping[int, str | None] = {
    Opcode.HELLO: None,
    Opcode.NOOP: None,
    Opcode.VERSION: None,
    Opcode.GET_VBUCKET: None,  # where a vbucket lives: clients need it to route
    Opcode.SASL_LIST_MECHS: None,
    Opcode.SASL_AUTH: None,
    Opcode.SASL_STEP: None,
    Opcode.GET: "read",
    Opcode.SET: "write",
    Opcode.ADD: "write",
    Opcode.REPLACE: "write",
    Opcode.DELETE: "write",
    Opcode.DCP_OPEN: "stream",
    Opcode.DCP_CONTROL: "stream",
    Opcode.DCP_STREAM_REQ: "stream",
    Opcode.DCP_CLOSE_STREAM: "stream",
    Opcode.DCP_GET_FAILOVER_LOG: "stream",
    Opcode.DCP_BUFFER_ACK: "stream",
    Opcode.GET_ALL_VB_SEQNOS: "stream",
    Opcode.STAT: "stats",
    Opcode.SET_VBUCKET_STATE: "admin",
}

#: What a connection may send before it has authenticated.
PRE_AUTH_OPCODES = (
    Opcode.HELLO,
    Opcode.NOOP,
    Opcode.SASL_LIST_MECHS,
    Opcode.SASL_AUTH,
    Opcode.SASL_STEP,
)
_SASL = (Opcode.SASL_LIST_MECHS, Opcode.SASL_AUTH, Opcode.SASL_STEP)


def is_loopback(stream: Any) -> bool:
    """Whether ``stream``'s peer is on this host (PLAIN is allowed there)."""
    sock = getattr(stream, "socket", None)
    if sock is None:  # a TLS stream: the socket is underneath
        sock = getattr(getattr(stream, "transport_stream", None), "socket", None)
    try:
        host = sock.getpeername()[0] if sock is not None else ""
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except (OSError, ValueError, IndexError, TypeError):
        return False


class Authenticator:
    """The server's users (replaced as a whole by ``reload``) and its gated connections."""

    def __init__(self, users: Users, path: str = "") -> None:
        self.users = users
        self.path = path or users.path
        self._gates: weakref.WeakSet[_Gate] = weakref.WeakSet()

    @classmethod
    def from_config(cls, config: ServerConfig) -> Authenticator | None:
        """None when no users file is configured; ``UsersFileError`` for a bad one."""
        if not config.users_file:
            return None
        users = Users.load(config.users_file)
        if not len(users):
            log.warning("users file %s has no users: nobody can log in", config.users_file)
        return cls(users, config.users_file)

    def reload(self) -> bool:
        """Re-read the users file (SIGHUP); False, with the old users kept, if it is bad."""
        try:
            users = Users.load(self.path)
        except UsersFileError as exc:
            log.error("users file not reloaded, keeping the previous users: %s", exc)
            return False
        self.users = users
        for gate in list(self._gates):
            gate.refresh()
        log.info("users file %s reloaded: %d users", self.path, len(users))
        return True

    def register(self, gate: _Gate) -> None:
        self._gates.add(gate)


def handlers_for(
    base: HandlerTable,
    authenticator: Authenticator | None,
    stream: Any = None,
    *,
    tls: bool = False,
) -> HandlerTable:
    """The handler table of a new connection: ``base`` itself when auth is off, else a
    gated table of its own (PLAIN allowed when ``tls`` or the peer is loopback)."""
    if authenticator is None:
        return base
    gate = _Gate(base, authenticator, allow_plain=tls or is_loopback(stream))
    authenticator.register(gate)
    return gate.table


class _Gate:
    """One connection's authentication state and its handler table."""

    def __init__(self, base: HandlerTable, authenticator: Authenticator, allow_plain: bool):
        self.base = base
        self.authenticator = authenticator
        self.user: User | None = None
        self.conn: Connection | None = None
        self.failures = 0
        self.can_write = False
        self.sasl = SaslServer(self._lookup, allow_plain=allow_plain)
        self.requests: dict[int, Handler] = {}
        self.table = HandlerTable(
            requests=self.requests,
            unknown=self._unknown,
            response=base.response,
            set_run=self._set_run,
        )
        self._fill()

    def _lookup(self, name: str, mechanism: str) -> Any:
        return self.authenticator.users.credentials(name, mechanism)

    def _fill(self) -> None:
        """Rebuild the table in place for the current user (None: not authenticated)."""
        requests = self.requests
        requests.clear()
        base = self.base.requests
        user = self.user
        if user is None:
            requests.update({op: base[op] for op in PRE_AUTH_OPCODES if op in base})
        else:
            for op, handler in base.items():
                need = OPCODE_PRIVILEGES.get(op, "admin")
                requests[op] = handler if need is None or need in user.privileges else self._deny
        requests[Opcode.SASL_LIST_MECHS] = self._list_mechs
        requests[Opcode.SASL_AUTH] = self._auth
        requests[Opcode.SASL_STEP] = self._step
        self.can_write = user is not None and "write" in user.privileges

    def refresh(self) -> None:
        """The users were reloaded: apply the user's new privileges (see module rules)."""
        if self.user is None:
            return
        conn, name = self.conn, self.user.name
        self.user = self.authenticator.users.get(name)
        self._fill()
        if conn is None:
            return
        if self.user is None:
            conn.close(f"user {name} was removed from the users file")
        elif conn.dcp_name is not None and "stream" not in self.user.privileges:
            conn.close(f"user {name} lost the stream privilege")

    # ------------------------------------------------------------------ refusals

    def _deny(self, conn: Connection, f: Frame) -> None:
        if self.user is None:
            why = "authenticate first (SASL_AUTH)"
        else:
            need = OPCODE_PRIVILEGES.get(f.opcode, "admin")
            why = f"user {self.user.name!r} lacks the {need!r} privilege"
        conn.error(f.opcode, Status.EACCESS, f.opaque, why)

    def _unknown(self, conn: Connection, f: Frame) -> None:
        if self.user is None:
            self._deny(conn, f)
        else:
            self.base.unknown(conn, f)

    def _set_run(
        self, conn: Connection, buf: bytes, pos: int, end: int, max_body: int, out: bytearray
    ) -> tuple[int, int]:
        # Not allowed to write: apply none, so each SET goes through the table (EACCESS).
        if self.can_write:
            return self.base.set_run(conn, buf, pos, end, max_body, out)
        return pos, 0

    # ------------------------------------------------------------------ SASL

    def _list_mechs(self, conn: Connection, f: Frame) -> None:
        value = " ".join(self.sasl.mechanisms).encode()
        conn.respond(codec.response(f.opcode, opaque=f.opaque, value=value))

    def _auth(self, conn: Connection, f: Frame) -> None:
        self._exchange(conn, f, self.sasl.start)

    def _step(self, conn: Connection, f: Frame) -> None:
        self._exchange(conn, f, self.sasl.step)

    def _exchange(self, conn: Connection, f: Frame, run: Any) -> None:
        if conn.dcp_name is not None:
            conn.error(f.opcode, Status.NOT_SUPPORTED, f.opaque, "no SASL after DCP_OPEN")
            return
        if f.extras:
            self._answer(conn, f, SaslResult(Status.EINVAL, b"SASL requests carry no extras"))
            return
        if f.opcode == Opcode.SASL_AUTH and self.user is not None:
            self.user = None  # authenticating again: the old identity is gone
            self._fill()
        mechanism = bytes(f.key).decode("ascii", "replace")
        data = bytes(f.value)
        if mechanism == "PLAIN" and f.opcode == Opcode.SASL_AUTH:
            # PLAIN derives the key from the password (PBKDF2, tens of ms): in a worker
            # thread, so the other connections are served meanwhile
            async def plain() -> None:
                result = await trio.to_thread.run_sync(run, mechanism, data)
                self._answer(conn, f, result)

            raise AwaitBeforeNext(plain)
        self._answer(conn, f, run(mechanism, data))

    def _answer(self, conn: Connection, f: Frame, result: SaslResult) -> None:
        if result.status == Status.AUTH_CONTINUE:
            conn.respond(
                codec.response(f.opcode, Status.AUTH_CONTINUE, opaque=f.opaque, value=result.value)
            )
            return
        user = self.authenticator.users.get(result.username or "")
        if result.status == Status.SUCCESS and user is not None:
            self.user, self.conn, self.failures = user, conn, 0
            self._fill()
            log.info(
                "authenticated id=%d peer=%s user=%s mechanism=%s",
                conn.id,
                conn.peer,
                user.name,
                bytes(f.key).decode("ascii", "replace"),
            )
            conn.respond(codec.response(f.opcode, opaque=f.opaque, value=result.value))
            return
        self.failures += 1
        status = Status.EINVAL if result.status == Status.EINVAL else Status.AUTH_ERROR
        why = result.value.decode("utf-8", "replace")
        log.log(
            logging.WARNING if self.failures >= MAX_FAILURES else logging.INFO,
            "authentication failed id=%d peer=%s (%d of %d): %s",
            conn.id,
            conn.peer,
            self.failures,
            MAX_FAILURES,
            why,
        )
        conn.error(f.opcode, status, f.opaque, why)
        if self.failures >= MAX_FAILURES:
            raise CloseAfterAnswer(f"{self.failures} failed authentications")
