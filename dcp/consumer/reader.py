"""The reader hot path of a DCP connection: decode each received chunk, dispatch.

Rules of this module:
- One reader task per connection decodes every received chunk (large ``receive_some``)
  and dispatches on the opcode with locals bound. Data messages (mutation, deletion)
  are decoded inline straight from the chunk into slotted events (one ``unpack_from``
  of header + extras; the same validation rules as ``dcp.protocol.FrameReader``, which
  costs ~2x more per item because it builds a ``Frame`` first); everything else is
  built as a ``Frame`` and handled by ``_slow``. A frame that breaks the protocol raises
  ``RemoteProtocolError`` and the connection is dropped (then reopened).
- Nothing is delivered per item: each chunk yields one list for the delivery queue
  (complete snapshot batches, rollback events; raw mode: one ``RawChunk``) and at most
  one write (noop replies + one buffer ack).
- Flow-control accounting is per chunk: bytes of frames that belong to a snapshot are
  ``held``; responses and noops are not counted; everything else is ``ackable``.
- Dead connections: after one noop interval with nothing read, a plain NOOP (0x0A)
  probes the server (java-dcp-client does the same: a producer's noop timer may start
  late); after a second silent interval the connection is declared dead.
- Runs of mutations of the snapshot being assembled (what a server sends between two
  markers) take a shorter path: one ``unpack_from`` of header + extras per frame and the
  per-stream counters added once per run, not per item.
- While any connection is reading, the process's generation-0 GC threshold is raised
  (``_GcTuning``): every event is one GC-tracked object that lives until its snapshot is
  handed out, so at CPython's default (700) a collection ran every few hundred items and
  doubled the cost per item (measured with 1024 vbuckets and 1000-item snapshots: 0.56 M
  vs 0.94 M items per CPU-second). The previous threshold is restored when the last
  connection stops reading, unless the application changed it meanwhile.
- Stream-request answers: OK adopts the failover log; ROLLBACK resets the session state
  and emits a ``RollbackEvent`` (or raises ``RollbackError`` under the fail policy);
  NOT_MY_VBUCKET/ETMPFAIL/EBUSY/ENOMEM are retried with backoff until the retry timeout;
  anything else is a ``StreamError``.
- ``StreamReader`` is the reading half of ``DcpConnection`` (a mixin): it uses the
  connection's state and never opens anything itself.
"""

from __future__ import annotations

import gc
import struct
from typing import Any

import trio

from dcp.protocol import codec
from dcp.protocol.errors import RemoteProtocolError, for_status
from dcp.protocol.frames import HEADER, Frame
from dcp.protocol.opcodes import Opcode, Status, StreamEndStatus

from .delivery import CommitPoint, RawChunk
from .errors import (
    ConnectionLostError,
    DeadConnectionError,
    RetryTimeoutError,
    RollbackError,
    StreamError,
)
from .rollback import RollbackPolicy
from .snapshot_buffer import StreamBuffer, StreamState
from .structs import Deletion, Expiration, Mutation, SnapshotMarker, StreamEnd

__all__ = ["StreamReader"]

_HDR = HEADER.unpack_from
_HDR_MUT = codec.HDR_MUTATION.unpack_from
_HDR_DEL1 = struct.Struct(">BBHBBHIIQQQH").unpack_from
_HDR_DEL2 = struct.Struct(">BBHBBHIIQQQIB").unpack_from
_HDR_MARKER = struct.Struct(">BBHBBHIIQQQI").unpack_from  # header + V1 marker extras
_U64 = struct.Struct(">Q").unpack_from
_KNOWN_MAGIC = frozenset((0x80, 0x81, 0x82, 0x83))
_ALL_MAGIC = _KNOWN_MAGIC | {0x08, 0x18}
_RETRIABLE = frozenset((Status.NOT_MY_VBUCKET, Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM))
_FATAL_END = frozenset((StreamEndStatus.FILTER_EMPTY, StreamEndStatus.LOST_PRIVILEGES))
_STREAMING = StreamState.STREAMING
#: gen-0 GC threshold while reading (tracked objects between collections; see the rules)
GC_GEN0_THRESHOLD = 100_000


class _GcTuning:
    """Reference-counted raise of the gen-0 GC threshold (one per reading connection)."""

    users = 0
    saved: tuple[int, int, int] | None = None
    applied: tuple[int, int, int] | None = None

    @classmethod
    def enter(cls) -> None:
        cls.users += 1
        if cls.users == 1:
            cur = gc.get_threshold()
            if cur[0] and cur[0] < GC_GEN0_THRESHOLD:
                cls.saved = cur
                cls.applied = (GC_GEN0_THRESHOLD, cur[1], cur[2])
                gc.set_threshold(*cls.applied)

    @classmethod
    def exit(cls) -> None:
        cls.users -= 1
        if cls.users == 0 and cls.saved is not None:
            if gc.get_threshold() == cls.applied:  # the application did not change it
                gc.set_threshold(*cls.saved)
            cls.saved = cls.applied = None


class StreamReader:
    """Reading half of ``DcpConnection``; see the module rules."""

    # state owned by DcpConnection (declared here for readers of this file)
    cfg: Any
    session: Any
    delivery: Any
    fc: Any
    stats: dict[str, int]
    probe_after: float | None
    made_progress: bool
    _stream: Any
    _commit_fn: Any
    _retries: dict[int, tuple[float, int]]
    _streams: dict[int, StreamBuffer]
    _by_vb: dict[int, StreamBuffer]
    _rpcs: dict[int, Any]
    _slow_snap: int
    _uncounted: int
    _replies: bytearray | None

    async def send(self, data: bytes | bytearray) -> None:
        raise NotImplementedError

    def next_opaque(self) -> int:
        raise NotImplementedError

    def schedule_open(self, vb: int, delay: float) -> None:
        raise NotImplementedError

    def _check_all_done(self) -> None:
        raise NotImplementedError

    async def read_loop(self) -> None:
        _GcTuning.enter()
        try:
            await self._read_loop()
        finally:
            _GcTuning.exit()

    async def _read_loop(self) -> None:
        # The hot path, kept in one frame on purpose (locals bound, no per-item calls).
        receive = self._stream.receive_some
        size = self.cfg.receive_size
        streams = self._streams
        fc = self.fc
        raw = self.cfg.raw
        max_body = self.cfg.max_body_size
        commit_fn = self._commit_fn
        delivery = self.delivery
        slow = self._slow
        stats = self.stats
        hdr_mut = _HDR_MUT
        pending: list[bytes] = []
        pending_len = 0
        need = 24
        while True:
            probe_after = self.probe_after
            data = None
            if probe_after is None:
                data = await receive(size)
            else:
                with trio.move_on_after(probe_after):
                    data = await receive(size)
                if data is None:
                    # One noop interval of silence: probe with a plain NOOP (the server's
                    # noop timer may not run yet); a second silent interval means dead.
                    await self.send(codec.request(Opcode.NOOP, opaque=self.next_opaque()))
                    self.stats["probes"] += 1
                    with trio.move_on_after(probe_after):
                        data = await receive(size)
                    if data is None:
                        raise DeadConnectionError(
                            f"nothing received for {2 * probe_after:g}s (2 x noop interval)")
            if not data:
                raise ConnectionLostError("the server closed the connection")
            stats["bytes_received"] += len(data)
            pending.append(data)
            pending_len += len(data)
            if pending_len < need:
                continue
            buf = pending[0] if len(pending) == 1 else b"".join(pending)
            n = len(buf)
            pos = 0
            need = 24
            out: list = []
            raw_out: list | None = [] if raw else None
            snap = 0
            items = 0
            self._slow_snap = 0
            self._uncounted = 0
            self._replies = None
            # The fast run: mutations of ``cur``'s open snapshot (see the module rules).
            cur: Any = None
            cur_opq = -1
            cur_append: Any = None
            cur_end = 0
            cur_vb = 0
            run = 0  # wire bytes of the run not yet added to cur.held / snap
            nrun = 0  # items of the run not yet counted
            try:
                while True:
                    if n - pos >= 55:
                        (magic, op, kl, el, dt, vb, body, opq, cas, by, rev, flg, exp, lk,
                         _nm, _nru) = hdr_mut(buf, pos)
                        end = pos + 24 + body
                        if (opq == cur_opq and op == 0x57 and magic == 0x80 and el == 31
                                and end <= n and kl + 31 <= body):
                            a = pos + 55
                            b = a + kl
                            cur_append(Mutation(cur_vb, by, rev, cas, flg, exp, lk, dt,
                                                buf[a:b], buf[b:end]))
                            run += end - pos
                            nrun += 1
                            pos = end
                            if by >= cur_end:
                                cur.held += run
                                snap += run
                                items += nrun
                                run = nrun = 0
                                out.append(cur.complete(fc, commit_fn))
                                cur_opq = -1
                            continue
                    elif n - pos < 24:
                        break
                    else:
                        magic, op, kl, el, dt, vb, body, opq, cas = _HDR(buf, pos)
                        end = pos + 24 + body
                    if nrun:
                        cur.held += run
                        snap += run
                        items += nrun
                        run = nrun = 0
                    cur_opq = -1
                    if end > n:
                        if magic not in _ALL_MAGIC:
                            raise RemoteProtocolError(f"bad magic 0x{magic:02x}")
                        if body > max_body:
                            raise RemoteProtocolError(
                                f"body of {body} bytes exceeds the limit of {max_body} "
                                f"(opcode 0x{op:02x})")
                        need = 24 + body
                        break
                    if magic == 0x80 and (op == 0x57 or op == 0x58):
                        st = streams.get(opq)
                        if st is not None and st.open:
                            if op == 0x57 and el == 31 and kl + 31 <= body:
                                (_m, _o, _k, _e, _d, _v, _b, _q, _c, by, rev, flg, exp, lk,
                                 _nm, _nru) = _HDR_MUT(buf, pos)
                                a = pos + 55
                                b = a + kl
                                ev = Mutation(st.vbucket, by, rev, cas, flg, exp, lk, dt,
                                              buf[a:b], buf[b:end])
                            elif op == 0x58 and el == 18 and kl + 18 <= body:
                                (_m, _o, _k, _e, _d, _v, _b, _q, _c, by, rev,
                                 _nm) = _HDR_DEL1(buf, pos)
                                a = pos + 42
                                b = a + kl
                                ev = Deletion(st.vbucket, by, rev, cas, dt, buf[a:b],
                                              buf[b:end], None)
                            elif op == 0x58 and el == 21 and kl + 21 <= body:
                                (_m, _o, _k, _e, _d, _v, _b, _q, _c, by, rev, dtime,
                                 _u) = _HDR_DEL2(buf, pos)
                                a = pos + 45
                                b = a + kl
                                ev = Deletion(st.vbucket, by, rev, cas, dt, buf[a:b],
                                              buf[b:end], dtime)
                            else:
                                slow(buf, pos, end, magic, op, kl, el, dt, vb, body, opq, cas,
                                     out, raw_out)
                                pos = end
                                continue
                            items += 1
                            if raw:
                                raw_out.append(ev)  # type: ignore[union-attr]
                                if by >= st.end:
                                    raw_out.append(  # type: ignore[union-attr]
                                        CommitPoint(st.complete(fc, commit_fn)))
                                pos = end
                                continue
                            st.items.append(ev)
                            fsz = end - pos
                            st.held += fsz
                            snap += fsz
                            pos = end
                            if by >= st.end:
                                out.append(st.complete(fc, commit_fn))
                            else:  # the next mutations of this snapshot take the fast run
                                cur = st
                                cur_opq = opq
                                cur_append = st.items.append
                                cur_end = st.end
                                cur_vb = st.vbucket
                            continue
                    if magic == 0x80 and op == 0x56 and el == 20 and body == 20 and not raw:
                        # V1 snapshot marker of a streaming vbucket: no Frame needed
                        st = streams.get(opq)
                        if st is not None and st.state is _STREAMING:
                            if st.open:
                                out.append(st.complete(fc, commit_fn))
                            (_m, _o, _k, _e, _d, _v, _b, _q, _c, ms, me,
                             mf) = _HDR_MARKER(buf, pos)
                            st.start = ms
                            st.end = cur_end = me if me < st.end_seqno else st.end_seqno
                            st.flags = mf
                            st.open = True
                            st.held += 44
                            snap += 44
                            pos = end
                            cur = st
                            cur_opq = opq
                            cur_append = st.items.append
                            cur_vb = st.vbucket
                            continue
                    slow(buf, pos, end, magic, op, kl, el, dt, vb, body, opq, cas, out, raw_out)
                    pos = end
            except BaseException:
                if out:
                    delivery.put_many(out)
                raise
            finally:
                if nrun:
                    cur.held += run
                    snap += run
                    items += nrun
                stats["items"] += items
            if pos < n:
                rest = buf[pos:]
                pending = [rest]
                pending_len = len(rest)
            else:
                pending = []
                pending_len = 0
            snap += self._slow_snap
            counted = pos - self._uncounted
            if raw:
                if raw_out or counted:
                    fc.queued += counted
                    out.append(RawChunk(raw_out, counted, fc))
            else:
                fc.held += snap
                fc.ackable += counted - snap
            if out:
                delivery.put_many(out)
                self.made_progress = True
            ack = fc.after_receive()
            replies = self._replies
            if ack:
                stats["buffer_acks"] += 1
                if replies is None:
                    replies = bytearray()
                replies += codec.buffer_ack(ack)
            if replies:
                await self.send(replies)
            if not fc.enabled and delivery.nbytes > self.cfg.max_queue_bytes:
                await delivery.wait_below(self.cfg.max_queue_bytes)

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
