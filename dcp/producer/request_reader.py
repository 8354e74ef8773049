"""A connection's reader task: bytes in, requests handled, answers queued.

Rules of this module:
- Every complete frame of the buffer is handled synchronously by the connection's
  handler table (``conn.handlers``, dispatch.py; this module imports no handler); the
  reader never writes to the socket. Framing is done inline (the same validation as
  ``dcp.protocol.FrameReader``, with ``dcp.protocol.layout``'s header: a header is
  checked before its body is awaited) so that runs of plain SETs, the bulk of pipelined
  ingest, go to the table's ``set_run`` without a ``Frame``; the fast path's answers are
  queued as one response per run, in request order.
- Output is bounded per frame, not per read: before each frame (and each SET run) the
  reader checks the connection's unsent output (queued answers, the fast path's
  answers not yet queued, and the buffer being sent) against ``connection_output_cap``.
  Over it, the reader stops with the rest of the buffer kept, tells the server (which
  enforces ``total_output_cap``), waits until the writer has drained below the cap and
  resumes with the buffered frames before reading again. One request can thus overshoot
  the cap by at most its own answer.
- A handler that has a long answer to give (STAT) leaves an iterator of answer chunks in
  ``conn.continuation``; the reader runs it (``Connection.run_continuation``: yields to
  the event loop, pauses at the cap) before handling the next frame, so answers stay in
  request order.
- The start of an incomplete frame is recorded (``conn.partial_since``) for the
  partial-frame timeout; it is cleared while the reader waits on its own output.
- Bad input never escapes: a malformed frame gets EINVAL; a broken byte stream gets one
  EINVAL and the connection is closed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from ..protocol.errors import RemoteProtocolError
from ..protocol.frames import Frame
from ..protocol.layout import ALT_MAGIC, HEADER, HEADER_SIZE, KNOWN_MAGIC
from ..protocol.opcodes import Magic, Status

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["read_requests"]

log = logging.getLogger("dcp.conn")
_RECEIVE_SIZE = 256 * 1024
_HDR = HEADER.unpack_from
_RESPONSES = frozenset((int(Magic.RESPONSE), int(Magic.ALT_RESPONSE)))


async def read_requests(conn: Connection) -> None:
    """Serve ``conn``'s requests until the peer closes or the byte stream breaks."""
    table = conn.handlers
    handlers = table.requests
    unknown_command = table.unknown
    handle_response = table.response
    set_run = table.set_run
    server = conn.server
    registry = server.stream_registry
    refusal_of = server.persistence.write_refusal
    cap = server.config.connection_output_cap
    max_body = conn.reader.max_body_size
    hsize = HEADER_SIZE
    pending = b""  # bytes not yet handled: an incomplete frame, or frames held at the cap
    need = hsize
    resume = False  # ``pending`` holds whole frames held back at the cap: no read first
    while True:
        if resume:
            resume = False
            buf = pending
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
            buf = pending + data if pending else bytes(data)
            if len(buf) < need:  # still the same incomplete frame
                pending = buf
                if conn.partial_since is None:
                    conn.partial_since = conn.last_read
                continue
        n = len(buf)
        need = hsize
        pos = 0
        count = 0
        out = bytearray()  # answers of fast-path SETs, in order
        refusal: str | None = None
        held = False  # stopped at the output cap
        try:
            while n - pos >= hsize:
                if conn.unsent_bytes + len(out) > cap:
                    held = True
                    break
                if buf[pos + 1] == 0x01 and buf[pos] == 0x80:  # a SET: maybe a run
                    if refusal is None:
                        refusal = refusal_of()
                    if not refusal:
                        pos_after, done = set_run(conn, buf, pos, n, max_body, out)
                        if done:
                            count += done
                            pos = pos_after
                            continue
                magic, op, kl, el, dt, vb, body, opq, cas = _HDR(buf, pos)
                if magic in ALT_MAGIC:
                    fel = kl >> 8
                    kl &= 0xFF
                elif magic in KNOWN_MAGIC:
                    fel = 0
                else:
                    raise RemoteProtocolError(f"bad magic 0x{magic:02x} at opcode 0x{op:02x}")
                if body > max_body:
                    raise RemoteProtocolError(f"body of {body} bytes exceeds the limit of "
                                              f"{max_body} (opcode 0x{op:02x})")
                if fel + el + kl > body:
                    raise RemoteProtocolError(
                        f"framing extras {fel} + extras {el} + key {kl} exceed body length "
                        f"{body} (opcode 0x{op:02x})")
                end = pos + hsize + body
                if end > n:
                    need = hsize + body
                    break
                count += 1
                if out:  # answers stay in request order
                    conn.respond(bytes(out))
                    out = bytearray()
                a = pos + hsize
                b = a + fel
                c = b + el
                d = c + kl
                frame = Frame(magic, op, dt, vb, opq, cas, buf[a:b] if fel else b"",
                              buf[b:c], buf[c:d], buf[d:end])
                pos = end
                if magic in _RESPONSES:
                    handle_response(conn, frame)
                    continue
                handler = handlers.get(op, unknown_command)
                try:
                    handler(conn, frame)
                except RemoteProtocolError as exc:
                    conn.error(op, Status.EINVAL, opq, str(exc))
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
        finally:
            conn.frames_in += count
        if out:
            conn.respond(bytes(out))
        pending = buf[pos:] if pos < n else b""
        registry.wake_dirty()
        if held:
            conn.partial_since = None  # waiting on our own output, not on the peer
            if conn.continuation is not None:
                await conn.run_continuation()
            else:
                await conn.wait_for_output_space()
            resume = bool(pending)
            continue
        # ``pending`` is an incomplete frame (or nothing): time it from its first byte
        if not pending:
            conn.partial_since = None
        elif pos or conn.partial_since is None:
            conn.partial_since = trio.current_time()
