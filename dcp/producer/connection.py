"""One client connection: a reader task, a writer task, a timer task, an ordered
response queue.

Rules of this module:
- The reader (``request_reader.read_requests``) parses and handles requests and queues
  their answers; it never writes to the socket. The writer is the only task that
  writes. Per wake-up it packs queued responses (in request order) and then stream
  frames (round robin over ready streams, within the flow-control window) into one
  buffer and makes one ``send_all``; an answer bigger than a batch is sent as it is.
- What the wire requires of one connection (framing of requests, noop state, flow
  control with its window and acks) is its ``session`` (``dcp.protocol.server_session``,
  sans I/O); this module and its three tasks are the I/O shell around it.
- Memory is bounded the way memcached bounds it: a connection whose unsent output
  (queued answers + the buffer being sent, ``unsent_bytes``) is over
  ``connection_output_cap`` has its input processing stopped, frame by frame, until the
  writer drains it; long answers (STAT) are produced in steps against the same cap
  (``run_continuation``); streams only produce when the writer asks. Server-wide,
  ``total_output_cap`` is enforced by ``limits.guard_output``, which closes the
  connections holding the most (output and buffered input, ``held_bytes``). A closed
  connection drops its queued output at once.
- A durable write's response (``Pending``, sync_writes.py) waits in the queue until its
  durability level holds, its vbucket leaves active here or its deadline passes (then
  it becomes SYNC_WRITE_AMBIGUOUS, or ETMPFAIL without XERROR); later responses wait
  behind it, never past that deadline. The writer sleeps until the deadline of the entry
  that blocks it; while writes of a vbucket wait, the connection is in
  ``server.sync_waiters`` under that vbucket (sync_waiters.py), woken whenever the
  durability monitor's seqnos of that vbucket move (or after any flush). A replica's
  acks go with the stream that made them (active_stream.py ``release``).
- Limits are enforced by the third task, ``conn_timers.run_timers`` (idle and
  partial-frame timeouts, DCP noops).
- Bad input never escapes this connection: a malformed frame gets EINVAL (or, when the
  byte stream itself is broken, the connection is closed); nothing here raises into the
  server's nursery except a bug.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import trio

from ..protocol import codec
from ..protocol.opcodes import HelloFeature, Status, StreamEndStatus
from ..protocol.server_session import ServerSession
from .active_stream import ActiveStream, StreamOptions
from .conn_timers import run_timers
from .request_reader import read_requests
from .sync_writes import NEEDS_LOCAL_PERSISTENCE, Pending, error_frame, settle

if TYPE_CHECKING:
    from .dispatch import HandlerTable
    from .server import DcpServer

__all__ = ["Connection", "Pending", "error_frame"]

log = logging.getLogger("dcp.conn")
_ids = itertools.count(1)
_CONTINUATION_STEP = 32 * 1024
_NMVB = int(Status.NOT_MY_VBUCKET)


class Connection:
    def __init__(
        self, server: DcpServer, stream: trio.SocketStream, handlers: HandlerTable | None = None
    ) -> None:
        self.server = server
        #: what the reader dispatches to (None: the server's table, dispatch.py)
        self.handlers = handlers or server.handlers
        self.stream = stream
        self.id = next(_ids)
        try:
            self.peer = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:
            self.peer = "?"
        cfg = server.config
        self.opened_at = trio.current_time()
        #: the wire state: request framing, noops, flow control (dcp.protocol)
        self.session = ServerSession(
            max_body_size=cfg.max_item_size + 4096,
            noop_interval=cfg.noop_interval,
            started=self.opened_at,
        )
        # HELLO
        self.agent = ""
        self.features: set[int] = set()
        # DCP
        self.dcp_name: str | None = None
        self.dcp_flags = 0
        self.options = StreamOptions()
        self.cursor_dropping = True
        self.stream_end_on_close = False
        self.change_streams = False
        #: control ``consumer_name``: the node a replica's DCP_SEQNO_ACKNOWLEDGED speaks for
        self.consumer_name: str | None = None
        self.streams: dict[int, ActiveStream] = {}
        self.ready: dict[ActiveStream, None] = {}
        # Output
        self._responses: deque[Any] = deque()  # bytes | Pending | ActiveStream (announce)
        self._response_bytes = 0  # queued, not yet taken by the writer
        self._sending = 0  # the buffer the writer is sending
        self._pending_durable = 0  # Pending entries in the queue
        self._pending_persist = 0  # those that wait for this node's persistence
        self._durable_vbs: dict[int, int] = {}  # vb -> Pending entries of it queued
        self._blocked_until = math.inf  # deadline of the Pending the writer waits on
        self.continuation: Iterator[bytes] | None = None
        #: when the first byte of the incomplete frame at the end of the input arrived
        self.partial_since: float | None = None
        self._wake = trio.Event()
        self._space = trio.Event()
        self.closed = False
        self.close_reason = ""
        self.last_read = self.opened_at
        self.bytes_in = 0
        self.bytes_out = 0
        self._cancel = trio.CancelScope()

    # ------------------------------------------------------------------ queueing

    def respond(self, frame: bytes) -> None:
        self._responses.append(frame)
        self._response_bytes += len(frame)
        self._wake.set()

    def respond_when_durable(
        self,
        vbid: int,
        seqno: int,
        level: int,
        frame: bytes,
        opcode: int,
        opaque: int,
        timeout: float,
    ) -> None:
        """Queue ``frame`` for when the write of ``vbid`` at ``seqno`` holds at ``level``;
        ``timeout`` seconds from now, or at once if the vbucket leaves active here, the
        answer becomes SYNC_WRITE_AMBIGUOUS (ETMPFAIL if the client did not ask for
        extended errors): the write may or may not become durable (sync_writes.py)."""
        entry = Pending(
            vbid,
            seqno,
            level,
            self.server.durability.term(vbid),
            frame,
            opcode=opcode,
            opaque=opaque,
            timeout=timeout,
            xerror=HelloFeature.XERROR in self.features,
        )
        self._responses.append(entry)
        self._response_bytes += len(frame)
        self._pending_durable += 1
        if level in NEEDS_LOCAL_PERSISTENCE:
            self._pending_persist += 1
        n = self._durable_vbs.get(vbid, 0)
        if not n:
            self.server.sync_waiters.add(self, vbid)
        self._durable_vbs[vbid] = n + 1
        self._wake.set()

    def announce_stream(self, stream: ActiveStream) -> None:
        """Make ``stream`` ready once everything queued before it (its OK) has been sent."""
        self._responses.append(stream)
        self._wake.set()

    def error(self, opcode: int, status: int, opaque: int, message: str = "") -> None:
        """Queue an error response (see ``error_frame``). In cluster mode a NOT_MY_VBUCKET
        answer carries the bucket config instead of the context, as Couchbase's does:
        the client learns where the vbucket lives from the answer itself."""
        if status == _NMVB:
            config = self.server.cluster.nmvb_body()
            if config:
                self.respond(
                    codec.response(opcode, status, opaque=opaque, value=config, datatype=1)
                )
                return
        self.respond(error_frame(opcode, status, opaque, message))

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
                    nursery.start_soon(run_timers, self)
                    await read_requests(self)
                    nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError) as eg:
            # The peer reset or closed while a task was mid-send/receive; the tasks'
            # nursery wraps that in a group. It ends this connection only.
            self.close_reason = self.close_reason or f"socket: {eg.exceptions[0]!r}"
        finally:
            self.closed = True
            self._responses.clear()  # a shed or stalled connection frees its output now
            self._response_bytes = self._sending = self._pending_durable = 0
            self._pending_persist = 0
            self.server.sync_waiters.discard(self, self._durable_vbs)
            self._durable_vbs.clear()
            self.continuation = None
            self._release_streams()
            self.server.connection_closed(self)
            with trio.CancelScope(shield=True):
                with trio.move_on_after(1):
                    await self.stream.aclose()
            log.info(
                "connection closed id=%d peer=%s name=%s reason=%s",
                self.id,
                self.peer,
                self.dcp_name,
                self.close_reason or "client closed",
            )

    def _release_streams(self) -> None:
        for stream in list(self.streams.values()):
            self.server.stream_registry.remove(stream)
            stream.release()  # what it acknowledged no longer counts
        self.streams.clear()
        self.ready.clear()

    async def drain(self, timeout: float) -> None:
        """Give the writer a moment to send what is queued (used before closing)."""
        self._wake.set()
        with trio.move_on_after(timeout):
            while self._responses:
                await trio.sleep(0.01)

    # ------------------------------------------------------------------ output cap

    @property
    def frames_in(self) -> int:
        """Frames received and handled (the session counts them, fast path included)."""
        return self.session.frames_in

    @property
    def unsent_bytes(self) -> int:
        """Output this connection holds: queued answers and the buffer being sent."""
        return self._response_bytes + self._sending

    @property
    def held_bytes(self) -> int:
        """Memory this connection holds, as ``total_output_cap`` counts it: unsent output
        and received input not handled yet (``session.buffered``)."""
        return self._response_bytes + self._sending + self.session.buffered

    async def wait_for_output_space(self) -> None:
        """Wait until the writer has drained below ``connection_output_cap``. The server
        hears of it first: this connection may be one to shed (``total_output_cap``)."""
        cap = self.server.config.connection_output_cap
        if self.unsent_bytes > cap:
            self.server.output_pressure()
        while self.unsent_bytes > cap:
            self._space = trio.Event()
            await self._space.wait()

    def continue_with(self, chunks: Iterator[bytes]) -> None:
        """A handler's long answer: the reader queues ``chunks`` (``run_continuation``)
        before it handles the next request."""
        self.continuation = chunks

    async def run_continuation(self) -> None:
        """Queue the continuation's chunks, ~32 KiB at a time, yielding to the event
        loop between them and waiting for the writer at the output cap, so a long STAT
        neither stalls other clients nor grows past the cap."""
        chunks = self.continuation
        self.continuation = None
        if chunks is None:
            return
        cap = self.server.config.connection_output_cap
        batch = bytearray()
        for chunk in chunks:
            batch += chunk
            if len(batch) >= _CONTINUATION_STEP:
                self.respond(bytes(batch))
                batch = bytearray()
                if self.unsent_bytes > cap:
                    await self.wait_for_output_space()
                else:
                    await trio.lowlevel.checkpoint()
        if batch:
            self.respond(bytes(batch))

    # ------------------------------------------------------------------ writer

    def _take_responses(self, buf: bytearray, limit: int) -> None:
        q = self._responses
        self._blocked_until = math.inf
        while q and len(buf) < limit:
            entry = q[0]
            if entry.__class__ is bytes:
                buf += entry
                self._response_bytes -= len(entry)
            elif entry.__class__ is Pending:
                answer = settle(self.server, entry, self.peer)
                if answer is None:
                    # later responses wait (answers stay in request order), but only
                    # until this write's deadline: the writer wakes then
                    self._blocked_until = entry.deadline
                    break
                buf += answer
                self._response_bytes -= len(entry.frame)
                self._pending_durable -= 1
                if entry.level in NEEDS_LOCAL_PERSISTENCE:
                    self._pending_persist -= 1
                left = self._durable_vbs[entry.vbid] - 1
                if left:
                    self._durable_vbs[entry.vbid] = left
                else:
                    del self._durable_vbs[entry.vbid]
                    self.server.sync_waiters.discard(self, (entry.vbid,))
            else:  # a stream whose OK response is now out: it may start sending
                entry.announced = True
                self.ready[entry] = None
            q.popleft()

    def has_pending_durable(self) -> bool:
        """Whether a durable write waits for this node's persistence (the flusher
        hurries and wakes this connection after each flush; persistence.py)."""
        return self._pending_persist > 0

    async def _send(self, data: bytes | bytearray) -> None:
        """Write ``data``; while it is being written it counts as unsent output."""
        n = len(data)
        self._sending = n
        self.bytes_out += n
        await self.stream.send_all(data)
        self._sending = 0
        self.server.metrics.bytes_sent(n)
        if self._response_bytes <= self.server.config.connection_output_cap:
            self._space.set()

    async def _writer(self) -> None:
        limit = self.server.config.send_batch_bytes
        bl = self.session.flow
        q = self._responses
        while True:
            with trio.move_on_at(self._blocked_until):
                await self._wake.wait()
            self._wake = trio.Event()
            self._blocked_until = math.inf  # set again if a Pending still blocks
            while True:
                if q and q[0].__class__ is bytes and len(q[0]) >= limit:
                    big = q.popleft()  # a big answer (GET of a large value): no copy
                    self._response_bytes -= len(big)
                    await self._send(big)
                    continue
                buf = bytearray()
                if q:
                    self._take_responses(buf, limit)
                if self.ready and bl.can_send():
                    for stream in list(self.ready):
                        if len(buf) >= limit or not bl.can_send():
                            break
                        more = stream.fill(buf, bl, limit)
                        if not more:
                            self.ready.pop(stream, None)
                        if stream.is_dead:
                            self.stream_finished(stream)
                if not buf:
                    break
                await self._send(buf)

    def stream_finished(self, stream: ActiveStream) -> None:
        """``stream`` is over (ended, or closed by the client): forget it."""
        self.ready.pop(stream, None)
        if self.streams.get(stream.vbid) is stream:
            del self.streams[stream.vbid]
        self.server.stream_registry.remove(stream)

    # ------------------------------------------------------------------ shutdown

    def end_all_streams(self, status: StreamEndStatus) -> None:
        for stream in self.streams.values():
            if not stream.is_dead:
                stream.set_end(status)
                if stream.announced:
                    self.ready[stream] = None
        self._wake.set()

    def statistics(self) -> dict[str, Any]:
        session = self.session
        bl = session.flow.statistics()
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
            "noop_enabled": session.noop_enabled,
            "noop_interval": session.noop_interval,
            "noop_pending": session.noop_pending,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "queued_response_bytes": self._response_bytes,
            "unsent_bytes": self.unsent_bytes,
            "buffered_input_bytes": session.buffered,
            "paused": bool(self.streams) and bl.state.value == "full",
        }
