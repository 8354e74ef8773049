"""The server side of a DCP / KV connection, sans I/O: bytes in, requests out; state
changes in, bytes out.

Rules of this module:
- ``ServerSession`` owns what a server must get right on one connection's wire and
  nothing about sockets, tasks, clocks or what a request means:
    * framing of the client's bytes with the rules of ``frames.FrameReader`` (known
      magic, body <= ``max_body_size``, framing extras + extras + key <= body), each
      header checked before its body is awaited. A frame that breaks them raises
      ``RemoteProtocolError`` and the session is broken for good (the stream position
      is unknown): the shell answers once and closes the connection;
    * DCP noops: enabled and interval (control keys), whether one is unanswered and its
      opaque; ``noop_due`` builds the DCP_NOOP request, the client's answer is matched
      by that opaque (any other noop answer is stale and ignored);
    * flow control: ``flow`` (``buffer_log.BufferLog``), its window from the
      ``connection_buffer_size`` control key and its acks from DCP_BUFFER_ACK;
    * the client's responses to what the server sent: absorbed (noop answers, successes)
      or reported as ``Rejected`` (an error answer to a DCP message); a SUCCESS answer
      to DCP_SET_VBUCKET_STATE is reported as ``StateAcked``, because a takeover
      stream waits for it before it goes on.
- Pull-driven, because the shell must be able to stop between any two requests (an
  output cap, a long answer to finish first): ``feed`` buffers bytes, ``next_event``
  returns one event or None ("need more data"). ``receive_data`` does both for shells
  that take every event at once.
- Events: a client request comes out as its ``frames.Frame`` (what request handlers take:
  no wrapper object per request); ``events.Rejected`` and ``events.StateAcked`` as
  above. Nothing else surfaces.
- Pipelined ingest keeps its per-item cost: when the next buffered frame is a SET request
  (magic 0x80, opcode 0x01), ``set_run`` hands the shell the buffer and position before
  any ``Frame`` is built; the shell applies as many SETs in place as it can, checking
  each header with at least the rules above, and reports them with ``consumed``.
- The session counts every frame it or the fast path consumed (``frames_in``) and knows
  what is buffered (``buffered``, ``wants_data``) so the shell can time partial frames
  and count the input memory a connection holds.
- Buffering costs linear time: an incomplete frame that arrives over many reads is kept
  as those reads and joined once, when it is complete; a read that completes a frame is
  appended to the (short) tail as before.
- No I/O, no clock (callers pass ``now``), no trio.
"""

from __future__ import annotations

from . import codec
from .buffer_log import BufferLog
from .errors import RemoteProtocolError
from .events import Rejected, StateAcked
from .frames import DEFAULT_MAX_BODY_SIZE, Frame
from .layout import ALT_MAGIC, HEADER, HEADER_SIZE, KNOWN_MAGIC
from .opcodes import Magic, Opcode, Status

__all__ = ["SESSION_CONTROLS", "ServerSession"]

_HDR = HEADER.unpack_from
#: What a server takes for a client's answer: 0x82/0x83 frames from a client are
#: dispatched by opcode like requests (and answered UNKNOWN_COMMAND).
_ANSWERS = frozenset((int(Magic.RESPONSE), int(Magic.ALT_RESPONSE)))
_NOOP = int(Opcode.DCP_NOOP)
_SUCCESS = int(Status.SUCCESS)
_SET_STATE = int(Opcode.DCP_SET_VBUCKET_STATE)
#: DCP messages a client may refuse (kv_engine closes the connection when it does).
_DCP_MESSAGES = frozenset(
    (*range(int(Opcode.DCP_STREAM_END), int(Opcode.DCP_EXPIRATION) + 1), _SET_STATE)
)
_BOOL = {"true": True, "false": False}

#: DCP_CONTROL keys whose state the session owns (``ServerSession.control``).
SESSION_CONTROLS = frozenset(("enable_noop", "set_noop_interval", "connection_buffer_size"))


class ServerSession:
    """See the module rules. ``started``: the clock reading the noop interval starts at."""

    __slots__ = (
        "_broken",
        "_buf",
        "_chunked",
        "_chunks",
        "_need",
        "_pos",
        "flow",
        "frames_in",
        "max_body_size",
        "noop_enabled",
        "noop_interval",
        "noop_opaque",
        "noop_pending",
        "noop_sent_at",
        "noops_sent",
    )

    def __init__(
        self,
        *,
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
        noop_interval: float = 20.0,
        started: float = 0.0,
    ) -> None:
        self.max_body_size = max_body_size
        self.flow = BufferLog()
        self.frames_in = 0
        self.noop_enabled = False
        self.noop_interval = noop_interval
        self.noop_pending = False
        self.noop_opaque = 0
        self.noops_sent = 0
        self.noop_sent_at = started
        self._buf = b""
        self._pos = 0
        self._need = HEADER_SIZE  # bytes (from _pos) needed before framing can progress
        # An incomplete frame arriving over many reads is kept as its reads (joined once,
        # when complete), not re-copied per read: quadratic for a big frame that trickles.
        self._chunks: list[bytes] = []
        self._chunked = 0  # bytes in _chunks
        self._broken: str | None = None

    # ------------------------------------------------------------------ receiving

    @property
    def buffered(self) -> int:
        """Bytes received and not consumed yet (an incomplete frame, or frames held): the
        input memory this connection holds."""
        return len(self._buf) - self._pos + self._chunked

    def wants_data(self) -> bool:
        """True when no complete frame can be buffered: ``next_event`` would say None."""
        return len(self._buf) - self._pos + self._chunked < self._need

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer received bytes (``next_event`` frames them).

        Raises:
            RemoteProtocolError: the session is already broken.
        """
        if self._broken is not None:
            raise RemoteProtocolError(f"session already broken: {self._broken}")
        if self._chunks:  # collecting an incomplete frame
            self._chunks.append(bytes(data))
            self._chunked += len(data)
            if self._chunked >= self._need:
                self._buf = b"".join(self._chunks)
                self._chunks = []
                self._chunked = 0
            return
        tail = len(self._buf) - self._pos
        if not tail:
            self._buf = bytes(data)  # the common case: the last read ended on a frame
        elif tail + len(data) >= self._need:
            self._buf = self._buf[self._pos :] + data
        else:  # still incomplete: start collecting its reads
            self._chunks = [self._buf[self._pos :], bytes(data)]
            self._chunked = tail + len(data)
            self._buf = b""
        self._pos = 0

    def receive_data(self, data: bytes | bytearray | memoryview) -> list:
        """``feed`` and every event that is complete now (see module rules)."""
        self.feed(data)
        out = []
        while (ev := self.next_event()) is not None:
            out.append(ev)
        return out

    def set_run(self) -> tuple[bytes, int, int] | None:
        """``(buffer, position, end)`` when the next buffered frame has a SET request's
        magic and opcode, for the shell's fast path (then ``consumed``); else None."""
        buf = self._buf
        pos = self._pos
        if len(buf) - pos >= HEADER_SIZE and buf[pos + 1] == 0x01 and buf[pos] == 0x80:
            return buf, pos, len(buf)
        return None

    def consumed(self, pos: int, count: int) -> None:
        """The fast path consumed ``count`` whole frames, up to ``pos`` of ``set_run``'s
        buffer."""
        self._pos = pos
        self.frames_in += count
        self._need = HEADER_SIZE

    def _fail(self, why: str) -> RemoteProtocolError:
        self._broken = why
        return RemoteProtocolError(why)

    def next_event(self) -> Frame | Rejected | StateAcked | None:
        """The next request (its ``Frame``), ``Rejected`` or ``StateAcked``; None when more
        data is needed.

        Raises:
            RemoteProtocolError: bad magic, inconsistent lengths or an oversize body; the
                session is broken.
        """
        if self._broken is not None:
            raise RemoteProtocolError(f"session already broken: {self._broken}")
        buf = self._buf
        pos = self._pos
        n = len(buf)
        while n - pos >= self._need:
            magic, op, kl, el, dt, vb, body, opq, cas = _HDR(buf, pos)
            if magic in ALT_MAGIC:
                fel = kl >> 8
                kl &= 0xFF
            elif magic in KNOWN_MAGIC:
                fel = 0
            else:
                self._pos = pos
                raise self._fail(f"bad magic 0x{magic:02x} at opcode 0x{op:02x}")
            if body > self.max_body_size:
                self._pos = pos
                raise self._fail(
                    f"body of {body} bytes exceeds the limit of "
                    f"{self.max_body_size} (opcode 0x{op:02x})"
                )
            if fel + el + kl > body:
                self._pos = pos
                raise self._fail(
                    f"framing extras {fel} + extras {el} + key {kl} exceed body length "
                    f"{body} (opcode 0x{op:02x})"
                )
            end = pos + HEADER_SIZE + body
            if end > n:
                self._need = HEADER_SIZE + body
                break
            self._need = HEADER_SIZE
            self.frames_in += 1
            a = pos + HEADER_SIZE
            b = a + fel
            c = b + el
            d = c + kl
            frame = Frame(
                magic,
                op,
                dt,
                vb,
                opq,
                cas,
                buf[a:b] if fel else b"",
                buf[b:c],
                buf[c:d],
                buf[d:end],
            )
            pos = end
            if magic in _ANSWERS:
                ev = self._answer(frame)
                if ev is None:
                    continue
                self._pos = pos
                return ev
            self._pos = pos
            return frame
        # nothing complete: keep only the unconsumed tail (less than one frame)
        if pos:
            self._buf = buf[pos:] if pos < n else b""
            self._pos = 0
        else:
            self._pos = pos
        return None

    def _answer(self, f: Frame) -> Rejected | StateAcked | None:
        op = f.opcode
        if op == _NOOP:
            if self.noop_pending and f.opaque == self.noop_opaque:
                self.noop_pending = False
            return None
        if f.vbucket != _SUCCESS:
            return Rejected(f.opaque, op, f.vbucket) if op in _DCP_MESSAGES else None
        if op == _SET_STATE:
            return StateAcked(f.opaque)
        return None

    # ------------------------------------------------------------------ DCP state

    def control(self, key: str, value: str) -> str:
        """Apply a DCP_CONTROL key of ``SESSION_CONTROLS`` (``value`` stripped of blanks);
        returns "" when applied, else why the value is refused (the state is unchanged)."""
        if key == "enable_noop":
            flag = _BOOL.get(value.lower())
            if flag is None:
                return "expected true or false"
            self.noop_enabled = flag
        elif key == "set_noop_interval":
            try:
                secs = float(value)
            except ValueError:
                return "expected seconds"
            if not 0.1 <= secs <= 10800:
                return "interval must be 0.1..10800 seconds"
            self.noop_interval = secs
        elif key == "connection_buffer_size":
            if not value.isdigit() or int(value) > 0xFFFFFFFF:
                return "expected a byte count (uint32)"
            self.flow.set_window(int(value))
        else:
            raise KeyError(f"{key} is not a session control key")
        return ""

    def buffer_ack(self, f: Frame) -> int:
        """Apply a DCP_BUFFER_ACK request; returns the bytes it acknowledged.

        Raises:
            RemoteProtocolError: its extras are not one uint32.
        """
        nbytes = codec.parse_buffer_ack(f)
        self.flow.ack(nbytes)
        return nbytes

    def noop_due(self, now: float, streaming: bool) -> bytes:
        """The DCP_NOOP request to send at ``now``, or b"": noops are enabled, the last
        one was answered, ``noop_interval`` has passed since it was sent, and the
        connection has a stream (``streaming``) or has sent noops before."""
        if not self.noop_enabled or self.noop_pending or not (streaming or self.noops_sent):
            return b""
        if now - self.noop_sent_at < self.noop_interval:
            return b""
        self.noop_pending = True
        self.noop_opaque = (self.noop_opaque + 1) & 0xFFFFFFFF
        self.noops_sent += 1
        self.noop_sent_at = now
        return codec.request(Opcode.DCP_NOOP, opaque=self.noop_opaque)
