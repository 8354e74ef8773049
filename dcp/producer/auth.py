"""Authentication and privileges: the users, and the gate in front of each connection's
handler table (the per-connection part, ``Gate``, is gate.py).

Rules of this module:
- Off unless a users file is configured (``users_file``): then ``Authenticator`` holds
  the users (users.py) and ``handlers_for`` gives each connection its own handler table;
  without one ``handlers_for`` returns the server's table itself, so a server without
  users pays nothing per request.
- Before a connection has authenticated its table holds HELLO, NOOP and the three SASL
  opcodes; every other request (VERSION and GET_VBUCKET included, the pipelined-SET fast
  path too) is answered EACCESS. After SASL succeeds the table is rebuilt in place (the
  reader holds the same dict) from ``OPCODE_PRIVILEGES``: an opcode whose privilege the
  user lacks is answered EACCESS, the others go straight to the server's handlers (no
  check per request). Two exceptions: a DCP_STREAM_REQ with the TAKEOVER flag hands the
  vbucket over (kills it here), so without ``admin`` it is EACCESS; the DCP control
  ``consumer_name`` (speaking for a replica, as DCP_SEQNO_ACKNOWLEDGED) needs
  ``replicate``. Without a users file neither is checked: anyone may do anything.
- ``OPCODE_PRIVILEGES`` is the one table of what each served opcode needs (a test checks
  it covers every opcode the server serves); an opcode missing from it needs ``admin``.
- An unauthenticated peer gets little: a request body over ``PRE_AUTH_MAX_BODY`` closes
  the connection (its header is checked before the body is read), and a connection not
  authenticated within ``auth_timeout`` seconds is closed (NOOPs do not keep it).
- SASL (``dcp.protocol.sasl``) runs here: PLAIN only on TLS or loopback connections
  (its PBKDF2 derivation in a worker thread: ``AwaitBeforeNext``; at most
  ``PLAIN_DERIVATIONS`` at once server-wide, on a limiter of their own, so a flood of
  logins cannot take the threads the flusher and backfills need), SASL refused after
  DCP_OPEN, and the third failed authentication (AUTH_ERROR or EINVAL) closes the
  connection once its answer is sent. Failures are logged at INFO, the closing one at
  WARNING, at most ``_LOG_BURST`` lines per ``_LOG_INTERVAL`` (then a count).
- No reference cycle holds a connection: the gate knows its connection through a weak
  reference and its table's SASL entries call the gate weakly, so a closed connection
  and its gate are freed at once, not at a (rare) full garbage collection.
- ``Authenticator.reload`` (SIGHUP) re-reads the file; a bad file is logged and the old
  users stay. Connected users get their new privileges at once; a removed user's
  connection is closed, and so is a DCP connection whose user lost ``stream`` (or
  ``replicate``, once it set ``consumer_name``). A new
  password only matters to the next authentication.

Wiring (server side): ``DcpServer.authenticator = Authenticator.from_config(config)``
(None when auth is off); for each accepted connection ``limits`` makes a ``Gate``
(``Gate.of``), gives its ``table()`` to the ``Connection`` and ``bind``s it; the server runs
``Authenticator.enforce_auth_timeout``. ``handlers_for`` is the one-call form (tests).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from typing import TYPE_CHECKING, Any

import trio

from .dispatch import HandlerTable
from .gate import (
    MAX_FAILURES,
    OPCODE_PRIVILEGES,
    PLAIN_DERIVATIONS,
    PRE_AUTH_MAX_BODY,
    PRE_AUTH_OPCODES,
    Gate,
    is_loopback,
)
from .users import PRIVILEGES, User, Users, UsersFileError, add_user, remove_user

if TYPE_CHECKING:
    from .config import ServerConfig

__all__ = [
    "MAX_FAILURES",
    "OPCODE_PRIVILEGES",
    "PLAIN_DERIVATIONS",
    "PRE_AUTH_MAX_BODY",
    "PRE_AUTH_OPCODES",
    "PRIVILEGES",
    "Authenticator",
    "Gate",
    "User",
    "Users",
    "UsersFileError",
    "add_user",
    "handlers_for",
    "is_loopback",
    "remove_user",
]

log = logging.getLogger("dcp.auth")

#: Failure log lines: at most ``_LOG_BURST`` per ``_LOG_INTERVAL`` seconds (a password
#: guesser must not flood the log); the next line says how many were left out.
_LOG_BURST = 5
_LOG_INTERVAL = 10.0


class _RateLimitedLog:
    """Failure lines, at most ``_LOG_BURST`` per ``_LOG_INTERVAL`` (see the module rules)."""

    def __init__(self) -> None:
        self._window_start = -math.inf
        self._lines = 0
        self._left_out = 0

    def __call__(self, level: int, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window_start >= _LOG_INTERVAL:
            self._window_start, self._lines = now, 0
        if self._lines >= _LOG_BURST:
            self._left_out += 1
            return
        self._lines += 1
        if self._left_out:
            msg += " (%d similar lines left out before this one)"
            args = (*args, self._left_out)
            self._left_out = 0
        log.log(level, msg, *args)


class Authenticator:
    """The server's users (replaced as a whole by ``reload``) and its gated connections."""

    def __init__(self, users: Users, path: str = "") -> None:
        self.users = users
        self.path = path or users.path
        self._gates: weakref.WeakSet[Gate] = weakref.WeakSet()
        self._limiter: trio.CapacityLimiter | None = None
        self.log_failure = _RateLimitedLog()

    @classmethod
    def from_config(cls, config: ServerConfig) -> Authenticator | None:
        """None when no users file is configured; ``UsersFileError`` for a bad one."""
        if not config.users_file:
            return None
        users = Users.load(config.users_file)
        if not len(users):
            log.warning("users file %s has no users: nobody can log in", config.users_file)
        return cls(users, config.users_file)

    @property
    def plain_limiter(self) -> trio.CapacityLimiter:
        """The worker threads PLAIN derivations may use (made in the trio run that needs it)."""
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(PLAIN_DERIVATIONS)
        return self._limiter

    def reload(self) -> bool:
        """Re-read the users file (SIGHUP); False, with the old users kept, if it is bad."""
        if not self.path:  # users_etcd: changes there are followed as they happen
            log.info("SIGHUP: the users come from etcd and are followed; nothing to reload")
            return True
        try:
            users = Users.load(self.path)
        except UsersFileError as exc:
            log.error("users file not reloaded, keeping the previous users: %s", exc)
            return False
        self.replace(users)
        log.info("users file %s reloaded: %d users", self.path, len(users))
        return True

    def replace(self, users: Users) -> None:
        """New users in force: connected users get their new privileges (module rules)."""
        self.users = users
        for gate in list(self._gates):
            gate.refresh()

    def register(self, gate: Gate) -> None:
        self._gates.add(gate)

    async def enforce_auth_timeout(self, timeout: float) -> None:
        """Close connections not authenticated within ``timeout`` seconds (runs until
        cancelled, in the server's background nursery)."""
        while True:
            await trio.sleep(min(timeout / 4, 1.0))
            now = trio.current_time()
            for gate in list(self._gates):
                conn = gate.connection
                if conn is None or conn.closed or gate.user is not None:
                    continue
                if now - gate.unauthenticated_since > timeout:
                    self.log_failure(
                        logging.INFO,
                        "closing id=%d peer=%s: not authenticated within auth_timeout=%g s",
                        conn.id,
                        conn.peer,
                        timeout,
                    )
                    conn.close(f"not authenticated within auth_timeout={timeout:g} s")


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
    return Gate.of(base, authenticator, stream, tls=tls).table()
