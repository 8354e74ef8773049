"""A scripted DCP source for replication tests: a trio TCP server on loopback that speaks
just enough DCP and lets the test decide, per stream request, what to send back.

Rules of this module:
- Built from ``dcp.protocol``'s codec and ``FrameReader`` only: it answers HELLO,
  DCP_OPEN, DCP_CONTROL, NOOP and CLOSE_STREAM with success and records them; every
  DCP_STREAM_REQ is handed to the test's ``script(conn, request, n)`` (``n``: how many
  requests came before), run as a task of that connection.
- DCP_SEQNO_ACKNOWLEDGED requests are recorded in ``seqno_acks`` and not answered
  (as a real producer), or answered ``ack_status`` when the test sets one; controls
  named in ``refuse_controls`` are refused (EINVAL).
- Responses from the replica (noop answers, DCP_SET_VBUCKET_STATE acks) are recorded
  and can be taken (oldest first) with ``conn.response(opcode, opaque)``; BUFFER_ACKs
  are summed.
- The test owns it with ``async with ScriptedProducer(script).running()``: every
  connection is closed when the block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import trio

from dcp.protocol import codec
from dcp.protocol.codec import StreamRequest
from dcp.protocol.frames import Frame, FrameReader
from dcp.protocol.opcodes import Opcode, Status

Script = Callable[["ProducerConn", StreamRequest, int], Awaitable[None]]


class ProducerConn:
    """One accepted connection."""

    def __init__(self, stream: trio.SocketStream, producer: ScriptedProducer) -> None:
        self.stream = stream
        self.producer = producer
        self.responses: list[Frame] = []
        self._changed = trio.Event()
        self._send_lock = trio.StrictFIFOLock()
        self.closed = False
        self.silent = False  # ignore everything the replica sends (a hung source)

    async def send(self, *frames: bytes) -> None:
        """Send (nothing if the replica already closed the connection)."""
        async with self._send_lock:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.stream.send_all(b"".join(frames))

    async def response(self, opcode: int, opaque: int, timeout: float = 10.0) -> Frame:
        with trio.fail_after(timeout):
            while True:
                for i, f in enumerate(self.responses):
                    if f.opcode == opcode and f.opaque == opaque:
                        return self.responses.pop(i)
                self._changed = trio.Event()
                await self._changed.wait()

    def got_response(self, f: Frame) -> None:
        self.responses.append(f)
        self._changed.set()


class ScriptedProducer:
    """See the module rules."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.port = 0
        self.connections = 0
        self.eofs = 0
        self.opens: list[tuple[str, int]] = []
        self.hellos: list[str] = []
        self.controls: list[tuple[str, str]] = []
        self.requests: list[StreamRequest] = []
        self.closes: list[int] = []
        self.buffer_acked = 0
        #: the DCP_SEQNO_ACKNOWLEDGED frames received, and the status they are answered
        #: with (SUCCESS: not answered, as a real producer)
        self.seqno_acks: list[Frame] = []
        self.ack_status = 0
        self.refuse_controls: set[str] = set()
        self.conns: list[ProducerConn] = []

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ScriptedProducer]:
        async with trio.open_nursery() as n:
            listeners = await n.start(partial(trio.serve_tcp, self._serve, 0, host="127.0.0.1"))
            self.port = listeners[0].socket.getsockname()[1]
            yield self
            n.cancel_scope.cancel()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = ProducerConn(stream, self)
        self.conns.append(conn)
        reader = FrameReader()
        try:
            async with trio.open_nursery() as n:
                while data := await _receive(stream):
                    reader.feed(data)
                    for f in reader.read_frames():
                        await self._frame(conn, f, n)
                self.eofs += 1
                n.cancel_scope.cancel()
        finally:
            conn.closed = True
            await trio.aclose_forcefully(stream)

    async def _frame(self, conn: ProducerConn, f: Frame, n: trio.Nursery) -> None:
        if conn.silent:
            return
        if f.magic == 0x81:
            conn.got_response(f)
            return
        op = f.opcode
        ok = codec.response(op, opaque=f.opaque)
        if op == Opcode.HELLO:
            self.hellos.append(bytes(f.key).decode())
        elif op == Opcode.DCP_OPEN:
            name, flags = codec.parse_open(f)
            self.opens.append((name.decode(), flags))
        elif op == Opcode.DCP_CONTROL:
            key = bytes(f.key).decode()
            self.controls.append((key, bytes(f.value).decode()))
            if key in self.refuse_controls:
                ok = codec.response(op, Status.EINVAL, opaque=f.opaque)  # an older source
        elif op == Opcode.DCP_STREAM_REQ:
            req = codec.parse_stream_request(f)
            count = len([r for r in self.requests if r.vbucket == req.vbucket])
            self.requests.append(req)
            n.start_soon(self.script, conn, req, count)
            return
        elif op == Opcode.DCP_CLOSE_STREAM:
            self.closes.append(f.vbucket)
        elif op == Opcode.DCP_BUFFER_ACK:
            self.buffer_acked += codec.parse_buffer_ack(f)
            return
        elif op == Opcode.DCP_SEQNO_ACKNOWLEDGED:
            self.seqno_acks.append(f)
            if self.ack_status:
                await conn.send(codec.response(op, self.ack_status, opaque=f.opaque))
            return
        await conn.send(ok)


async def _receive(stream: trio.SocketStream) -> bytes:
    """The next bytes; b"" at the end, a reset connection included."""
    try:
        return await stream.receive_some(65536)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return b""


def stream_ok(req: StreamRequest, log: list[tuple[int, int]]) -> bytes:
    return codec.response(
        Opcode.DCP_STREAM_REQ, opaque=req.opaque, value=codec.failover_log_value(log)
    )


def mutations(vb: int, opaque: int, *seqnos: int) -> bytes:
    return b"".join(
        codec.mutation(vb, opaque, s, 1, b"key%d" % s, b"value%d" % s, cas=1000 + s) for s in seqnos
    )
