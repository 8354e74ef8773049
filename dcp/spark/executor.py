"""Executor side: read planned vbucket ranges ``(start, end]`` from the server, in whole
snapshots, into change sets (the I/O half; the decisions are in ``ranges.py``).

Rules of this module:
- One connection per Spark task; every vbucket of the task is streamed on it at once
  (stream requests pipelined, streams matched by opaque). When the task ends, every
  stream is closed and its STREAM_END awaited (briefly) before the socket is closed.
- Streams are requested open-ended (end seqno 2**64-1) and stopped by the reader once
  the range is read: the server keeps every marker's real end, and a finite end would
  add nothing but a server-side cut (whose disk-backfill path currently ends streams
  early: docs/spark.md, "Limits and server notes").
- A lost connection, a stream end or a retriable refusal is retried from the range's
  last accepted snapshot end, with back-off, for ``retryTimeout`` seconds; then the task
  fails with ``RangeUnavailableError``.
- History checks: a ROLLBACK answer, or a failover log showing the planned end is no
  longer on the server's history, raises ``RollbackDetectedError``; with ``rewind`` the
  vbucket yields one rollback row (at a change-set boundary at or below the rollback
  seqno: ``batch_plan.rewind_point``) and nothing else.
- An I/O shell over the connection's ``ClientSession`` (``dcp.protocol.session``): it
  decodes (magic, opcode and extras decide what a frame is), answers noops and matches
  stream answers; the session builds each item straight as a row tuple in column order,
  and a run of items (one ``Items`` event) is added to the columns with one ``extend``
  per column. A frame that breaks the protocol fails the task with
  ``RangeUnavailableError``.
"""

from __future__ import annotations

import bisect
import logging
import operator
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dcp.protocol import SEQNO_MAX, DcpOpenFlag, RemoteProtocolError, Status, StreamEndStatus
from dcp.protocol import events as ev
from dcp.protocol.opcodes import SnapshotMarkerFlag
from dcp.protocol.session import ClientSession

from .batch_plan import VbRange, branch_uuid, rewind_point, rollback_seqno
from .changes import Chunk, deletion_row, expiration_row, mutation_row
from .errors import RangeUnavailableError, RollbackDetectedError
from .offsets import VbPosition
from .options import SourceConfig
from .ranges import BUFFER_BYTES, RangeRead
from .wire import ConnectionLost, WireClient

__all__ = ["DRAIN_SECONDS", "read_ranges"]

log = logging.getLogger("dcp.spark")

#: How long a finished task waits for the STREAM_ENDs of the streams it closed.
DRAIN_SECONDS = 2.0
_HISTORY = int(SnapshotMarkerFlag.HISTORY)

_SEQNO = operator.itemgetter(0)
_RETRIABLE_END = {
    StreamEndStatus.DISCONNECTED,
    StreamEndStatus.SLOW,
    StreamEndStatus.BACKFILL_FAIL,
    StreamEndStatus.STATE_CHANGED,
    StreamEndStatus.ROLLBACK,
}
_RETRIABLE_STATUS = {Status.NOT_MY_VBUCKET, Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM}


class _Reader:
    """The ranges of one Spark task, read over one connection (see the module rules)."""

    def __init__(self, cfg: SourceConfig, ranges: Sequence[VbRange], name: str) -> None:
        self.cfg = cfg
        self.name = name
        self.out = Chunk()
        self.streams = [RangeRead(r, self.out, cfg.on_merged_snapshot) for r in ranges]
        self.by_opaque: dict[int, RangeRead] = {}
        self.client: WireClient | None = None
        self.outbox: list[bytes] = []  # requests to send with the next write
        self.retry_at: dict[int, float] = {}  # vbucket -> monotonic time of the next request
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.Items: self._items,
            ev.Marker: self._marker,
            ev.SeqnoAdvanced: self._seqno_advanced,
            ev.StreamEnded: self._stream_ended,
            ev.StreamOpened: self._stream_opened,
            ev.StreamRollback: self._stream_rollback,
            ev.StreamRefused: self._stream_refused,
            ev.Answer: self._answer,
            ev.SnapshotDone: _ignore,  # RangeRead decides on snapshot ends itself
        }

    # ------------------------------------------------------------------ connection

    def connect(self) -> None:
        client = WireClient.for_config(
            self.cfg,
            ClientSession(mutation=mutation_row, deletion=deletion_row, expiration=expiration_row),
        )
        client.connect()
        try:
            client.dcp_open(
                f"{self.name}:{os.getpid()}:{secrets.token_hex(4)}",
                flags=int(DcpOpenFlag.PRODUCER | DcpOpenFlag.INCLUDE_DELETE_TIMES),
                controls={
                    "send_stream_end_on_client_close_stream": "true",
                    "enable_expiry_opcode": "true",
                    # A disk range whose last seqno was a purged tombstone
                    # then completes without waiting for the next change.
                    "send_seqno_advanced": "true",
                    # Refused without a history window on the server: fine.
                    "change_streams": "true",
                },
            )
        except BaseException:
            client.close()
            raise
        self.client = client
        self.by_opaque.clear()
        self.outbox.clear()
        self.retry_at.clear()
        for st in self.streams:
            if not st.done:
                self.request(st)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def request(self, st: RangeRead) -> None:
        """Ask for the vbucket from ``st.c``, open-ended: the reader stops the stream itself
        once the range is read (see the module rules)."""
        assert self.client is not None
        st.opaque, data = self.client.proto.stream_request(
            st.rng.vbucket,
            start=st.c,
            end=SEQNO_MAX,
            vb_uuid=st.rng.uuid,
            snap_start=st.c,
            snap_end=st.c,
        )
        self.by_opaque[st.opaque] = st
        st.state = "requested"
        st.restart()
        self.outbox.append(data)

    def close_stream(self, st: RangeRead) -> None:
        """Stop ``st`` on the server (if it has one); it is ``done`` once its STREAM_END, or
        the answer that there is no such stream, arrives."""
        if st.state in ("open", "requested") and self.client is not None:
            st.state = "closing"
            o, data = self.client.proto.close_stream(st.rng.vbucket)
            self.by_opaque[o] = st  # the answer: SUCCESS (a STREAM_END follows) or ENOENT
            self.outbox.append(data)
        elif st.state != "closing":
            st.state = "done"

    def settle(self, st: RangeRead) -> None:
        """After a decision: a range that is read needs no server-side stream any more."""
        if st.done and st.state in ("open", "requested"):
            self.close_stream(st)

    def rolled_back(
        self,
        st: RangeRead,
        uuid: int,
        seqno: int,
        r: int,
        detail: str,
        flog: list[tuple[int, int]] | None = None,
    ) -> None:
        """Position ``(uuid, seqno)`` of this range is off the server's history."""
        rng = st.rng
        if self.cfg.on_rollback != "rewind":
            raise RollbackDetectedError(rng.vbucket, uuid, seqno, r, "reading", detail)
        at = rewind_point(rng.start, rng.prev, r)
        log.warning("vbucket %d: %s; emitting a rollback row to seqno %d", rng.vbucket, detail, at)
        st.rollback(at, branch_uuid(flog, at) if flog else 0)
        if st.state == "requested":  # the ROLLBACK answer: the server opened no stream
            st.state = "done"
        else:
            self.close_stream(st)

    # ------------------------------------------------------------------ control frames

    def _stream_opened(self, e: ev.StreamOpened) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is None or st.state != "requested":
            return
        st.state = "open"
        rng = st.rng
        flog = list(e.failover_log)
        if not st.branch:
            st.branch = branch_uuid(flog, rng.end)
        if rng.end_uuid:
            r = rollback_seqno(VbPosition(rng.end_uuid, rng.end), flog, SEQNO_MAX)
            if r is not None:
                self.rolled_back(
                    st,
                    rng.end_uuid,
                    rng.end,
                    r,
                    (
                        f"the planned end (uuid {rng.end_uuid}, seqno {rng.end}) is no longer "
                        f"on the server's history (failover log {flog})"
                    ),
                    flog,
                )

    def _stream_rollback(self, e: ev.StreamRollback) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is None or st.state != "requested":
            return
        self.rolled_back(
            st,
            st.rng.uuid,
            st.c,
            e.seqno,
            (
                f"the stream request at (uuid {st.rng.uuid}, seqno {st.c}) was answered "
                f"ROLLBACK to {e.seqno}"
            ),
        )

    def _stream_refused(self, e: ev.StreamRefused) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is None or st.state != "requested":
            return
        status = e.status
        if status in _RETRIABLE_STATUS:
            self.schedule_retry(st, f"stream request answered status 0x{status:02x}")
            return
        rng = st.rng
        raise RangeUnavailableError(
            f"vbucket {rng.vbucket}: the server refused the stream request for (seqno {st.c}, "
            f"{rng.end}] (uuid {rng.uuid}) with status 0x{status:02x}: "
            f"{e.value[:200].decode('utf-8', 'replace')}"
        )

    def _answer(self, e: ev.Answer) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is not None and e.result.status and st.state == "closing":
            st.state = "done"  # no stream to close (it had already ended)

    def _stream_ended(self, e: ev.StreamEnded) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is not None and st.state in ("open", "closing"):
            self.stream_end(st, e.reason)

    def stream_end(self, st: RangeRead, reason: int) -> None:
        if st.state == "closing":
            st.state = "done"
            return
        if reason in _RETRIABLE_END or reason == StreamEndStatus.OK:
            # An open-ended stream only ends when the server drops it: resume from the
            # last whole snapshot.
            self.schedule_retry(st, f"stream ended with reason {reason}")
            return
        raise RangeUnavailableError(
            f"vbucket {st.rng.vbucket}: stream ended with reason "
            f"{reason} at seqno {st.c} of (..., {st.end}]"
        )

    def schedule_retry(self, st: RangeRead, why: str) -> None:
        if st.flags & _HISTORY:
            st.accept()  # a history prefix is a real state: keep it
        if st.partial:
            raise RangeUnavailableError(
                f"vbucket {st.rng.vbucket}: {why} after part of a range larger than "
                f"{BUFFER_BYTES} bytes was handed out; failing the task"
            )
        now = time.monotonic()
        if st.failing_since is None:
            st.failing_since = now
        elif now - st.failing_since > self.cfg.retry_timeout:
            raise RangeUnavailableError(
                f"vbucket {st.rng.vbucket}: gave up after {now - st.failing_since:.1f} s of "
                f"retries (option retryTimeout={self.cfg.retry_timeout:g}; 'forever' never "
                f"gives up): {why}"
            )
        if st.failing_since == now:
            log.warning("vbucket %d: %s; retrying (option retryTimeout)", st.rng.vbucket, why)
        st.attempts += 1
        st.drop_pending()
        st.state = "retry"
        self.retry_at[st.rng.vbucket] = now + min(2.0, 0.05 * 2 ** min(st.attempts, 6))

    # ------------------------------------------------------------------ main loop

    def run(self) -> Iterator[Chunk]:
        batch_rows = self.cfg.arrow_batch_rows
        while not all(st.done for st in self.streams):
            try:
                if self.client is None:
                    self.connect()
                wait = self._due_retries()
                self._send_outbox()
                chunk = self.client.read_chunk(wait)  # type: ignore[union-attr]
            except ConnectionLost as exc:
                self.close()
                self._connection_failed(exc)
                continue
            if chunk:
                self._feed(chunk)
            if len(self.out) >= batch_rows:
                yield self.out.take()
        if len(self.out):
            yield self.out.take()

    def _send_outbox(self) -> None:
        if self.outbox:
            data = b"".join(self.outbox)
            self.outbox.clear()
            self.client.send(data)  # type: ignore[union-attr]

    def _feed(self, chunk: bytes) -> None:
        """Decode ``chunk`` (after what is left of the previous one) and act on it."""
        assert self.client is not None
        proto = self.client.proto
        try:
            events = proto.receive_data(chunk)
        except RemoteProtocolError as exc:
            raise RangeUnavailableError(f"the server broke the protocol: {exc}") from exc
        handlers = self._handlers
        for e in events:
            handlers[type(e)](e)
        for st in self.streams:  # memory bound: account what was buffered, now and then
            if st.state == "open":
                st.count_pending()
                self.settle(st)
        reply = proto.data_to_send()  # noop replies
        if reply:
            self.outbox.append(reply)

    def shutdown(self) -> None:
        """Close the connection, politely when possible: close every stream and wait
        (up to ``DRAIN_SECONDS``) for their STREAM_ENDs, so the socket holds no unread
        data when it is closed. (Closing with unread data makes the kernel reset the
        connection, which the current server does not survive: docs/spark.md, "Limits
        and server notes".)"""
        client = self.client
        if client is None:
            return
        deadline = time.monotonic() + DRAIN_SECONDS
        try:
            for st in self.streams:
                st.done = True
                self.close_stream(st)
            while any(st.state == "closing" for st in self.streams):
                self._send_outbox()
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                chunk = client.read_chunk(left)
                if chunk:
                    self._feed(chunk)
        except Exception:  # best effort: the task's outcome is already decided
            pass
        finally:
            self.close()

    def _connection_failed(self, exc: BaseException) -> None:
        for st in self.streams:
            if not st.done:
                self.schedule_retry(st, f"connection lost: {exc}")
        delay = min(self.retry_at.values(), default=time.monotonic()) - time.monotonic()
        self.retry_at.clear()  # connect() requests every unfinished vbucket again
        time.sleep(max(0.0, delay))

    def _due_retries(self) -> float | None:
        """Re-request streams whose back-off is over; return how long the next read may
        wait (None = no retry pending)."""
        if not self.retry_at:
            return None
        now = time.monotonic()
        for st in self.streams:
            t = self.retry_at.get(st.rng.vbucket)
            if t is not None and t <= now:
                del self.retry_at[st.rng.vbucket]
                self.request(st)
        if not self.retry_at:
            return None
        return max(0.0, min(self.retry_at.values()) - now)

    # ------------------------------------------------------------------ data events

    def _items(self, e: ev.Items) -> None:
        """A run of rows: added to the columns in slices that end at the rows needing a
        decision (at or past ``stop``); rows after a decision that closed the stream are
        dropped. (The buffered bytes are counted per chunk, in ``_feed``.)"""
        st = self.by_opaque.get(e.opaque)
        if st is None or st.state != "open":
            return
        rows = e.items
        n = len(rows)
        i = 0
        while i < n:
            j = bisect.bisect_left(rows, st.stop, i, n, key=_SEQNO)
            k = j + 1 if j < n else n
            part = rows[i:k] if i or k < n else rows
            for col, values in zip(st.rows, zip(*part, strict=True), strict=True):
                col.extend(values)
            i = k
            if j < n:
                st.item_done(rows[j][0])
                self.settle(st)
                if st.state != "open":
                    return

    def _marker(self, e: ev.Marker) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is not None and st.state == "open":
            st.marker(e.start, e.end, e.flags)
            self.settle(st)

    def _seqno_advanced(self, e: ev.SeqnoAdvanced) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is not None and st.state == "open":
            st.item_done(e.seqno)
            self.settle(st)


def _ignore(_e: object) -> None:
    pass


def read_ranges(cfg: SourceConfig, ranges: Sequence[VbRange], name: str) -> Iterator[Chunk]:
    """The change set of every range, in chunks of about ``cfg.arrow_batch_rows`` rows.

    Rollback ranges (``VbRange.rollback`` set, planned by the driver) yield their
    rollback row without touching the server.
    """
    rollbacks = [r for r in ranges if r.rollback is not None]
    reads = [r for r in ranges if r.rollback is None and r.end > r.start]
    if rollbacks:
        ch = Chunk()
        for r in rollbacks:
            ch.add_rollback(r.vbucket, r.rollback, r.end_uuid, r.gen)  # type: ignore[arg-type]
        yield ch
    if not reads:
        return
    reader = _Reader(cfg, reads, name)
    try:
        yield from reader.run()
    finally:
        reader.shutdown()
