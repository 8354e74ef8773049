"""ActiveStream: one vbucket's change feed to one DCP client (kv_engine's ``ActiveStream``).

Rules of this module:
- Synchronous and socket-free. The connection's writer calls ``fill(buf, ...)`` and the
  stream appends whole frames to ``buf``; the backfill task (``tasks.py``) feeds disk
  chunks in with ``push_backfill*``. Nothing here awaits.
- Whole snapshots only leave in order: a snapshot's items are copied out of the
  checkpoint at ``take()`` time, so later deduplication cannot change what a marker
  promised. A disk backfill is one logical snapshot ``[first, P]``; memory items with
  seqno <= P are skipped afterwards, so the hand-over has no gap and no duplicate.
- Memory snapshots are read as wire runs (``Cursor.take_wire``): byte ranges of frames
  the checkpoint encoded once, copied into the send buffer with this stream's opaque
  patched in; flow control and the batch size still cut between frames. Streams that
  strip values (``no_value``) take items and encode each frame.
- A stream ends with OK only after a snapshot reaching its end seqno is completely out:
  a memory snapshot when its last segment is written, a disk snapshot when the backfill
  says it is done (its items arrive in chunks while it is being sent).
- State changes go through ``_transition`` and only along this table::

      PENDING ──► BACKFILLING ──► IN_MEMORY ──► DEAD
         │            ▲               │           ▲
         │            └── cursor ─────┘           │
         │                dropped                 │
         └────────────────────────────────────────┘  (end reached, close, shutdown)
"""

from __future__ import annotations

import logging
import struct
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any

from ..protocol import codec
from ..protocol.opcodes import Opcode, SnapshotMarkerFlag, StreamEndStatus
from .engine.checkpoint import WireRun

__all__ = ["ActiveStream", "StreamOptions", "StreamState"]

log = logging.getLogger("dcp.stream")

_HDR = struct.Struct(">BBHBBHIIQ").pack
_MUT = Opcode.DCP_MUTATION
_DEL = Opcode.DCP_DELETION
_EXP = Opcode.DCP_EXPIRATION
_DISK = int(SnapshotMarkerFlag.DISK)
_TAKE_ITEMS = 4096


class StreamState(Enum):
    PENDING = "pending"
    BACKFILLING = "backfilling"
    IN_MEMORY = "in-memory"
    DEAD = "dead"


_ALLOWED = {
    StreamState.PENDING: {StreamState.BACKFILLING, StreamState.IN_MEMORY, StreamState.DEAD},
    StreamState.BACKFILLING: {StreamState.IN_MEMORY, StreamState.DEAD},
    StreamState.IN_MEMORY: {StreamState.BACKFILLING, StreamState.DEAD},
    StreamState.DEAD: set(),
}


class StreamOptions:
    """Per-connection choices that shape every frame of its streams."""

    __slots__ = ("expiry_opcode", "include_delete_times", "keep_datatype", "no_value",
                 "seqno_advanced")

    def __init__(self, *, no_value: bool = False, include_delete_times: bool = False,
                 expiry_opcode: bool = False, keep_datatype: bool = False,
                 seqno_advanced: bool = False) -> None:
        self.no_value = no_value
        #: control ``send_seqno_advanced``: end a disk snapshot whose last seqno has no
        #: item (a purged tombstone) with DCP_SEQNO_ADVANCED, so the client knows it is
        #: complete without waiting for the vbucket's next change.
        self.seqno_advanced = seqno_advanced
        #: Open flag 0x40: the value is stripped but the datatype reports the stored one.
        self.keep_datatype = keep_datatype
        self.include_delete_times = include_delete_times
        self.expiry_opcode = expiry_opcode


class _Marker:
    __slots__ = ("end", "flags", "start")

    def __init__(self, start: int, end: int, flags: int) -> None:
        self.start = start
        self.end = end
        self.flags = flags


_BACKFILL_DONE = object()


class ActiveStream:
    """A DCP stream for one vbucket on one connection."""

    def __init__(self, *, name: str, vbucket: Any, opaque: int, start_seqno: int,
                 end_seqno: int, options: StreamOptions, history: bool = False,
                 on_backfill: Callable[[ActiveStream], None]) -> None:
        self.name = name
        self.vbucket = vbucket
        self.vbid: int = vbucket.vbid
        self.opaque = opaque
        self.start_seqno = start_seqno
        self.end_seqno = end_seqno
        self.options = options
        self.history = history
        self.state = StreamState.PENDING
        self.last_sent_seqno = start_seqno  # highest seqno the client has been sent (or had)
        self.last_read_seqno = start_seqno  # highest seqno queued for sending
        self.skip_until = 0  # memory items <= this were already covered by a backfill
        self.cursor: Any = None
        self.backfill_from: int | None = None
        self.backfill_bytes = 0  # disk items buffered, awaiting the writer
        #: called (on the trio thread) whenever buffered disk bytes went out: the backfill
        #: task waits on it instead of polling (tasks.run_backfill)
        self.on_backfill_sent: Callable[[], None] | None = None
        self.backfills = 0
        self.items_sent = 0
        self.bytes_sent = 0
        self.cursor_drops = 0
        self.end_status: StreamEndStatus | None = None
        self._on_backfill = on_backfill
        self._queue: deque[Any] = deque()  # _Marker | list[Item] | _BACKFILL_DONE
        self._cur: list[Any] | WireRun | None = None  # items list or wire run being sent
        self._cur_i = 0
        self._cur_end = 0  # snapshot end of the snapshot being sent
        self._cur_disk = False  # the snapshot being sent is a disk (backfill) snapshot
        self._opaque_bytes = opaque.to_bytes(4, "big")
        self._end_sent = False
        self.announced = False  # its stream-request OK has been written
        self.conn: Any = None

    # ------------------------------------------------------------------ state

    def _transition(self, new: StreamState) -> None:
        if new not in _ALLOWED[self.state]:
            raise AssertionError(f"stream {self.name}: illegal {self.state} -> {new}")
        log.debug("stream %s vb=%d %s -> %s", self.name, self.vbid, self.state.value, new.value)
        self.state = new

    @property
    def is_dead(self) -> bool:
        return self.state is StreamState.DEAD

    def activate(self) -> None:
        """Register the cursor and pick the first phase (called once accepted)."""
        if self.start_seqno >= self.end_seqno:
            self.set_end(StreamEndStatus.OK)
            return
        self._register(self.start_seqno)

    def _register(self, from_seqno: int) -> None:
        cm = self.vbucket.checkpoints
        reg = cm.register_cursor(self.name, from_seqno)
        self.cursor = reg.cursor
        if reg.backfill:
            self._transition(StreamState.BACKFILLING)
            self.backfill_from = from_seqno
            self.backfills += 1
            self._on_backfill(self)
        else:
            self._transition(StreamState.IN_MEMORY)

    def set_end(self, status: StreamEndStatus) -> None:
        """Finish the stream: STREAM_END(status) is the next (and last) frame it writes."""
        if self.end_status is None:
            self.end_status = status
            self._queue.clear()
            self._cur = None

    def release(self) -> None:
        """Drop the cursor (stream closed or connection gone). Idempotent."""
        if self.cursor is not None:
            try:
                self.vbucket.checkpoints.remove_cursor(self.cursor)
            except (KeyError, ValueError):
                pass
            self.cursor = None
        if self.state is not StreamState.DEAD:
            self._transition(StreamState.DEAD)

    # ------------------------------------------------------------------ backfill input

    def push_backfill_marker(self, start: int, end: int, *,
                             may_contain_duplicates: bool = False) -> None:
        # The marker keeps the real snapshot end even past end_seqno: a client that asked
        # for a cut inside a (deduplicated) snapshot must be able to see that its cut is
        # not a consistent point. Items past end_seqno are never sent.
        # With a history window the disk keeps superseded versions, so a disk snapshot may
        # repeat keys: it says so (0x20) rather than break the "each key once" rule quietly.
        flags = SnapshotMarkerFlag.DISK | (SnapshotMarkerFlag.HISTORY if self.history else 0)
        if may_contain_duplicates or self.history:
            flags |= SnapshotMarkerFlag.MAY_CONTAIN_DUPLICATES
        self._queue.append(_Marker(start, end, int(flags)))
        self.last_read_seqno = max(self.last_read_seqno, min(end, self.end_seqno))

    def push_backfill_chunk(self, chunk: Any) -> None:
        """A ``BackfillChunk`` (engine/backfill.py): ready frames and other items, all
        with seqno <= ``end_seqno`` (the scan stops there)."""
        if chunk.count:
            self._queue.extend(chunk.segments)
            self.backfill_bytes += chunk.nbytes

    def push_backfill_items(self, items: list[Any], nbytes: int) -> None:
        end = self.end_seqno
        if items and items[-1].seqno > end:
            items = [it for it in items if it.seqno <= end]
        if items:
            self._queue.append(items)
            self.backfill_bytes += nbytes

    def _backfill_sent(self, nbytes: int) -> None:
        self.backfill_bytes = max(0, self.backfill_bytes - nbytes)
        if self.on_backfill_sent is not None:
            self.on_backfill_sent()

    def push_backfill_done(self, disk_end: int) -> None:
        self.skip_until = max(self.skip_until, disk_end)
        self._queue.append(_BACKFILL_DONE)

    # ------------------------------------------------------------------ output

    def fill(self, buf: bytearray, buffer_log: Any, max_bytes: int) -> bool:
        """Append frames to ``buf`` until it holds ``max_bytes``, flow control is full, or
        nothing is ready. Returns True when the stream may have more to send right now."""
        while len(buf) < max_bytes:
            if not buffer_log.can_send():
                return True
            cur = self._cur
            if cur is not None:
                if cur.__class__ is WireRun:
                    self._write_run(buf, buffer_log, max_bytes)
                else:
                    self._write_items(buf, buffer_log, max_bytes)
                if self._cur is not None:
                    return True
                q = self._queue
                if not self._cur_disk and (not q or q[0].__class__ is _Marker
                                           or q[0] is _BACKFILL_DONE):
                    # the last segment of a memory snapshot: the snapshot is out
                    if self._cur_end > self.last_sent_seqno:
                        self.last_sent_seqno = self._cur_end
                    if self._cur_end >= self.end_seqno and self.end_status is None:
                        self.set_end(StreamEndStatus.OK)
                continue
            if self.end_status is not None:
                if not self._end_sent:
                    self._end_sent = True
                    frame = codec.stream_end(self.vbid, self.opaque, self.end_status)
                    buf += frame
                    buffer_log.record(len(frame))
                    log.info("stream end %s vb=%d status=%s last_sent=%d", self.name, self.vbid,
                             self.end_status.name, self.last_sent_seqno)
                    self.release()
                return False
            if not self._queue and not self._refill():
                return False
            entry = self._queue.popleft()
            if entry.__class__ is _Marker:
                frame = codec.snapshot_marker(self.vbid, self.opaque, entry.start, entry.end,
                                              entry.flags)
                buf += frame
                buffer_log.record(len(frame))
                self._cur_end = entry.end
                self._cur_disk = bool(entry.flags & _DISK)
                if entry.end >= self.end_seqno and not self._queue:
                    # Marker of an empty final snapshot: nothing else to send.
                    self.set_end(StreamEndStatus.OK)
            elif entry is _BACKFILL_DONE:
                if self.backfill_bytes:  # everything pushed before it is out
                    self._backfill_sent(self.backfill_bytes)
                if self.state is StreamState.BACKFILLING:
                    self._transition(StreamState.IN_MEMORY)
                if self._cur_disk:  # the disk snapshot is complete
                    self._cur_disk = False
                    if self._cur_end > self.last_sent_seqno:
                        if self.options.seqno_advanced and self._cur_end <= self.end_seqno:
                            # its last seqno has no item: say the snapshot is complete
                            frame = codec.seqno_advanced(self.vbid, self.opaque, self._cur_end)
                            buf += frame
                            buffer_log.record(len(frame))
                        self.last_sent_seqno = min(self._cur_end, self.end_seqno)
                if (self._cur_end >= self.end_seqno or self.last_sent_seqno >= self.end_seqno
                        or self.skip_until >= self.end_seqno):
                    # (skip_until: the disk covered the end even if it held no item there)
                    self.set_end(StreamEndStatus.OK)
            else:
                self._cur = entry
                self._cur_i = 0
        return True

    def _refill(self) -> bool:
        """Pull the next snapshots from memory into the queue. False if none ready."""
        if self.state is not StreamState.IN_MEMORY or self.cursor is None:
            return False
        cursor = self.cursor
        if cursor.dropped:
            self._cursor_dropped()
            if self.state is not StreamState.IN_MEMORY or self.cursor is None:
                return False  # the backfill task marks the stream ready when it has data
            cursor = self.cursor  # re-registered in memory: keep reading, or it stalls
        skip = self.skip_until
        end = self.end_seqno
        q = self._queue
        if self.options.no_value:
            snaps = cursor.take(_TAKE_ITEMS)
            if not snaps:
                return False
            for snap in snaps:
                items = snap.items
                s_end = snap.end
                if s_end <= skip:
                    continue
                if items and items[0].seqno <= skip:
                    items = [it for it in items if it.seqno > skip]
                if s_end > end:  # keep the real end in the marker (see push_backfill_marker)
                    items = [it for it in items if it.seqno <= end]
                if not items:
                    continue
                q.append(_Marker(items[0].seqno, s_end, int(snap.flags)))
                q.append(items)
                self.last_read_seqno = min(s_end, end)
                if s_end >= end:
                    break
            return bool(q)
        wsnaps = cursor.take_wire(_TAKE_ITEMS)
        if not wsnaps:
            return False
        for ws in wsnaps:
            s_end = ws.end
            if s_end <= skip:
                continue
            segs = ws.segments
            if ws.start <= skip or s_end > end:
                # keep (skip, end]; the marker keeps the real end (see push_backfill_marker)
                segs = _cut_segments(segs, skip, end)
                if not segs:
                    continue
            first = segs[0]
            start = first.seqno(0) if first.__class__ is WireRun else first.seqno
            q.append(_Marker(start, s_end, ws.flags))
            group: list[Any] | None = None
            for seg in segs:
                if seg.__class__ is WireRun:
                    group = None
                    q.append(seg)
                elif group is None:
                    group = [seg]
                    q.append(group)
                else:
                    group.append(seg)
            self.last_read_seqno = min(s_end, end)
            if s_end >= end:
                break
        return bool(q)

    def _cursor_dropped(self) -> None:
        """Our memory cursor was dropped for memory: continue from disk, no gap."""
        self.cursor_drops += 1
        log.info("cursor dropped %s vb=%d last_sent=%d: falling back to backfill", self.name,
                 self.vbid, self.last_sent_seqno)
        try:
            self.vbucket.checkpoints.remove_cursor(self.cursor)
        except (KeyError, ValueError):
            pass
        self.cursor = None
        self._transition(StreamState.BACKFILLING)
        self.backfill_from = self.last_read_seqno
        self.skip_until = self.last_read_seqno
        reg = self.vbucket.checkpoints.register_cursor(self.name, self.last_read_seqno)
        self.cursor = reg.cursor
        if reg.backfill:
            self.backfills += 1
            self._on_backfill(self)
        else:
            # Memory still covers us after all (e.g. checkpoints not yet freed).
            self._transition(StreamState.IN_MEMORY)

    def _write_items(self, buf: bytearray, buffer_log: Any, max_bytes: int) -> None:
        """The hot path: encode items of the current snapshot. Mutations use the body the
        engine encoded once; only the 24-byte header is packed per stream."""
        items = self._cur
        assert items is not None
        i = self._cur_i
        n = len(items)
        hdr = _HDR
        vb = self.vbid
        opaque = self.opaque
        opts = self.options
        fast = not opts.no_value
        window = buffer_log.window or (1 << 62)
        outstanding = buffer_log.outstanding
        start_len = len(buf)
        sent_bytes = 0
        last = self.last_sent_seqno
        while i < n:
            it = items[i]
            op = it.op
            if op == _MUT and fast and it.body:
                body = it.body
                kl = len(it.key)
                frame_len = 24 + len(body)
                buf += hdr(0x80, _MUT, kl, 31, it.datatype, vb, len(body), opaque, it.cas)
                buf += body
            else:
                frame = self._encode_other(it)
                frame_len = len(frame)
                buf += frame
            sent_bytes += frame_len
            outstanding += frame_len
            last = it.seqno
            i += 1
            if outstanding >= window or len(buf) >= max_bytes:
                break
        if self.backfill_bytes:
            # disk items are counted as they were charged (push_backfill_*), not by the
            # size of the frames this stream's options gave them
            self._backfill_sent(sum(55 + len(it.key) + len(it.value)
                                    for it in items[self._cur_i:i]))
        self.items_sent += i - self._cur_i
        self._cur_i = i
        self.last_sent_seqno = last
        self.bytes_sent += len(buf) - start_len
        buffer_log.record(sent_bytes)
        if i >= n:
            self._cur = None

    def _write_run(self, buf: bytearray, buffer_log: Any, max_bytes: int) -> None:
        """The hot path: copy frames of a wire run, as many as the batch and the window
        allow (the last one may overshoot, as with items), patching in our opaque."""
        run = self._cur
        assert run is not None and run.__class__ is WireRun
        i = self._cur_i
        starts = run.starts
        k = len(starts)
        room = max_bytes - len(buf)
        window = buffer_log.window
        if window:
            w = window - buffer_log.outstanding
            if w < room:
                room = w
        b0 = starts[i]
        # frames [i, j): the last one is the first whose end reaches ``room`` bytes
        j = bisect_left(starts, b0 + room, i + 1, k) if room < run.end - b0 else k
        b1 = starts[j] if j < k else run.end
        ob = self._opaque_bytes
        wire = run.wire
        ckpt = run.ckpt
        if ckpt is None:  # read from disk for this stream: frames are ready as they are
            buf += wire[b0:b1]
            if self.backfill_bytes:
                self._backfill_sent(b1 - b0)
        elif ckpt.wire is wire and (ckpt.stamp_opaque == ob or ckpt.stamp_from == ckpt.stamp_upto):
            # our opaque is (or becomes) the one stamped in the wire: see checkpoint.py
            lo = ckpt.stamp_from
            hi = ckpt.stamp_upto
            if lo <= b0 and b1 <= hi:
                buf += wire[b0:b1]  # stamped already: a plain copy
            else:
                if lo == hi or b0 > hi or b1 < lo:  # disjoint: (re)start the stamped range
                    lo = hi = b0
                p0 = len(buf)
                buf += wire[b0:b1]  # a sequential read first: the patches below hit cache
                for st in starts[i:j]:
                    if st < lo or st >= hi:
                        wire[st + 12:st + 16] = ob
                with memoryview(wire) as mv:
                    buf[p0:] = mv[b0:b1]
                ckpt.stamp_opaque = ob
                ckpt.stamp_from = min(lo, b0)
                ckpt.stamp_upto = max(hi, b1)
        else:
            base = len(buf) - b0 + 12
            buf += wire[b0:b1]
            for st in starts[i:j]:
                p = base + st
                buf[p:p + 4] = ob
        nbytes = b1 - b0
        self.items_sent += j - i
        self.bytes_sent += nbytes
        buffer_log.record(nbytes)
        self.last_sent_seqno = run.seqno(j - 1)
        if j >= k:
            self._cur = None
        else:
            self._cur_i = j

    def _encode_other(self, it: Any) -> bytes:
        opts = self.options
        op = it.op
        if op == _MUT:
            if not opts.no_value:  # a queued mutation (its frame lives in the wire log)
                return codec.mutation(self.vbid, self.opaque, it.seqno, it.rev_seqno, it.key,
                                      it.value, cas=it.cas, datatype=it.datatype,
                                      flags=it.flags, expiry=it.expiry)
            return codec.mutation(self.vbid, self.opaque, it.seqno, it.rev_seqno, it.key, b"",
                                  cas=it.cas,
                                  datatype=it.datatype if opts.keep_datatype else 0,
                                  flags=it.flags, expiry=it.expiry)
        if op == _EXP and opts.expiry_opcode and opts.include_delete_times:
            return codec.expiration(self.vbid, self.opaque, it.seqno, it.rev_seqno, it.key,
                                    cas=it.cas, delete_time=it.delete_time)
        return codec.deletion(self.vbid, self.opaque, it.seqno, it.rev_seqno, it.key,
                              cas=it.cas,
                              delete_time=it.delete_time if opts.include_delete_times else None)

    def statistics(self) -> dict[str, Any]:
        cursor = self.cursor
        return {
            "name": self.name,
            "vbucket": self.vbid,
            "opaque": self.opaque,
            "state": self.state.value,
            "start_seqno": self.start_seqno,
            "end_seqno": self.end_seqno,
            "last_sent_seqno": self.last_sent_seqno,
            "last_read_seqno": self.last_read_seqno,
            "items_sent": self.items_sent,
            "bytes_sent": self.bytes_sent,
            "backfills": self.backfills,
            "cursor_drops": self.cursor_drops,
            "cursor_dropped": bool(cursor is not None and cursor.dropped),
            "backfill_buffered_bytes": self.backfill_bytes,
        }


def _cut_segments(segs: list, skip: int, end: int) -> list:
    """The parts of ``segs`` (wire runs and items, seqno order) with skip < seqno <= end."""
    out: list = []
    for seg in segs:
        if seg.__class__ is WireRun:
            n = len(seg)
            lo = seg.count_upto(skip) if seg.seqno(0) <= skip else 0
            hi = seg.count_upto(end) if seg.seqno(n - 1) > end else n
            if lo < hi:
                out.append(seg if lo == 0 and hi == n else seg.cut(lo, hi))
        elif skip < seg.seqno <= end:
            out.append(seg)
    return out
