"""One client connection: a reader task, a writer task, an ordered response queue.

Rules of this module:
- The reader parses every complete frame of each ``receive_some`` and handles them
  synchronously (``kv_handlers`` / ``dcp_handlers``); it never writes to the socket.
  Framing is done inline (the same validation as ``dcp.protocol.FrameReader``: a header
  is checked before its body is awaited) so that runs of plain SETs, the bulk of
  pipelined ingest, go to ``kv_handlers.set_run`` without a ``Frame``; the answers of
  one received chunk are queued as one response, in request order.
- The writer is the only task that writes. Per wake-up it packs queued responses (in
  request order) and then stream frames (round robin over ready streams, within the
  flow-control window) into one buffer and makes one ``send_all``.
- A durable write's response waits in the queue until its seqno is persisted; later
  responses wait behind it (pipelined requests are answered in order).
- Bad input never escapes this connection: a malformed frame gets EINVAL (or, when the
  byte stream itself is broken, the connection is closed); nothing here raises into the
  server's nursery except a bug.
- Memory is bounded: the reader stops reading when queued output exceeds the cap, and
  streams only produce when the writer asks.
"""

from __future__ import annotations

import itertools
import logging
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from ..protocol import codec
from ..protocol.errors import RemoteProtocolError
from ..protocol.frames import Frame, FrameReader
from ..protocol.opcodes import Magic, Opcode, Status, StreamEndStatus
from .active_stream import ActiveStream, StreamOptions
from .buffer_log import BufferLog

if TYPE_CHECKING:
    from .server import DcpServer

__all__ = ["Connection", "Pending"]

log = logging.getLogger("dcp.conn")
_ids = itertools.count(1)
_RECEIVE_SIZE = 256 * 1024
_HDR = struct.Struct(">BBHBBHIIQ").unpack_from
_KNOWN_MAGIC = frozenset(int(m) for m in Magic)
_ALT_MAGIC = frozenset((int(Magic.ALT_REQUEST), int(Magic.ALT_RESPONSE)))
_RESPONSES = frozenset((int(Magic.RESPONSE), int(Magic.ALT_RESPONSE)))


class Pending:
    """A response that may only be sent once ``vbid`` has persisted ``seqno``."""

    __slots__ = ("frame", "seqno", "vbid")

    def __init__(self, vbid: int, seqno: int, frame: bytes) -> None:
        self.vbid = vbid
        self.seqno = seqno
        self.frame = frame


class Connection:
    def __init__(self, server: DcpServer, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.id = next(_ids)
        try:
            self.peer = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:
            self.peer = "?"
        cfg = server.config
        self.reader = FrameReader(max_body_size=cfg.max_item_size + 4096)
        # HELLO
        self.agent = ""
        self.features: set[int] = set()
        # DCP
        self.dcp_name: str | None = None
        self.dcp_flags = 0
        self.options = StreamOptions()
        self.noop_enabled = False
        self.noop_interval = cfg.noop_interval
        self.noop_pending = False
        self.noop_opaque = 0
        self.noops_sent = 0
        self.cursor_dropping = True
        self.stream_end_on_close = False
        self.change_streams = False
        self.buffer_log = BufferLog()
        self.streams: dict[int, ActiveStream] = {}
        self.ready: dict[ActiveStream, None] = {}
        # Output
        self._responses: deque[Any] = deque()  # bytes | Pending | ActiveStream (announce)
        self._response_bytes = 0
        self._wake = trio.Event()
        self._space = trio.Event()
        self.closed = False
        self.close_reason = ""
        self.last_read = trio.current_time()
        self.opened_at = trio.current_time()
        self.bytes_in = 0
        self.bytes_out = 0
        self.frames_in = 0
        self._cancel = trio.CancelScope()
        self._noop_at = self.opened_at

    # ------------------------------------------------------------------ queueing

    def respond(self, frame: bytes) -> None:
        self._responses.append(frame)
        self._response_bytes += len(frame)
        self._wake.set()

    def respond_when_persisted(self, vbid: int, seqno: int, frame: bytes) -> None:
        self._responses.append(Pending(vbid, seqno, frame))
        self._response_bytes += len(frame)
        self._wake.set()

    def announce_stream(self, stream: ActiveStream) -> None:
        """Make ``stream`` ready once everything queued before it (its OK) has been sent."""
        self._responses.append(stream)
        self._wake.set()

    def error(self, opcode: int, status: int, opaque: int, message: str = "") -> None:
        """Queue an error response; the value carries a JSON error context (as memcached's
        XERROR does) so operators and dissectors see why."""
        value = codec.json_value({"error": {"context": message}}) if message else b""
        self.respond(codec.response(opcode, status, opaque=opaque, value=value,
                                    datatype=1 if value else 0))

    def mark_ready(self, stream: ActiveStream) -> None:
        if stream.announced:
            self.ready[stream] = None
            self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def close(self, reason: str) -> None:
        """Ask the connection to stop; both tasks finish and resources are released."""
        if not self.closed:
            self.closed = True
            self.close_reason = reason
            self._cancel.cancel()

    # ------------------------------------------------------------------ main

    async def run(self) -> None:
        """Serve the connection until either side closes it. Never raises for bad input."""
        log.info("connection opened id=%d peer=%s", self.id, self.peer)
        try:
            with self._cancel:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer)
                    nursery.start_soon(self._timers)
                    await self._reader()
                    nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError) as eg:
            # The peer reset or closed while a task was mid-send/receive; the tasks'
            # nursery wraps that in a group. It ends this connection only.
            self.close_reason = self.close_reason or f"socket: {eg.exceptions[0]!r}"
        finally:
            self.closed = True
            self._release_streams()
            self.server.connection_closed(self)
            with trio.CancelScope(shield=True):
                with trio.move_on_after(1):
                    await self.stream.aclose()
            log.info("connection closed id=%d peer=%s name=%s reason=%s", self.id, self.peer,
                     self.dcp_name, self.close_reason or "client closed")

    def _release_streams(self) -> None:
        for stream in list(self.streams.values()):
            self.server.unregister_stream(stream)
            stream.release()
        self.streams.clear()
        self.ready.clear()

    async def _reader(self) -> None:
        from .dcp_handlers import handle_response
        from .dispatch import HANDLERS, unknown_command
        from .kv_handlers import set_run

        server = self.server
        cap = server.config.connection_output_cap
        max_body = self.reader.max_body_size
        pending = b""  # the incomplete frame at the end of the last chunk
        need = 24
        while True:
            while self._response_bytes > cap:
                self._space = trio.Event()
                await self._space.wait()
            try:
                data = await self.stream.receive_some(_RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.close_reason = "connection reset"
                return
            if not data:
                self.close_reason = self.close_reason or "client closed"
                return
            self.last_read = trio.current_time()
            self.bytes_in += len(data)
            buf = pending + data if pending else bytes(data)
            n = len(buf)
            if n < need:
                pending = buf
                continue
            need = 24
            pos = 0
            count = 0
            out = bytearray()  # answers of fast-path SETs, in order
            refusal: str | None = None
            try:
                while n - pos >= 24:
                    if buf[pos + 1] == 0x01 and buf[pos] == 0x80:  # a SET: maybe a run
                        if refusal is None:
                            refusal = server.write_refusal()
                        if not refusal:
                            pos_after, done = set_run(self, buf, pos, n, max_body, out)
                            if done:
                                count += done
                                pos = pos_after
                                continue
                    magic, op, kl, el, dt, vb, body, opq, cas = _HDR(buf, pos)
                    if magic in _ALT_MAGIC:
                        fel = kl >> 8
                        kl &= 0xFF
                    elif magic in _KNOWN_MAGIC:
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
                    end = pos + 24 + body
                    if end > n:
                        need = 24 + body
                        break
                    count += 1
                    if out:  # answers stay in request order
                        self.respond(bytes(out))
                        out = bytearray()
                    a = pos + 24
                    b = a + fel
                    c = b + el
                    d = c + kl
                    frame = Frame(magic, op, dt, vb, opq, cas, buf[a:b] if fel else b"",
                                  buf[b:c], buf[c:d], buf[d:end])
                    pos = end
                    if magic in _RESPONSES:
                        handle_response(self, frame)
                        continue
                    handler = HANDLERS.get(op, unknown_command)
                    try:
                        handler(self, frame)
                    except RemoteProtocolError as exc:
                        self.error(op, Status.EINVAL, opq, str(exc))
                    if self.closed:
                        return
            except RemoteProtocolError as exc:
                # The byte stream can't be resynchronised: answer once, then close.
                if out:
                    self.respond(bytes(out))
                log.warning("bad frame from id=%d peer=%s: %s", self.id, self.peer, exc)
                self.error(0, Status.EINVAL, 0, str(exc))
                await self._drain(1.0)
                self.close_reason = f"protocol error: {exc}"
                return
            finally:
                self.frames_in += count
            if out:
                self.respond(bytes(out))
            pending = buf[pos:] if pos < n else b""
            server.wake_dirty()

    async def _drain(self, timeout: float) -> None:
        """Give the writer a moment to send what is queued (used before closing)."""
        self._wake.set()
        with trio.move_on_after(timeout):
            while self._responses:
                await trio.sleep(0.01)

    # ------------------------------------------------------------------ writer

    def _take_responses(self, buf: bytearray, limit: int) -> None:
        q = self._responses
        persisted = self.server.persisted_seqno
        while q and len(buf) < limit:
            entry = q[0]
            if entry.__class__ is bytes:
                buf += entry
                self._response_bytes -= len(entry)
            elif entry.__class__ is Pending:
                if persisted(entry.vbid) < entry.seqno:
                    break  # later responses wait: answers stay in request order
                buf += entry.frame
                self._response_bytes -= len(entry.frame)
            else:  # a stream whose OK response is now out: it may start sending
                entry.announced = True
                self.ready[entry] = None
            q.popleft()
        if self._response_bytes <= self.server.config.connection_output_cap:
            self._space.set()

    def has_pending_durable(self) -> bool:
        return any(e.__class__ is Pending for e in self._responses)

    async def _writer(self) -> None:
        limit = self.server.config.send_batch_bytes
        bl = self.buffer_log
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while True:
                buf = bytearray()
                if self._responses:
                    self._take_responses(buf, limit)
                if self.ready and bl.can_send():
                    for stream in list(self.ready):
                        if len(buf) >= limit or not bl.can_send():
                            break
                        more = stream.fill(buf, bl, limit)
                        if not more:
                            self.ready.pop(stream, None)
                        if stream.is_dead:
                            self._stream_finished(stream)
                if not buf:
                    break
                self.bytes_out += len(buf)
                await self.stream.send_all(buf)
                self.server.metrics.bytes_sent(len(buf))

    def _stream_finished(self, stream: ActiveStream) -> None:
        self.ready.pop(stream, None)
        if self.streams.get(stream.vbid) is stream:
            del self.streams[stream.vbid]
        self.server.unregister_stream(stream)

    # ------------------------------------------------------------------ timers

    async def _timers(self) -> None:
        """DCP noops (once enabled and a stream exists) and the idle-client disconnect."""
        cfg = self.server.config
        while True:
            await trio.sleep(min(self.noop_interval / 2, 0.5) if self.noop_enabled else 0.5)
            now = trio.current_time()
            if not self.noop_enabled or self.dcp_name is None:
                continue
            if now - self.last_read > cfg.idle_timeout:
                log.warning("idle DCP client id=%d name=%s: nothing read for %.0f s; closing",
                            self.id, self.dcp_name, now - self.last_read)
                self.close("idle timeout")
                return
            if (self.streams or self.noops_sent) and not self.noop_pending:
                if now - self._noop_at >= self.noop_interval:
                    self.noop_pending = True
                    self.noop_opaque = (self.noop_opaque + 1) & 0xFFFFFFFF
                    self.noops_sent += 1
                    self._noop_at = now
                    self.respond(codec.request(Opcode.DCP_NOOP, opaque=self.noop_opaque))

    # ------------------------------------------------------------------ shutdown

    def end_all_streams(self, status: StreamEndStatus) -> None:
        for stream in self.streams.values():
            if not stream.is_dead:
                stream.set_end(status)
                if stream.announced:
                    self.ready[stream] = None
        self._wake.set()

    def statistics(self) -> dict[str, Any]:
        bl = self.buffer_log.statistics()
        return {
            "id": self.id,
            "peer": self.peer,
            "agent": self.agent,
            "name": self.dcp_name or "",
            "type": "producer" if self.dcp_name else "kv",
            "streams": len(self.streams),
            "flow_control": bl.state.value,
            "window": bl.window,
            "unacked_bytes": bl.outstanding,
            "acked_bytes": bl.acked_total,
            "noop_enabled": self.noop_enabled,
            "noop_interval": self.noop_interval,
            "noop_pending": self.noop_pending,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "queued_response_bytes": self._response_bytes,
            "paused": bool(self.streams) and bl.state.value == "full",
        }
