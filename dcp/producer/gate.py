"""One connection's gate: its authentication state, its handler table, its SASL exchange.

Rules of this module (the whole design is in auth.py's rules):
- ``Gate`` is made per accepted connection when a users file is set (``Gate.of``); its
  ``table()`` is the connection's handler table. Before authentication the table holds
  ``PRE_AUTH_OPCODES`` and every other request is EACCESS; after it, ``_fill`` rebuilds
  it in place from ``OPCODE_PRIVILEGES`` (the one table of what each served opcode needs;
  an opcode missing from it needs ``admin``). A DCP_STREAM_REQ with the TAKEOVER flag
  needs ``admin`` too: it kills this node's copy of the vbucket. The DCP control
  ``consumer_name`` needs ``replicate``, as DCP_SEQNO_ACKNOWLEDGED does: the two let a
  connection speak for a replica node, whose acks release MAJORITY writes, and every
  change consumer has ``stream``. A reload that takes ``replicate`` away closes a
  connection that set ``consumer_name`` (its acks are then forgotten, connection.py).
- ``bind`` limits the connection's request bodies to ``PRE_AUTH_MAX_BODY`` until it has
  authenticated (its header is checked before the body is read: a bigger one closes it).
- No reference cycle holds a connection: the gate knows it through a weak reference, and
  the table's entries that call the gate do so weakly, so a closed connection and its
  gate are freed by reference counting, not at a rare full garbage collection.
- PLAIN's PBKDF2 derivation runs in a worker thread on the authenticator's own limiter
  (``AwaitBeforeNext``): a flood of logins cannot take the threads the flusher needs.
"""

from __future__ import annotations

import ipaddress
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..protocol import codec
from ..protocol.frames import Frame
from ..protocol.opcodes import Opcode, Status, StreamRequestFlag
from ..protocol.sasl import SaslResult, SaslServer
from .dispatch import Handler, HandlerTable
from .request_reader import AwaitBeforeNext, CloseAfterAnswer
from .users import User

if TYPE_CHECKING:
    from .auth import Authenticator
    from .connection import Connection

__all__ = [
    "MAX_FAILURES",
    "OPCODE_PRIVILEGES",
    "PLAIN_DERIVATIONS",
    "PRE_AUTH_MAX_BODY",
    "PRE_AUTH_OPCODES",
    "Gate",
    "is_loopback",
]

log = logging.getLogger("dcp.auth")

#: Failed authentications after which a connection is closed.
MAX_FAILURES = 3
#: Largest request body before authentication: HELLO and SASL need far less, and an
#: unknown peer must not make the server buffer megabytes.
PRE_AUTH_MAX_BODY = 64 * 1024
#: PLAIN derivations (PBKDF2, tens of ms each) running at once, server-wide.
PLAIN_DERIVATIONS = 2

#: What each opcode the server serves needs once authenticated (None: nothing).
OPCODE_PRIVILEGES: Mapping[int, str | None] = {
    Opcode.HELLO: None,
    Opcode.NOOP: None,
    Opcode.VERSION: None,
    Opcode.GET_VBUCKET: None,  # where a vbucket lives: clients need it to route
    Opcode.GET_CLUSTER_CONFIG: None,  # the same, for every vbucket
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
    Opcode.DCP_SEQNO_ACKNOWLEDGED: "replicate",  # releases MAJORITY writes: replicas only
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


def _weakly(method: Callable[[Connection, Frame], None]) -> Handler:
    """``method`` of a gate, called through a weak reference: the gate's own table then
    holds no cycle through it (see the module rules)."""
    ref = weakref.WeakMethod(method)

    def call(conn: Connection, f: Frame) -> None:
        bound = ref()
        if bound is not None:
            bound(conn, f)

    return call


def _no_takeover(handler: Handler) -> Handler:
    """DCP_STREAM_REQ for a user without ``admin``: a TAKEOVER stream is refused."""

    def stream_req(conn: Connection, f: Frame) -> None:
        extras = f.extras
        if len(extras) >= 4 and int.from_bytes(extras[:4], "big") & StreamRequestFlag.TAKEOVER:
            why = "a TAKEOVER stream request needs the 'admin' privilege"
            conn.error(f.opcode, Status.EACCESS, f.opaque, why)
            return
        handler(conn, f)

    return stream_req


_CONSUMER_NAME = b"consumer_name"


def _no_consumer_name(handler: Handler) -> Handler:
    """DCP_CONTROL for a user without ``replicate``: ``consumer_name`` is refused (it
    would let the connection acknowledge seqnos as a replica node)."""

    def control(conn: Connection, f: Frame) -> None:
        if bytes(f.key) == _CONSUMER_NAME:
            why = "the control consumer_name needs the 'replicate' privilege"
            conn.error(f.opcode, Status.EACCESS, f.opaque, why)
            return
        handler(conn, f)

    return control


class Gate:
    """One connection's authentication state and its handler table."""

    def __init__(self, base: HandlerTable, authenticator: Authenticator, allow_plain: bool):
        self.base = base
        self.authenticator = authenticator
        self.user: User | None = None
        self._conn: weakref.ref[Connection] | None = None
        self._full_body: int | None = None
        #: trio time since which the connection has had no user (auth_timeout counts it)
        self.unauthenticated_since = 0.0
        self.failures = 0
        self.can_write = False
        self.sasl = SaslServer(self._lookup, allow_plain=allow_plain)
        self.requests: dict[int, Handler] = {}
        self._deny_weakly = _weakly(self._deny)
        self._sasl_handlers: dict[int, Handler] = {
            Opcode.SASL_LIST_MECHS: _weakly(self._list_mechs),
            Opcode.SASL_AUTH: _weakly(self._auth),
            Opcode.SASL_STEP: _weakly(self._step),
        }
        self._fill()

    @classmethod
    def of(
        cls, base: HandlerTable, authenticator: Authenticator, stream: Any, *, tls: bool
    ) -> Gate:
        """A registered gate for a new connection on ``stream`` (PLAIN on TLS/loopback)."""
        gate = cls(base, authenticator, allow_plain=tls or is_loopback(stream))
        authenticator.register(gate)
        return gate

    def table(self) -> HandlerTable:
        """The connection's handler table. It holds the gate; the gate does not hold it."""
        return HandlerTable(
            requests=self.requests,
            unknown=self._unknown,
            response=self.base.response,
            set_run=self._set_run,
        )

    def bind(self, conn: Connection) -> None:
        """``conn`` is served through this gate: limit its frames until it authenticates."""
        self._conn = weakref.ref(conn)
        self.unauthenticated_since = conn.opened_at
        self._full_body = conn.session.max_body_size
        conn.session.max_body_size = min(self._full_body, PRE_AUTH_MAX_BODY)

    @property
    def connection(self) -> Connection | None:
        return self._conn() if self._conn is not None else None

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
                if need is not None and need not in user.privileges:
                    requests[op] = self._deny_weakly
                elif op == Opcode.DCP_STREAM_REQ and "admin" not in user.privileges:
                    requests[op] = _no_takeover(handler)
                elif op == Opcode.DCP_CONTROL and "replicate" not in user.privileges:
                    requests[op] = _no_consumer_name(handler)
                else:
                    requests[op] = handler
        requests.update(self._sasl_handlers)
        self.can_write = user is not None and "write" in user.privileges

    def refresh(self) -> None:
        """The users were reloaded: apply the user's new privileges (see module rules)."""
        if self.user is None:
            return
        conn, name = self.connection, self.user.name
        self.user = self.authenticator.users.get(name)
        self._fill()
        if conn is None:
            return
        if self.user is None:
            self.unauthenticated_since = trio.current_time()
            conn.close(f"user {name} was removed from the users")
        elif conn.dcp_name is not None and "stream" not in self.user.privileges:
            conn.close(f"user {name} lost the stream privilege")
        elif conn.consumer_name is not None and "replicate" not in self.user.privileges:
            conn.close(f"user {name} lost the replicate privilege")

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
            self.unauthenticated_since = trio.current_time()
            self._fill()
        mechanism = bytes(f.key).decode("ascii", "replace")
        data = bytes(f.value)
        if mechanism == "PLAIN" and f.opcode == Opcode.SASL_AUTH:
            # PLAIN derives the key from the password (PBKDF2, tens of ms): in a worker
            # thread, so the other connections are served meanwhile
            async def plain() -> None:
                result = await trio.to_thread.run_sync(
                    run, mechanism, data, limiter=self.authenticator.plain_limiter
                )
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
            self.user, self.failures = user, 0
            if self._conn is None:  # not bound (handlers_for): know it from now on
                self._conn = weakref.ref(conn)
            if self._full_body is not None:  # the connection's own frame limit again
                conn.session.max_body_size = self._full_body
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
        self.authenticator.log_failure(
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
