"""The reading half of a DCP connection: receive, let the protocol session decode, act.

Rules of this module:
- ``StreamReader`` is an I/O shell over the connection's ``ClientSession``
  (``dcp.protocol.session``): one reader task per connection feeds every received chunk
  (large ``receive_some``) to ``receive_data`` and handles the events it returns. Header
  checks, snapshot boundaries, noop replies, stream-request answers, opaque matching and
  flow-control accounting (with its buffer acks) are the session's; the SDK's decisions
  are here: batches, retries, rollback policy, reopening streams. A frame that breaks
  the protocol raises ``RemoteProtocolError`` and the connection is dropped (then
  reopened).
- Nothing is delivered per item: the session hands over a run of items as one
  ``Items`` event, each chunk yields one list for the delivery queue (complete snapshot
  batches, rollback events; raw mode: one ``RawChunk``) and at most one write (noop
  replies + one buffer ack, from ``data_to_send``).
- Stream-request answers: OK adopts the failover log (and, ``to_latest``, restarts the
  stream with a lower end when that log branched off below it: ``Session.clamp_end``);
  ROLLBACK resets the positions and
  emits a ``RollbackEvent`` (or raises ``RollbackError`` under the fail policy);
  NOT_MY_VBUCKET/ETMPFAIL/EBUSY/ENOMEM are retried with backoff until the retry timeout;
  anything else is a ``StreamError``. On a cluster connection, NOT_MY_VBUCKET and a stream
  end other than OK hand the vbucket back to the client to route again
  (``DcpConnection.moved``) instead of asking the same node.
- While any connection is reading, the process's generation-0 GC threshold is raised
  (``_GcTuning``): every event is one GC-tracked object that lives until its snapshot is
  handed out, so at CPython's default (700) a collection ran every few hundred items and
  doubled the cost per item (measured with 1024 vbuckets and 1000-item snapshots: 0.56 M
  vs 0.94 M items per CPU-second). The previous threshold is restored when the last
  connection stops reading, unless the application changed it meanwhile.
- The reader uses its ``DcpConnection``'s state (stream table, positions, delivery,
  sending) through the connection's public methods; it opens nothing itself. Receiving
  (with the dead-connection probe) is the connection's ``receive``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from dcp.protocol import events as ev
from dcp.protocol.errors import for_status
from dcp.protocol.opcodes import Status, StreamEndStatus

from .batches import SnapshotMarker, StreamEnd
from .delivery import CommitPoint, Entry, RawChunk
from .errors import RetryTimeoutError, RollbackError, StreamError
from .rollback import RollbackPolicy
from .snapshot_buffer import StreamState

if TYPE_CHECKING:  # the connection owns its reader
    from .connection import DcpConnection

__all__ = ["StreamReader"]

_RETRIABLE = frozenset((Status.NOT_MY_VBUCKET, Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM))
_FATAL_END = frozenset((StreamEndStatus.FILTER_EMPTY, StreamEndStatus.LOST_PRIVILEGES))
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
    """Reads for one ``DcpConnection`` (see the module rules)."""

    def __init__(self, conn: DcpConnection) -> None:
        self.conn = conn
        self.raw = conn.cfg.raw
        self._out: list[Entry] = []  # this chunk's delivery entries
        self._raw_out: list[Any] = []  # raw mode: this chunk's events (of any kind)
        #: where this chunk's events go (``_out`` or, in raw mode, ``_raw_out``)
        self._emit: Callable[[Any], None] = self._out.append
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.Items: self._items,
            ev.SnapshotDone: self._snapshot_done,
            ev.Marker: self._marker,
            ev.SeqnoAdvanced: _ignore,
            ev.StreamEnded: self._stream_ended,
            ev.StreamOpened: self._stream_opened,
            ev.StreamRollback: self._stream_rollback,
            ev.StreamRefused: self._stream_refused,
            ev.Answer: self._answer,
        }

    async def read_loop(self) -> None:
        _GcTuning.enter()
        try:
            await self._read_loop()
        finally:
            _GcTuning.exit()

    async def _read_loop(self) -> None:
        conn = self.conn
        proto = conn.proto
        fc = proto.flow
        size = conn.cfg.receive_size
        max_queue = conn.cfg.max_queue_bytes
        delivery = conn.delivery
        stats = conn.stats
        handlers = self._handlers
        raw = self.raw
        while True:
            data = await conn.receive(size)
            stats["bytes_received"] += len(data)
            noops, acks = proto.noops, proto.acks
            events = proto.receive_data(data)
            out: list[Entry] = []
            raw_out: list[Any] = []
            self._out = out
            self._raw_out = raw_out
            self._emit = raw_out.append if raw else out.append
            try:
                for e in events:
                    handlers[type(e)](e)
            except BaseException:
                if out:
                    delivery.put_many(out)
                raise
            if raw and (raw_out or proto.counted):
                out.append(RawChunk(raw_out, proto.counted, fc))
            if out:
                delivery.put_many(out)
                conn.made_progress = True
            stats["noops"] += proto.noops - noops
            stats["buffer_acks"] += proto.acks - acks
            replies = proto.data_to_send()
            if replies:
                await conn.send(replies)
            if not fc.enabled and delivery.nbytes > max_queue:
                await delivery.wait_below(max_queue)

    # ------------------------------------------------------------------ data events

    def _items(self, e: ev.Items) -> None:
        st = self.conn.stream_for(e.opaque)
        if st is None:
            return
        self.conn.stats["items"] += len(e.items)
        if self.raw:
            self._raw_out.extend(e.items)
        elif st.items:
            st.items.extend(e.items)
        else:
            st.items = e.items

    def _snapshot_done(self, e: ev.SnapshotDone) -> None:
        st = self.conn.stream_for(e.opaque)
        if st is not None:
            batch = st.complete(e.nbytes, self.conn.fc, self.conn.commit_fn)
            self._emit(CommitPoint(batch) if self.raw else batch)

    def _marker(self, e: ev.Marker) -> None:
        st = self.conn.stream_for(e.opaque)
        if st is not None:
            st.begin(e.start, e.end, e.flags, e.purge_seqno)
            if self.raw:
                self._emit(SnapshotMarker(st.vbucket, e.start, e.end, e.flags))

    # ------------------------------------------------------------------ stream events

    def _stream_ended(self, e: ev.StreamEnded) -> None:
        conn = self.conn
        st = conn.forget_stream(e.opaque)
        if st is None:
            return
        reason = e.reason
        if self.raw:
            self._emit(StreamEnd(st.vbucket, reason))
        if reason == StreamEndStatus.OK:
            session = conn.session
            assert session is not None  # streams are opened for a session
            session[st.vbucket].done = True
            conn.check_all_done()
        elif reason in _FATAL_END:
            raise StreamError(st.vbucket, reason, f"stream ended: {StreamEndStatus(reason).name}")
        else:
            st.discard()
            conn.stats["stream_reopens"] += 1
            # in a cluster the vbucket may have moved (STATE_CHANGED): route it again
            if not conn.moved(st.vbucket, 0.0):
                conn.schedule_open(st.vbucket, 0.05)

    def _stream_opened(self, e: ev.StreamOpened) -> None:
        conn = self.conn
        st = conn.stream_for(e.opaque)
        if st is not None:
            st.log = e.failover_log
            st.state = StreamState.STREAMING
            conn.retries.pop(st.vbucket, None)
            conn.made_progress = True
            session = conn.session
            assert session is not None  # streams are opened for a session
            # to_latest: a copy whose history branched off below the end never reaches it
            if session.clamp_end(st.vbucket, e.failover_log) < st.end_seqno:
                conn.restart_stream(st.vbucket)

    def _stream_rollback(self, e: ev.StreamRollback) -> None:
        conn = self.conn
        st = conn.forget_stream(e.opaque)
        if st is None:
            return
        vb = st.vbucket
        conn.stats["rollbacks"] += 1
        if conn.cfg.rollback_policy is RollbackPolicy.FAIL:
            raise RollbackError(vb, st.asked_uuid, st.asked_seqno, e.seqno)
        session = conn.session
        assert session is not None  # streams are opened for a session
        rb = session.rollback(vb, e.seqno)
        rb.commit_fn = conn.commit_fn
        conn.delivery.purge_vbucket(vb)
        self._emit(rb)
        conn.schedule_open(vb, 0)

    def _stream_refused(self, e: ev.StreamRefused) -> None:
        conn = self.conn
        st = conn.forget_stream(e.opaque)
        if st is None:
            return
        vb = st.vbucket
        status = e.status
        err = for_status(status, e.value)
        if status in _RETRIABLE:
            now = trio.current_time()
            since, attempts = conn.retries.get(vb, (now, 0))
            attempts += 1
            if now - since >= conn.cfg.retry_timeout:
                raise RetryTimeoutError(
                    "stream request",
                    vbucket=vb,
                    attempts=attempts,
                    elapsed=now - since,
                    last_error=err,
                ) from err
            conn.retries[vb] = (since, attempts)
            conn.stats["stream_retries"] += 1
            delay = min(0.05 * 2 ** (attempts - 1), 2.0)
            # a cluster node that does not hold ``vb`` (any more): ask the map again
            if status == Status.NOT_MY_VBUCKET and conn.moved(vb, delay, e.value):
                return
            conn.schedule_open(vb, delay)
            return
        raise StreamError(
            vb,
            status,
            f"stream request refused ({err}); asked start="
            f"{st.asked_seqno} end={st.end_seqno} vb_uuid="
            f"{st.asked_uuid}",
        )

    def _answer(self, e: ev.Answer) -> None:
        self.conn.answered(e.opaque, e.result)


def _ignore(_e: object) -> None:
    """SEQNO_ADVANCED: the session already completed the snapshot it reached."""
