"""Server-wide connection limits: the accept loop and the output-memory guard.

Rules of this module:
- ``accept_connections`` runs one accept loop per listener in the caller's nursery and
  starts each connection's task in the connection nursery (the server's nursery owns
  every task). A connection over ``max_connections`` is closed at once, before any byte
  is read, and counted (``rejected_conns`` in STAT, ``dcp_connections_refused``).
- Running out of descriptors or memory at accept (EMFILE, ENFILE, ENOBUFS, ENOMEM) is
  not a bug: the loop backs off (doubling up to ``_MAX_BACKOFF``) and logs at most once
  per ``_LOG_INTERVAL`` with the number of failures since, instead of a traceback per
  attempt. The waiting connection stays in the kernel's backlog meanwhile. Every listener
  of the server uses this loop (``accept_with_backoff``), the metrics port included.
- ``guard_output`` keeps the memory all connections hold (``Connection.held_bytes``: unsent
  output plus buffered input, e.g. a large frame still arriving) within
  ``total_output_cap``: over it, the connections holding the most are closed, worst
  first, until the rest fit, each with a log line and a count
  (``conns_closed_output_memory``). Input counts because each connection may buffer up to
  ``max_item_size`` + 4 KiB of one frame: thousands of clients each sending most of a big
  frame would otherwise hold gigabytes for the whole partial-frame timeout. It runs when
  a connection reaches its own cap with output or with buffered input
  (``DcpServer.output_pressure``) and four times a second.
- Each connection gets the server's handler table when authentication is off, and a
  gated one of its own (``gate.Gate``, bound to the connection) when it is on.
- The TLS listener uses the same loop: a TLS connection is counted and limited like any
  other from accept on; its task finishes the handshake first (``tls.handshake``,
  bounded by ``tls_handshake_timeout``) and then runs the same ``Connection`` code.
"""

from __future__ import annotations

import errno
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from .connection import Connection
from .gate import Gate
from .tls import handshake

if TYPE_CHECKING:
    from .metrics import ServerMetrics
    from .server import DcpServer

__all__ = ["accept_connections", "accept_with_backoff", "guard_output", "shed_output"]

log = logging.getLogger("dcp.server")

_RESOURCE_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
_LOG_INTERVAL = 10.0
_MIN_BACKOFF = 0.05
_MAX_BACKOFF = 1.0
_GUARD_PERIOD = 0.25


async def accept_connections(
    server: DcpServer,
    listeners: list[trio.SocketListener],
    conns: trio.Nursery,
    tls: Callable[[], ssl.SSLContext] | None = None,
) -> None:
    """Accept on every listener until cancelled; connections run in ``conns``. With
    ``tls`` (which returns the current context: a rotated certificate serves the next
    connection), each connection is a TLS one."""
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept_loop, server, listener, conns, tls)


async def _serve_tls(server: DcpServer, conn: Connection, ctx: ssl.SSLContext) -> None:
    """Finish ``conn``'s TLS handshake, then serve it; a failed or stalled handshake
    closes it (it was counted in ``connections``, so it leaves them here)."""
    done = False
    try:
        done = await handshake(conn, ctx, server.config.tls_handshake_timeout)
    finally:  # failed, stalled, or the server stops meanwhile
        if not done:
            conn.closed = True
            server.connection_closed(conn)
            await trio.aclose_forcefully(conn.stream)
    if done:
        await server.serve_connection(conn)


async def _accept_loop(
    server: DcpServer,
    listener: trio.SocketListener,
    conns: trio.Nursery,
    tls: Callable[[], ssl.SSLContext] | None = None,
) -> None:
    metrics = server.metrics
    refused_logged_at = -_LOG_INTERVAL

    async def admit(stream: trio.SocketStream) -> None:
        nonlocal refused_logged_at
        if len(server.connections) >= server.config.max_connections:
            metrics.connections_refused += 1
            now = trio.current_time()
            if now - refused_logged_at >= _LOG_INTERVAL:
                log.warning(
                    "refusing connections: max_connections=%d are open (%d refused so far)",
                    server.config.max_connections,
                    metrics.connections_refused,
                )
                refused_logged_at = now
            await trio.aclose_forcefully(stream)
            return
        # auth on: the connection's own gated table (gate.py); off: the server's table
        authenticator = server.authenticator
        if authenticator is None:
            conn = Connection(server, stream, server.handlers)
        else:
            gate = Gate.of(server.handlers, authenticator, stream, tls=tls is not None)
            conn = Connection(server, stream, gate.table())
            gate.bind(conn)
        # counted now, not when its task starts: a burst of accepts cannot overshoot
        server.connections.add(conn)
        metrics.connections_total += 1
        if tls is None:
            conns.start_soon(server.serve_connection, conn)
        else:
            conns.start_soon(_serve_tls, server, conn, tls())

    await accept_with_backoff(listener, admit, metrics, "connections")


async def accept_with_backoff(
    listener: trio.SocketListener,
    admit: Callable[[trio.SocketStream], Awaitable[None]],
    metrics: ServerMetrics,
    what: str,
) -> None:
    """Accept on ``listener`` until cancelled, handing each stream to ``admit`` (which
    starts its task or closes it). Out of descriptors or memory, back off and log at most
    once per ``_LOG_INTERVAL`` (see the module rules); each failure counts in
    ``metrics.accept_errors``. Closes the listener when done."""
    backoff = _MIN_BACKOFF
    failures = 0  # since the last log line
    logged_at = -_LOG_INTERVAL
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRNOS:
                    raise
                metrics.accept_errors += 1
                failures += 1
                now = trio.current_time()
                if now - logged_at >= _LOG_INTERVAL:
                    log.error(
                        "cannot accept %s: %s (%d failures since the last report; "
                        "retrying, at most every %.1f s)",
                        what,
                        exc.strerror or exc,
                        failures,
                        _MAX_BACKOFF,
                    )
                    logged_at = now
                    failures = 0
                await trio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            backoff = _MIN_BACKOFF
            await admit(stream)


def shed_output(server: DcpServer) -> int:
    """Close the connections holding the most memory (unsent output + buffered input)
    until what all of them hold fits within ``total_output_cap``; returns how many were
    closed."""
    cap = server.config.total_output_cap
    live = [(c.held_bytes, c) for c in server.connections if not c.closed]
    total = sum(held for held, _ in live)
    if total <= cap:
        return 0
    closed = 0
    live.sort(key=lambda e: e[0], reverse=True)
    for held, conn in live:
        if total <= cap or not held:
            break
        unsent = conn.unsent_bytes
        log.warning(
            "connection memory %d bytes (unsent output + buffered input) is over "
            "total_output_cap=%d: closing id=%d peer=%s name=%s, which holds %d "
            "unsent and %d buffered input bytes",
            total,
            cap,
            conn.id,
            conn.peer,
            conn.dcp_name,
            unsent,
            held - unsent,
        )
        server.metrics.connections_shed += 1
        conn.close(
            f"memory over total_output_cap ({unsent} unsent bytes, "
            f"{held - unsent} buffered input bytes)"
        )
        total -= held
        closed += 1
    return closed


async def guard_output(server: DcpServer) -> None:
    """Run ``shed_output`` when asked (``output_pressure``) and periodically."""
    while True:
        with trio.move_on_after(_GUARD_PERIOD):
            await server.output_event.wait()
        server.output_event = trio.Event()
        shed_output(server)
        await trio.sleep(0.005)  # many connections at their cap: one pass serves them all
