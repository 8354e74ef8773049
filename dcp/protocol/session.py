"""The client side of a DCP / KV connection, sans I/O: bytes in, events out; calls in,
bytes out.

Rules of this module:
- ``ClientSession`` owns everything a client must get right on the wire and nothing
  about sockets, tasks or clocks: header validation (the rules of
  ``frames.FrameReader``: known magic, body <= ``max_body_size``, framing extras +
  extras + key <= body, checked before a body is awaited), opaque allocation and
  matching, stream-request answers, snapshot boundaries, noop replies and flow-control
  accounting with its buffer acks. The I/O shell feeds ``receive_data(bytes)``, handles
  the returned events (``events.py``) and sends ``data_to_send()``; request methods
  return ``(opaque, bytes)`` for the shell to send. "Need more data" is an empty list.
- After a ``RemoteProtocolError`` the session is broken for good (the stream position
  is unknown): the shell must close the connection.
- A run of change items of one stream's open snapshot inside one ``receive_data`` call
  comes out as ONE ``Items`` event, decoded in one loop with locals bound (one
  ``unpack_from`` of header + extras per mutation); anything rarer is built as a
  ``Frame`` and handled in ``on_frame``. The item classes are parameters, so a client
  that wants its own item objects pays nothing for a conversion. With ``item_frames``
  such a run comes out as ONE ``ItemFrames`` (its frames' offsets in the received
  bytes, decoded by ``decode_frames.py``) for a client that decodes runs itself; the
  rare items that reach ``on_frame`` still come as ``Items``.
- Snapshots: a marker opens one (its end clamped to the stream's end seqno); an item at
  or past the end, the next marker, SEQNO_ADVANCED reaching the end, or STREAM_END(OK)
  completes it (``SnapshotDone``); another STREAM_END reason discards it. An item of a
  streaming stream outside any snapshot is a protocol error unless it lies past the
  end seqno asked for (a server that does not clamp).
- Flow control (``flow_control.py``): every received request but DCP_NOOP counts; bytes
  of an open snapshot are held until it completes, then queued until the shell reports
  them ``handed``; everything else is ackable at once. With ``queue_per_chunk`` (a shell
  that delivers per received chunk) every counted byte of a call is queued, and the
  call's total is in ``counted``. Acks due after a call are put in ``data_to_send()``.
- Late messages of a stream the session does not know (never requested, ended, or
  ``forget``-ten) are counted for flow control and otherwise ignored.
- ``_streaming`` (``session_stream.StreamingIndex``) finds a vbucket's STREAMING
  stream, so ``seqno_acknowledged``, called for every snapshot a replica applies, is a
  dict lookup, not a scan of a replication connection's hundreds of streams. Every
  acceptance and every removal from ``streams`` goes through it.
- This file does not know the server side; a server session can live beside it with
  the same ``receive_data``/``data_to_send`` shape.
"""

from __future__ import annotations

from typing import Any

from . import codec
from .decode import decode
from .decode_frames import decode_frames
from .errors import RemoteProtocolError
from .events import (
    Answer,
    Deletion,
    Expiration,
    Items,
    Marker,
    Mutation,
    SeqnoAdvanced,
    SnapshotDone,
    StreamEnded,
    StreamOpened,
    StreamRefused,
    StreamRollback,
    VBucketStateSet,
)
from .flow_control import FlowControl
from .frames import DEFAULT_MAX_BODY_SIZE, Frame
from .layout import MUTATION_SEQNO, RESPONSE_MAGIC, U64
from .opcodes import SEQNO_MAX, Opcode, Status, StreamEndStatus
from .session_stream import REQUESTED, STREAMING, SessionStream, StreamingIndex

__all__ = ["ClientSession", "SessionStream"]

_SEQNO = MUTATION_SEQNO.unpack_from
_U64 = U64.unpack_from
_ONE, _STAT, _WRITE = 0, 1, 2  # how a tracked opaque is answered


class ClientSession:
    """See the module rules. ``window`` 0 disables flow control (no acks)."""

    def __init__(
        self,
        *,
        window: int = 0,
        ack_ratio: float = 0.2,
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
        queue_per_chunk: bool = False,
        mutation: Any = Mutation,
        deletion: Any = Deletion,
        expiration: Any = Expiration,
        item_frames: bool = False,
    ) -> None:
        self.flow = FlowControl(window, ack_ratio)
        self.flow.release = self._release_held
        self.max_body_size = max_body_size
        self.streams: dict[int, SessionStream] = {}  # by opaque
        self._streaming = StreamingIndex()  # STREAMING streams by vbucket (module rules)
        self.counted = 0  # counted bytes of the last receive_data (see queue_per_chunk)
        self.noops = 0  # DCP_NOOPs answered
        self.acks = 0  # buffer acks produced
        self.queue_per_chunk = queue_per_chunk
        #: item classes (or any callables with their signatures) the decoder builds
        self.mutation = mutation
        self.deletion = deletion
        self.expiration = expiration
        #: runs of items as ``ItemFrames`` (module rules); chosen once, not per frame
        self.item_frames = item_frames
        self._decode = decode_frames if item_frames else decode
        self._answers: dict[int, int] = {}
        self._opaque = 0
        self._out = bytearray()
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._need = 24
        self._broken: str | None = None
        self._acking = False  # a SEQNO_ACKNOWLEDGED was sent: its refusals are Answers

    # ------------------------------------------------------------------ requests

    def next_opaque(self) -> int:
        self._opaque = (self._opaque + 1) & 0xFFFFFFFF or 1
        return self._opaque

    def expect(self, opaque: int, *, stat: bool = False) -> int:
        """Match the answer to a request with ``opaque`` built by the caller (``Answer``);
        ``stat``: a STAT answer, one response per pair up to the one with an empty key."""
        self._answers[opaque] = _STAT if stat else _ONE
        return opaque

    def request(self, opcode: int, *, stat: bool = False, **fields: Any) -> tuple[int, bytes]:
        """A request (``codec.request`` fields) whose answer becomes an ``Answer``."""
        o = self.expect(self.next_opaque(), stat=stat)
        return o, codec.request(opcode, opaque=o, **fields)

    def pipeline(self, frames: list[bytes]) -> tuple[list[int], bytearray]:
        """Requests encoded with opaque 0, one buffer with a fresh opaque patched into
        each; a write answered SUCCESS comes back as a ``(cas, vb_uuid, seqno)`` tuple."""
        buf = bytearray()
        opaques = []
        answers = self._answers
        put = codec.U32.pack_into
        for data in frames:
            o = self.next_opaque()
            answers[o] = _WRITE
            p = len(buf)
            buf += data
            put(buf, p + 12, o)
            opaques.append(o)
        return opaques, buf

    def stream_request(
        self,
        vbucket: int,
        *,
        start: int = 0,
        end: int = SEQNO_MAX,
        vb_uuid: int = 0,
        snap_start: int = 0,
        snap_end: int = 0,
        flags: int = 0,
        value: bytes = b"",
    ) -> tuple[int, bytes]:
        """DCP_STREAM_REQ; answered by ``StreamOpened``/``StreamRollback``/``StreamRefused``."""
        o = self.next_opaque()
        data = codec.stream_request(
            vbucket,
            o,
            flags=flags,
            start=start,
            end=end,
            vb_uuid=vb_uuid,
            snap_start=snap_start,
            snap_end=snap_end,
            value=value,
        )
        old = self.streams.get(o)
        self.streams[o] = SessionStream(o, vbucket, end)
        if old is not None:  # the opaque wrapped onto a stream still tracked
            self._streaming.dropped(old, self.streams)
        return o, data

    def close_stream(self, vbucket: int) -> tuple[int, bytes]:
        """DCP_CLOSE_STREAM: its ``Answer``, then (if a stream was open) ``StreamEnded``."""
        return self.request(Opcode.DCP_CLOSE_STREAM, vbucket=vbucket)

    def forget(self, opaque: int) -> None:
        """Stop tracking a stream: its late messages only count for flow control."""
        st = self.streams.pop(opaque, None)
        if st is None:
            return
        self._streaming.dropped(st, self.streams)
        if st.open:
            self._discard(st)

    def ack_state(self, event: VBucketStateSet) -> bytes:
        """The consumer's answer to a DCP_SET_VBUCKET_STATE once it applied the state:
        the producer of a takeover waits for it before its next step."""
        return codec.response(Opcode.DCP_SET_VBUCKET_STATE, opaque=event.opaque)

    def seqno_acknowledged(
        self, vbucket: int, seqno: int, persisted: int | None = None
    ) -> bytes | None:
        """DCP_SEQNO_ACKNOWLEDGED for ``vbucket``'s accepted stream (its opaque, as the
        producer requires), or None when no stream of this session streams it: an ack
        under another opaque would be ignored. A replica sends it after applying a whole
        snapshot and when its persisted seqno moves (protocol_spec/README.md §5.10)."""
        st = self._streaming.get(vbucket)
        if st is None:
            return None
        self._acking = True
        return codec.seqno_acknowledged(vbucket, st.opaque, seqno, persisted)

    def probe(self) -> bytes:
        """A plain NOOP to see whether the server is alive (any answer will do)."""
        return codec.request(Opcode.NOOP, opaque=self.next_opaque())

    # ------------------------------------------------------------------ flow control

    def ack(self, nbytes: int) -> bytes:
        """The BUFFER_ACK frame for ``nbytes`` that flow control released (counted)."""
        self.acks += 1
        return codec.buffer_ack(nbytes)

    def handed(self, nbytes: int) -> bytes:
        """Queued bytes reached the application: the ack now due (b"" if none)."""
        n = self.flow.handed(nbytes)
        return self.ack(n) if n else b""

    def data_to_send(self) -> bytes:
        """Noop replies and buffer acks produced by ``receive_data`` (b"" if none)."""
        out, self._out = self._out, bytearray()
        return bytes(out)

    def _release_held(self) -> int:
        freed = 0
        for st in self.streams.values():
            freed += st.held
            st.held = 0
        return freed

    def complete_snapshot(self, st: SessionStream) -> SnapshotDone:
        """The open snapshot of ``st`` is whole: its held bytes become queued."""
        held = st.held
        fc = self.flow
        fc.held -= held
        fc.queued += held
        st.held = 0
        st.open = False
        return SnapshotDone(st.opaque, st.vbucket, held)

    def _discard(self, st: SessionStream) -> None:
        fc = self.flow
        fc.held -= st.held
        fc.ackable += st.held
        st.held = 0
        st.open = False

    # ------------------------------------------------------------------ receiving

    def receive_data(self, data: bytes | bytearray | memoryview) -> list:
        """Decode every complete frame received so far; return its events (see module).

        Raises:
            RemoteProtocolError: a frame breaks the protocol; the session is broken.
        """
        if self._broken is not None:
            raise RemoteProtocolError(f"session already broken: {self._broken}")
        if data:
            self._pending.append(bytes(data))
            self._pending_len += len(data)
        self.counted = 0
        if self._pending_len < self._need:
            return []
        pending = self._pending
        buf = pending[0] if len(pending) == 1 else b"".join(pending)
        out: list = []
        try:
            pos, self._need, snap, uncounted = self._decode(self, buf, out)
        except RemoteProtocolError as exc:
            self._broken = str(exc)
            self._pending, self._pending_len = [], 0
            raise
        rest = buf[pos:] if pos < len(buf) else b""
        self._pending = [rest] if rest else []
        self._pending_len = len(rest)
        counted = pos - uncounted
        fc = self.flow
        if self.queue_per_chunk:
            fc.queued += counted
        else:
            fc.held += snap
            fc.ackable += counted - snap
        self.counted = counted
        n = fc.after_receive()
        if n:
            self._out += self.ack(n)
        return out

    def on_frame(self, f: Frame, size: int, out: list) -> int:
        """Every frame but the runs of items and the V1 markers the decoder handles
        itself (``decode.py``); ``size``: its wire bytes. Returns the bytes it made
        flow control hold (an open snapshot's)."""
        magic = f.magic
        if magic in RESPONSE_MAGIC:
            self._response(f, out)
            return 0
        if magic == 0x82:  # a server request: nothing we act on
            return 0
        op = f.opcode
        if op == Opcode.DCP_NOOP:
            self._out += codec.response(Opcode.DCP_NOOP, opaque=f.opaque)
            self.noops += 1
            return 0
        st = self.streams.get(f.opaque)
        if st is None or st.state != STREAMING:
            return 0  # a late message of a stream we do not track: counted, ignored
        held = 0 if self.queue_per_chunk else size
        if op == Opcode.DCP_SNAPSHOT_MARKER:
            s, e, flags, _mvs, _hcs = codec.parse_snapshot_marker(f)
            if st.open:
                out.append(self.complete_snapshot(st))
            st.end = e if e < st.end_seqno else st.end_seqno
            st.open = True
            purge = None
            if len(f.extras) == 1 and f.extras[0] == 2 and len(f.value) == 52:
                purge = _U64(f.value, 36)[0]
            st.held += held
            out.append(Marker(st.opaque, st.vbucket, s, st.end, flags, purge))
            return held
        elif op in (Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION):
            # a data message outside a snapshot, or one in alt framing (the item carries
            # its header's vbucket, as decode.py's do)
            vb = f.vbucket
            if op == Opcode.DCP_MUTATION:
                by, rev, flg, exp, lk = codec.parse_mutation(f)
                item = self.mutation(vb, by, rev, f.cas, flg, exp, lk, f.datatype, f.key, f.value)
            elif op == Opcode.DCP_DELETION:
                by, rev, dtime = codec.parse_deletion(f)
                item = self.deletion(vb, by, rev, f.cas, f.datatype, f.key, f.value, dtime)
            else:
                by, rev, dtime = codec.parse_expiration(f)
                item = self.expiration(vb, by, rev, f.cas, f.key, dtime)
            if not st.open:
                if by > st.end_seqno:
                    return 0  # past the end we asked for (a server that does not clamp)
                raise RemoteProtocolError(
                    f"vb {vb}: opcode 0x{op:02x} seqno {by} outside any snapshot"
                )
            st.held += held
            out.append(Items(st.opaque, vb, [item], size))
            if by >= st.end:
                out.append(self.complete_snapshot(st))
            return held
        elif op == Opcode.DCP_STREAM_END:
            reason = codec.parse_stream_end(f)
            if st.open:
                if reason == StreamEndStatus.OK:
                    out.append(self.complete_snapshot(st))
                else:
                    self._discard(st)
            del self.streams[st.opaque]
            self._streaming.dropped(st, self.streams)
            out.append(StreamEnded(st.opaque, st.vbucket, reason))
        elif op == Opcode.DCP_SEQNO_ADVANCED:
            seqno = codec.parse_seqno_advanced(f)
            out.append(SeqnoAdvanced(st.opaque, st.vbucket, seqno))
            if st.open:
                st.held += held
                if seqno >= st.end:
                    out.append(self.complete_snapshot(st))
                return held
        elif op == Opcode.DCP_SET_VBUCKET_STATE:
            if st.open:
                raise RemoteProtocolError(
                    f"vb {st.vbucket}: DCP_SET_VBUCKET_STATE inside an open snapshot"
                )
            out.append(VBucketStateSet(st.opaque, st.vbucket, codec.parse_dcp_set_vbucket_state(f)))
        # anything else (system events): counted, acked, ignored
        return 0

    def _response(self, f: Frame, out: list) -> None:
        o = f.opaque
        if f.opcode == Opcode.DCP_STREAM_REQ:
            st = self.streams.get(o)
            if st is not None and st.state == REQUESTED:
                out.append(self._stream_answer(st, f))
                return
        if f.opcode == Opcode.DCP_SEQNO_ACKNOWLEDGED and self._acking:
            # only a refusal is ever answered (an older source, a missing consumer_name):
            # the replica must see it to stop acknowledging
            out.append(Answer(o, f))
            return
        kind = self._answers.get(o)
        if kind is None:
            return  # an answer nobody waits for (a probe's, or a late one)
        if kind == _WRITE:
            del self._answers[o]
            if f.status == Status.SUCCESS and f.magic == 0x81 and not f.key and not f.value:
                if len(f.extras) == 16:
                    out.append(Answer(o, (f.cas, *_SEQNO(f.extras))))
                    return
                if not f.extras:
                    out.append(Answer(o, (f.cas, None, None)))
                    return
        elif kind == _ONE or not f.key or f.status != Status.SUCCESS:
            del self._answers[o]
        out.append(Answer(o, f))

    def _stream_answer(
        self, st: SessionStream, f: Frame
    ) -> StreamOpened | StreamRollback | StreamRefused:
        status = f.status
        if status == Status.SUCCESS:
            self._streaming.accepted(st, self.streams)
            return StreamOpened(
                st.opaque, st.vbucket, tuple(codec.parse_failover_log(bytes(f.value)))
            )
        del self.streams[st.opaque]
        self._streaming.dropped(st, self.streams)
        if status == Status.ROLLBACK:
            if len(f.value) < 8:
                raise RemoteProtocolError(f"vb {st.vbucket}: ROLLBACK without an 8-byte seqno")
            return StreamRollback(st.opaque, st.vbucket, _U64(f.value, 0)[0])
        return StreamRefused(st.opaque, st.vbucket, status, bytes(f.value))
