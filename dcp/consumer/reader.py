"""The reader hot path of a DCP connection: decode each received chunk, dispatch.

Rules of this module:
- One reader task per connection decodes every received chunk (large ``receive_some``)
  and dispatches on the opcode with locals bound. Data messages (mutation, deletion)
  are decoded inline straight from the chunk into slotted events (one ``unpack_from``
  of header + extras; the same validation rules as ``dcp.protocol.FrameReader``, which
  costs ~2x more per item because it builds a ``Frame`` first); everything else is
  built as a ``Frame`` and handled by ``_slow`` (the ``ControlFrames`` mixin in
  ``control_frames.py``). A frame that breaks the protocol raises
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
- Stream-request answers, stream ends and other rare frames: ``control_frames.py``.
- ``StreamReader`` is the reading half of ``DcpConnection`` (a mixin): it uses the
  connection's state and never opens anything itself.
"""

from __future__ import annotations

import gc
import struct
from typing import Any

import trio

from dcp.protocol import codec
from dcp.protocol.errors import RemoteProtocolError
from dcp.protocol.frames import HEADER
from dcp.protocol.opcodes import Opcode, Status, StreamEndStatus

from .control_frames import ControlFrames
from .delivery import CommitPoint, RawChunk
from .errors import (
    ConnectionLostError,
    DeadConnectionError,
)
from .snapshot_buffer import StreamBuffer, StreamState
from .structs import Deletion, Mutation

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


class StreamReader(ControlFrames):
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
