"""A connection's reader task: bytes in, requests handled, answers queued.

Rules of this module:
- The I/O shell of the connection's ``ServerSession`` (``dcp.protocol.server_session``):
  received bytes are fed to it, and it frames them (``FrameReader``'s validation: a
  header is checked before its body is awaited), matches the client's noop answers and
  reports its refusals of DCP messages (the table's ``response``). Every request it
  hands out is handled synchronously by the connection's handler table
  (``conn.handlers``, dispatch.py; this module imports no handler); the reader never
  writes to the socket.
- Pipelined ingest keeps its per-item cost: when the session says a SET is next
  (``set_run``), the table's ``set_run`` applies the run of plain SETs straight from the
  received bytes, without a ``Frame``, and the session is told how far it got
  (``consumed``); the fast path's answers are queued as one response per run, in
  request order.
- Output is bounded per frame, not per read: before each complete frame (and each SET
  run) the reader checks the connection's unsent output (queued answers, the fast path's
  answers not yet queued, and the buffer being sent) against ``connection_output_cap``.
  Over it, the reader stops with the rest kept in the session, tells the server (which
  enforces ``total_output_cap``), waits until the writer has drained below the cap and
  resumes with the buffered frames before reading again. One request can thus overshoot
  the cap by at most its own answer.
- A handler that has a long answer to give (STAT) leaves an iterator of answer chunks in
  ``conn.continuation``; the reader runs it (``Connection.run_continuation``: yields to
  the event loop, pauses at the cap) before handling the next frame, so answers stay in
  request order.
- A connection's buffered input counts against ``total_output_cap`` (``limits``): while
  an incomplete frame over ``connection_output_cap`` arrives, each read tells the server.
- The start of an incomplete frame is recorded (``conn.partial_since``) for the
  partial-frame timeout; it is cleared while the reader waits on its own output.
- Bad input never escapes: a malformed frame gets EINVAL; a broken byte stream gets one
  EINVAL and the connection is closed. A handler that must end the connection after
  its answer (the third failed authentication, auth.py) raises ``CloseAfterAnswer``:
  what is queued is sent (for up to a second), then the connection closes.
- A handler whose answer needs blocking work (a PLAIN password's PBKDF2 derivation, tens
  of milliseconds) raises ``AwaitBeforeNext`` with that work, which runs it in a worker
  thread and queues the answer; the reader awaits it before the next frame, so answers
  stay in order and other connections are served meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from ..protocol.errors import RemoteProtocolError
from ..protocol.events import Rejected, StateAcked
from ..protocol.layout import HEADER_SIZE
from ..protocol.opcodes import Status

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["AwaitBeforeNext", "CloseAfterAnswer", "read_requests"]

log = logging.getLogger("dcp.conn")
_RECEIVE_SIZE = 256 * 1024


class CloseAfterAnswer(Exception):
    """Raised by a handler (its answer already queued): close once the answer is sent."""


class AwaitBeforeNext(Exception):
    """Raised by a handler: await ``work()`` (it queues the answer, and may raise
    ``CloseAfterAnswer``) before handling the next frame."""

    def __init__(self, work: Callable[[], Awaitable[None]]) -> None:
        super().__init__("handler work to await")
        self.work = work


async def read_requests(conn: Connection) -> None:
    """Serve ``conn``'s requests until the peer closes or the byte stream breaks."""
    table = conn.handlers
    handlers = table.requests
    unknown_command = table.unknown
    refused = table.response
    set_run = table.set_run
    server = conn.server
    registry = server.stream_registry
    refusal_of = server.persistence.write_refusal
    cap = server.config.connection_output_cap
    session = conn.session
    max_body = session.max_body_size
    next_event = session.next_event
    run_at = session.set_run
    resume = False  # the session holds whole frames held back at the cap: no read first
    while True:
        if resume:
            resume = False
        else:
            try:
                data = await conn.stream.receive_some(_RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                conn.close_reason = conn.close_reason or "connection reset"
                return
            if not data:
                conn.close_reason = conn.close_reason or "client closed"
                return
            conn.last_read = trio.current_time()
            conn.bytes_in += len(data)
            session.feed(data)
            if session.wants_data():  # still the same incomplete frame
                if conn.partial_since is None:
                    conn.partial_since = conn.last_read
                if session.buffered > cap:  # a big frame: input memory counts server-wide
                    server.output_pressure()
                continue
        before = session.frames_in
        out = bytearray()  # answers of fast-path SETs, in order
        refusal: str | None = None
        held = False  # stopped at the output cap
        try:
            while True:
                if conn.unsent_bytes + len(out) > cap:
                    held = session.buffered >= HEADER_SIZE  # a header at least is here
                    break
                run = run_at()  # a SET next: maybe a run for the fast path
                if run is not None:
                    if refusal is None:
                        refusal = refusal_of()
                    if not refusal:
                        buf, pos, n = run
                        pos_after, done = set_run(conn, buf, pos, n, max_body, out)
                        if done:
                            session.consumed(pos_after, done)
                            continue
                ev = next_event()
                if ev is None:
                    break
                if out:  # answers stay in request order
                    conn.respond(bytes(out))
                    out = bytearray()
                if isinstance(ev, (Rejected, StateAcked)):
                    refused(conn, ev)
                    if conn.closed:  # kv_engine closes on a refusal: no later request
                        return
                    continue
                handler = handlers.get(ev.opcode, unknown_command)
                try:
                    handler(conn, ev)
                except RemoteProtocolError as exc:
                    conn.error(ev.opcode, Status.EINVAL, ev.opaque, str(exc))
                except AwaitBeforeNext as later:
                    try:
                        await later.work()
                    except CloseAfterAnswer as exc:
                        await conn.drain(1.0)
                        conn.close_reason = str(exc)
                        return
                except CloseAfterAnswer as exc:
                    await conn.drain(1.0)
                    conn.close_reason = str(exc)
                    return
                if conn.closed:
                    return
                if conn.continuation is not None:
                    held = True  # run it (below) before the next frame
                    break
        except RemoteProtocolError as exc:
            # The byte stream can't be resynchronised: answer once, then close.
            if out:
                conn.respond(bytes(out))
            log.warning("bad frame from id=%d peer=%s: %s", conn.id, conn.peer, exc)
            conn.error(0, Status.EINVAL, 0, str(exc))
            await conn.drain(1.0)
            conn.close_reason = f"protocol error: {exc}"
            return
        if out:
            conn.respond(bytes(out))
        pending = session.buffered
        registry.wake_dirty()
        if held:
            conn.partial_since = None  # waiting on our own output, not on the peer
            if conn.continuation is not None:
                await conn.run_continuation()
            else:
                await conn.wait_for_output_space()
            resume = bool(pending)
            continue
        # what is left is an incomplete frame (or nothing): time it from its first byte
        if not pending:
            conn.partial_since = None
        elif session.frames_in != before or conn.partial_since is None:
            conn.partial_since = trio.current_time()
