"""ActiveStream: one vbucket's change feed to one DCP client (kv_engine's ``ActiveStream``).

Rules of this module:
- Synchronous and socket-free. The connection's writer calls ``fill(buf, ...)`` and the
  stream appends whole frames to ``buf`` (per-frame output is its ``FrameWriter``,
  ``stream_frames.py``, a collaborator owning the send position and frame counters);
  the backfill task (``Backfills.run``, backfills.py) feeds disk chunks in with
  ``push_backfill*``. Nothing here awaits.
- Whole snapshots only leave in order: a snapshot's items are copied out of the
  checkpoint at ``take()`` time, so later deduplication cannot change what a marker
  promised. A disk backfill is one logical snapshot ``[first, P]``; memory items with
  seqno <= P are skipped afterwards, so the hand-over has no gap and no duplicate.
- Memory snapshots are read as wire runs (``CheckpointManager.take_wire``, by
  ``queue_memory`` in stream_queue.py, which also defines the queue entries): byte ranges
  of frames the checkpoint encoded once, copied into the send buffer with this stream's
  opaque patched in; flow control and the batch size still cut between frames. Streams
  that strip values (``no_value``) take items and encode each frame.
- A stream ends with OK only after a snapshot reaching its end seqno is completely out:
  a memory snapshot when its last segment is written, a disk snapshot when the backfill
  says it is done (its items arrive in chunks while it is being sent).
- A stable-only stream (control ``stable_only``) lets a snapshot marker, or a disk
  snapshot's end, leave only once its seqno is stable: its ``StableGate``
  (stable_gate.py) holds the entry at the head of the queue meanwhile. The gate is
  chosen when the stream is created, from its connection's options then.
- A TAKEOVER stream (``takeover`` set) hands its vbucket over once caught up
  (``is_caught_up``): ``fill`` asks its ``Takeover`` (takeover.py) for the next step
  when nothing else is ready, and ``release`` tells it the stream is gone.
- ``release`` lets go of everything the stream holds elsewhere: its cursor, its
  gate's ``wait_stable`` callback, the replica acks recorded for it (``acked``: the
  durability monitor forgets exactly this stream's, dcp/producer/durability.py) and
  its queued snapshot, so a closed stream pins no memory.
- State changes go through ``_transition`` and only along this table::

      PENDING ──► BACKFILLING ──► IN_MEMORY ──► DEAD
         │            ▲               │           ▲
         │            └── cursor ─────┘           │
         │                dropped                 │
         └────────────────────────────────────────┘  (end reached, close, shutdown)
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any

from ..protocol import codec
from ..protocol.opcodes import SnapshotMarkerFlag, StreamEndStatus
from . import stream_log
from .engine.checkpoint import WireRun
from .stable_gate import StableGate
from .stream_frames import FrameWriter, StreamOptions
from .stream_queue import BACKFILL_DONE, Marker, queue_memory

__all__ = ["ActiveStream", "StreamOptions", "StreamState"]

log = logging.getLogger("dcp.stream")

_DISK = int(SnapshotMarkerFlag.DISK)


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


class ActiveStream:
    """A DCP stream for one vbucket on one connection."""

    def __init__(
        self,
        *,
        name: str,
        vbucket: Any,
        opaque: int,
        start_seqno: int,
        end_seqno: int,
        options: StreamOptions,
        history: bool = False,
        on_backfill: Callable[[ActiveStream], None],
    ) -> None:
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
        #: task waits on it instead of polling (Backfills.run)
        self.on_backfill_sent: Callable[[], None] | None = None
        self.backfills = 0
        self.cursor_drops = 0
        self.end_status: StreamEndStatus | None = None
        self._on_backfill = on_backfill
        self._queue: deque[Any] = deque()  # Marker | list[Item] | WireRun | BACKFILL_DONE
        self._writer = FrameWriter(self.vbid, opaque, options, start_seqno)  # + what is sent
        self._cur_end = 0  # snapshot end of the snapshot being sent
        self._cur_disk = False  # the snapshot being sent is a disk (backfill) snapshot
        self._end_sent = False
        self.announced = False  # its stream-request OK has been written
        #: its connection, recorded by ``StreamRegistry.add`` (told when it is ready)
        self.conn: Any = None
        #: the hand-over of a TAKEOVER stream (takeover.py), else None
        self.takeover: Any = None
        #: holds snapshots above the stable seqno (stable-only streams), else None
        self.gate = StableGate(self) if options.stable_only else None
        #: a replica acknowledged seqnos on this stream (seqno_ack.py): ``release``
        #: makes the durability monitor forget them
        self.acked = False

    @property
    def items_sent(self) -> int:
        """Frames of items sent (counted by the frame writer)."""
        return self._writer.items_sent

    @property
    def bytes_sent(self) -> int:
        """Bytes of item frames sent (markers and stream ends not included)."""
        return self._writer.bytes_sent

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
            self._writer.cur = None

    def is_caught_up(self) -> bool:
        """Everything the vbucket holds is out: in memory, nothing queued or half
        written, the last seqno sent at the vbucket's high seqno."""
        cursor = self.cursor
        return (
            self.state is StreamState.IN_MEMORY
            and cursor is not None
            and not cursor.dropped
            and not self._queue
            and self._writer.cur is None
            and not self.backfill_bytes
            and self.last_sent_seqno >= self.vbucket.high_seqno
        )

    def release(self) -> None:
        """Let go of what the stream holds (stream closed or connection gone; module
        rules). Idempotent."""
        if self.gate is not None:
            self.gate.cancel()
        if self.acked:
            self.acked = False
            self.conn.server.durability.forget(self.vbid, source=self)
        self._queue.clear()
        self._writer.cur = None
        if self.takeover is not None:
            conn, end = self.conn, self.end_status
            if conn is not None and conn.closed:
                why = f"connection closed: {conn.close_reason or 'by the client'}"
            else:
                why = f"stream ended {end.name}" if end is not None else "stream closed"
            self.takeover.released(why)
        if self.cursor is not None:
            try:
                self.vbucket.checkpoints.remove_cursor(self.cursor)
            except (KeyError, ValueError):
                pass
            self.cursor = None
        if self.state is not StreamState.DEAD:
            self._transition(StreamState.DEAD)

    # ------------------------------------------------------------------ backfill input

    def push_backfill_marker(
        self, start: int, end: int, *, may_contain_duplicates: bool = False
    ) -> None:
        # The marker keeps the real snapshot end even past end_seqno: a client that asked
        # for a cut inside a (deduplicated) snapshot must be able to see that its cut is
        # not a consistent point. Items past end_seqno are never sent.
        # With a history window the disk keeps superseded versions; only a change-stream
        # stream (self.history) is sent them (backfills.py asks the scan for each key's
        # newest version otherwise), and its snapshot says so (0x20).
        flags = SnapshotMarkerFlag.DISK | (SnapshotMarkerFlag.HISTORY if self.history else 0)
        if may_contain_duplicates or self.history:
            flags |= SnapshotMarkerFlag.MAY_CONTAIN_DUPLICATES
        self._queue.append(Marker(start, end, int(flags)))
        self.last_read_seqno = max(self.last_read_seqno, min(end, self.end_seqno))

    def push_backfill_chunk(self, chunk: Any) -> None:
        """A ``BackfillChunk`` (engine/backfill.py): ready frames and other items, all
        with seqno <= ``end_seqno`` (the scan stops there)."""
        if chunk.count:
            self._queue.extend(chunk.segments)
            self.backfill_bytes += chunk.nbytes

    def _backfill_sent(self, nbytes: int) -> None:
        self.backfill_bytes = max(0, self.backfill_bytes - nbytes)
        if self.on_backfill_sent is not None:
            self.on_backfill_sent()

    def push_backfill_done(self, disk_end: int) -> None:
        self.skip_until = max(self.skip_until, disk_end)
        self._queue.append(BACKFILL_DONE)

    # ------------------------------------------------------------------ output

    def fill(self, buf: bytearray, buffer_log: Any, max_bytes: int) -> bool:
        """Append frames to ``buf`` until it holds ``max_bytes``, flow control is full, or
        nothing is ready. Returns True when the stream may have more to send right now."""
        w = self._writer
        while len(buf) < max_bytes:
            if not buffer_log.can_send():
                return True
            cur = w.cur
            if cur is not None:
                w.last_seqno = self.last_sent_seqno  # fill may have raised it (markers)
                if cur.__class__ is WireRun:
                    disk = w.write_run(buf, buffer_log, max_bytes, self.backfill_bytes)
                else:
                    disk = w.write_items(buf, buffer_log, max_bytes, self.backfill_bytes)
                self.last_sent_seqno = w.last_seqno
                if disk:
                    self._backfill_sent(disk)
                if w.cur is not None:
                    return True
                q = self._queue
                if not self._cur_disk and (
                    not q or q[0].__class__ is Marker or q[0] is BACKFILL_DONE
                ):
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
                    stream_log.count("ended")
                    log.debug(
                        "stream end %s vb=%d status=%s last_sent=%d",
                        self.name,
                        self.vbid,
                        self.end_status.name,
                        self.last_sent_seqno,
                    )
                    self.release()
                return False
            if not self._queue and not self._refill():
                if self.takeover is not None and self.takeover.step(buf, buffer_log):
                    continue  # a hand-over step: look again
                return False
            entry = self._queue.popleft()
            if entry.__class__ is Marker:
                if self.gate is not None and self.gate.holds(entry.end):
                    self._queue.appendleft(entry)  # the whole snapshot waits, unread
                    return False
                frame = codec.snapshot_marker(
                    self.vbid, self.opaque, entry.start, entry.end, entry.flags
                )
                buf += frame
                buffer_log.record(len(frame))
                self._cur_end = entry.end
                self._cur_disk = bool(entry.flags & _DISK)
                if entry.end >= self.end_seqno and not self._queue:
                    # Marker of an empty final snapshot: nothing else to send.
                    self.set_end(StreamEndStatus.OK)
            elif entry is BACKFILL_DONE:
                # a disk end may announce its end (SEQNO_ADVANCED, or an OK end without
                # a marker): never above the stable seqno either
                gate = self.gate
                if gate is not None and gate.holds(min(self.skip_until, self.end_seqno)):
                    self._queue.appendleft(entry)
                    return False
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
                if (
                    self._cur_end >= self.end_seqno
                    or self.last_sent_seqno >= self.end_seqno
                    or self.skip_until >= self.end_seqno
                ):
                    # (skip_until: the disk covered the end even if it held no item there)
                    self.set_end(StreamEndStatus.OK)
            else:
                w.start(entry)
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
        last = queue_memory(
            self.vbucket.checkpoints,
            cursor,
            self._queue,
            self.skip_until,
            self.end_seqno,
            no_value=self.options.no_value,
        )
        if last:
            self.last_read_seqno = last
        return bool(self._queue)

    def _cursor_dropped(self) -> None:
        """Our memory cursor was dropped for memory: continue from disk, no gap."""
        self.cursor_drops += 1
        stream_log.count("cursor_dropped")
        log.debug(
            "cursor dropped %s vb=%d last_sent=%d: falling back to backfill",
            self.name,
            self.vbid,
            self.last_sent_seqno,
        )
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
            **(self.takeover.statistics() if self.takeover is not None else {}),
        }
