"""Every frame but the data fast path of ``StreamReader``: markers that arrive alone,
stream ends, SEQNO_ADVANCED, noops, responses, stream-request answers.

Rules of this module:
- ``ControlFrames`` is a mixin of ``StreamReader`` (itself the reading half of
  ``DcpConnection``): its methods use the connection's state and the reader's per-chunk
  counters (``_uncounted``, ``_slow_snap``, ``_replies``) exactly as ``_read_loop``
  expects; reader.py's rules apply. Nothing here awaits.
- Each frame arrives as a validated ``Frame`` built by ``_slow``; one that breaks the
  protocol raises ``RemoteProtocolError`` (the connection is dropped and reopened).
- Stream-request answers: OK adopts the failover log; ROLLBACK resets the session state
  and emits a ``RollbackEvent`` (or raises ``RollbackError`` under the fail policy);
  NOT_MY_VBUCKET/ETMPFAIL/EBUSY/ENOMEM are retried with backoff until the retry timeout;
  anything else is a ``StreamError``.
"""

from __future__ import annotations

import struct
from typing import Any

import trio

from dcp.protocol import codec
from dcp.protocol.errors import RemoteProtocolError, for_status
from dcp.protocol.frames import Frame
from dcp.protocol.opcodes import Opcode, Status, StreamEndStatus

from .delivery import CommitPoint
from .errors import RetryTimeoutError, RollbackError, StreamError
from .rollback import RollbackPolicy
from .snapshot_buffer import StreamBuffer, StreamState
from .structs import Deletion, Expiration, Mutation, SnapshotMarker, StreamEnd

__all__ = ["ControlFrames"]

_U64 = struct.Struct(">Q").unpack_from
_KNOWN_MAGIC = frozenset((0x80, 0x81, 0x82, 0x83))
_RETRIABLE = frozenset((Status.NOT_MY_VBUCKET, Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM))
_FATAL_END = frozenset((StreamEndStatus.FILTER_EMPTY, StreamEndStatus.LOST_PRIVILEGES))
_STREAMING = StreamState.STREAMING


class ControlFrames:
    """The rare frames of a DCP connection's reader (see the module rules)."""

    __slots__ = ()
    # provided by StreamReader / DcpConnection
    _uncounted: int
    _slow_snap: int
    _replies: bytearray | None
    _streams: dict[int, StreamBuffer]
    _by_vb: dict[int, StreamBuffer]
    _rpcs: dict[int, Any]
    _retries: dict[int, tuple[float, int]]
    _commit_fn: Any
    cfg: Any
    delivery: Any
    fc: Any
    made_progress: bool
    session: Any
    stats: dict[str, int]

    def _slow(
        self, buf: bytes, pos: int, end: int, magic: int, op: int, kl: int, el: int, dt: int,
        vb: int, body: int, opq: int, cas: int, out: list, raw_out: list | None,
    ) -> None:
        """Every frame that is not an ordinary mutation/deletion of an open snapshot."""
        if magic == 0x08 or magic == 0x18:
            fel = kl >> 8
            kl &= 0xFF
        elif magic in _KNOWN_MAGIC:
            fel = 0
        else:
            raise RemoteProtocolError(f"bad magic 0x{magic:02x} (opcode 0x{op:02x})")
        if fel + el + kl > body:
            raise RemoteProtocolError(
                f"framing extras {fel} + extras {el} + key {kl} exceed body length {body} "
                f"(opcode 0x{op:02x})")
        a = pos + 24
        b = a + fel
        c = b + el
        d = c + kl
        f = Frame(magic, op, dt, vb, opq, cas, buf[a:b], buf[b:c], buf[c:d], buf[d:end])
        size = end - pos
        if magic == 0x81 or magic == 0x18 or magic == 0x83:
            self._uncounted += size
            self._on_response(f, out, raw_out)
            return
        if magic == 0x82:
            self._uncounted += size
            return
        if op == Opcode.DCP_NOOP:
            self._uncounted += size
            if self._replies is None:
                self._replies = bytearray()
            self._replies += codec.response(Opcode.DCP_NOOP, opaque=opq)
            self.stats["noops"] += 1
            return
        st = self._streams.get(opq)
        if st is None or st.state != _STREAMING:
            return  # an abandoned stream's late message: only flow control cares
        emit = out.append if raw_out is None else raw_out.append
        if op == Opcode.DCP_SNAPSHOT_MARKER:
            s, e, flags, _mvs, _hcs = codec.parse_snapshot_marker(f)
            if st.open:
                self._emit_complete(st, emit, raw_out)
            st.begin(s, e, flags)
            if len(f.extras) == 1 and f.extras[0] == 2 and len(f.value) == 52:
                st.purge_seqno = _U64(f.value, 36)[0]
            if raw_out is not None:
                raw_out.append(SnapshotMarker(st.vbucket, s, st.end, flags))
            else:
                st.held += size
                self._slow_snap += size
        elif op == Opcode.DCP_MUTATION or op == Opcode.DCP_DELETION or op == Opcode.DCP_EXPIRATION:
            if op == Opcode.DCP_MUTATION:
                by, rev, flg, exp, lk = codec.parse_mutation(f)
                ev: Any = Mutation(st.vbucket, by, rev, cas, flg, exp, lk, dt, f.key, f.value)
            elif op == Opcode.DCP_DELETION:
                by, rev, dtime = codec.parse_deletion(f)
                ev = Deletion(st.vbucket, by, rev, cas, dt, f.key, f.value, dtime)
            else:
                by, rev, dtime = codec.parse_expiration(f)
                ev = Expiration(st.vbucket, by, rev, cas, f.key, dtime)
            if not st.open:
                if by > st.end_seqno:
                    return  # past the end we asked for (a server that does not clamp)
                raise RemoteProtocolError(
                    f"vb {st.vbucket}: opcode 0x{op:02x} seqno {by} outside any snapshot")
            self.stats["items"] += 1
            if raw_out is not None:
                raw_out.append(ev)
            else:
                st.items.append(ev)
                st.held += size
                self._slow_snap += size
            if by >= st.end:
                self._emit_complete(st, emit, raw_out)
        elif op == Opcode.DCP_STREAM_END:
            self._on_stream_end(st, codec.parse_stream_end(f), emit, raw_out)
        elif op == Opcode.DCP_SEQNO_ADVANCED:
            seqno = codec.parse_seqno_advanced(f)
            if st.open and raw_out is None:
                st.held += size
                self._slow_snap += size
            if st.open and seqno >= st.end:
                self._emit_complete(st, emit, raw_out)
        # anything else (system events, set-vbucket-state): counted, acked, ignored

    def _emit_complete(self, st: StreamBuffer, emit: Any, raw_out: list | None) -> None:
        batch = st.complete(self.fc, self._commit_fn)
        emit(batch if raw_out is None else CommitPoint(batch))

    def _on_stream_end(self, st: StreamBuffer, reason: int, emit: Any,
                       raw_out: list | None) -> None:
        del self._streams[st.opaque]
        self._by_vb.pop(st.vbucket, None)
        if raw_out is not None:
            raw_out.append(StreamEnd(st.vbucket, reason))
        session = self.session
        assert session is not None
        if reason == StreamEndStatus.OK:
            if st.open:
                self._emit_complete(st, emit, raw_out)
            session[st.vbucket].done = True
            self._check_all_done()
        elif reason in _FATAL_END:
            raise StreamError(st.vbucket, reason,
                              f"stream ended: {StreamEndStatus(reason).name}")
        else:
            st.discard(self.fc)
            self.stats["stream_reopens"] += 1
            self.schedule_open(st.vbucket, 0.05)

    def _on_response(self, f: Frame, out: list, raw_out: list | None) -> None:
        if f.opcode == Opcode.DCP_STREAM_REQ:
            st = self._streams.get(f.opaque)
            if st is not None and st.state == StreamState.REQUESTED:
                self._on_stream_response(st, f, out if raw_out is None else raw_out)
                return
        rpc = self._rpcs.pop(f.opaque, None)
        if rpc is not None:
            rpc.frame = f
            rpc.event.set()

    def _on_stream_response(self, st: StreamBuffer, f: Frame, out: list) -> None:
        vb = st.vbucket
        status = f.status
        if status == Status.SUCCESS:
            st.log = tuple(codec.parse_failover_log(bytes(f.value)))
            st.state = _STREAMING
            self._retries.pop(vb, None)
            self.made_progress = True
            return
        del self._streams[st.opaque]
        self._by_vb.pop(vb, None)
        session = self.session
        assert session is not None
        if status == Status.ROLLBACK:
            if len(f.value) < 8:
                raise RemoteProtocolError(f"vb {vb}: ROLLBACK without an 8-byte seqno")
            rollback_seqno = _U64(f.value, 0)[0]
            self.stats["rollbacks"] += 1
            if self.cfg.rollback_policy is RollbackPolicy.FAIL:
                raise RollbackError(vb, st.asked_uuid, st.asked_seqno, rollback_seqno)
            ev = session.rollback(vb, rollback_seqno)
            ev._commit_fn = self._commit_fn
            self.delivery.purge_vbucket(vb)
            out.append(ev)
            self.schedule_open(vb, 0)
            return
        err = for_status(status, bytes(f.value))
        if status in _RETRIABLE:
            now = trio.current_time()
            since, attempts = self._retries.get(vb, (now, 0))
            attempts += 1
            if now - since >= self.cfg.retry_timeout:
                raise RetryTimeoutError("stream request", vbucket=vb, attempts=attempts,
                                        elapsed=now - since, last_error=err) from err
            self._retries[vb] = (since, attempts)
            self.stats["stream_retries"] += 1
            self.schedule_open(vb, min(0.05 * 2 ** (attempts - 1), 2.0))
            return
        raise StreamError(vb, status, f"stream request refused ({err}); asked start="
                                      f"{st.asked_seqno} end={st.end_seqno} vb_uuid="
                                      f"{st.asked_uuid}")
