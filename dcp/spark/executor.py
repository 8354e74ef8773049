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
  vbucket yields one rollback row (at the rollback seqno or the range start, whichever is
  lower) and nothing else.
- The hot path parses raw received bytes with precompiled ``struct``s (no frame objects)
  and appends to per-column lists through bound methods.
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
import time
from collections.abc import Iterator, Sequence

from dcp.protocol import SEQNO_MAX, DcpOpenFlag, Opcode, Status, StreamEndStatus, codec
from dcp.protocol.opcodes import SnapshotMarkerFlag

from .changes import OP_DELETION, OP_EXPIRATION, Chunk
from .errors import RangeUnavailableError, RollbackDetectedError
from .offsets import VbPosition
from .options import SourceConfig
from .planning import VbRange, rollback_seqno
from .ranges import BUFFER_BYTES, RangeRead
from .wire import ConnectionLost, WireClient

__all__ = ["DRAIN_SECONDS", "read_ranges"]

log = logging.getLogger("dcp.spark")

#: How long a finished task waits for the STREAM_ENDs of the streams it closed.
DRAIN_SECONDS = 2.0
_HISTORY = int(SnapshotMarkerFlag.HISTORY)

_HDR = struct.Struct(">BBHBBHIIQ").unpack_from
#: Header + mutation extras of a DCP_MUTATION, only the fields used: key length, extras
#: length, datatype, body length, opaque, cas, by_seqno, rev_seqno, flags, expiry.
_MUT = struct.Struct(">2xHBB2xIIQQQII").unpack_from
_DEL = struct.Struct(">BBHBBHIIQQQ").unpack_from  # header + by_seqno, rev_seqno (40 bytes)
_BODYLEN = struct.Struct(">I").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_U32 = struct.Struct(">I").unpack_from
_MARKER = struct.Struct(">QQI").unpack_from

_RETRIABLE_END = {StreamEndStatus.DISCONNECTED, StreamEndStatus.SLOW,
                  StreamEndStatus.BACKFILL_FAIL, StreamEndStatus.STATE_CHANGED,
                  StreamEndStatus.ROLLBACK}
_RETRIABLE_STATUS = {Status.NOT_MY_VBUCKET, Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM}


class _Reader:
    def __init__(self, cfg: SourceConfig, ranges: Sequence[VbRange], name: str) -> None:
        self.cfg = cfg
        self.name = name
        self.out = Chunk()
        self.streams = [RangeRead(r, self.out, cfg.on_merged_snapshot) for r in ranges]
        self.by_opaque: dict[int, RangeRead] = {}
        self.client: WireClient | None = None
        self.outbox: list[bytes] = []  # requests to send with the next write
        self.retry_at: dict[int, float] = {}  # vbucket -> monotonic time of the next request
        self._pieces: list[bytes] = []  # an incomplete frame, in parts
        self._have = 0
        self._need = 0

    # ------------------------------------------------------------------ connection

    def connect(self) -> None:
        client = WireClient(self.cfg.host, self.cfg.port, timeout=self.cfg.timeout)
        client.connect()
        try:
            client.dcp_open(f"{self.name}:{os.getpid()}:{secrets.token_hex(4)}",
                            flags=int(DcpOpenFlag.PRODUCER | DcpOpenFlag.INCLUDE_DELETE_TIMES),
                            controls={
                                "send_stream_end_on_client_close_stream": "true",
                                "enable_expiry_opcode": "true",
                                # A disk range whose last seqno was a purged tombstone
                                # then completes without waiting for the next change.
                                "send_seqno_advanced": "true",
                                # Refused without a history window on the server: fine.
                                "change_streams": "true",
                            })
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
        st.opaque = self.client.next_opaque()
        self.by_opaque[st.opaque] = st
        st.state = "requested"
        st.restart()
        self.outbox.append(codec.stream_request(
            st.rng.vbucket, st.opaque, start=st.c, end=SEQNO_MAX, vb_uuid=st.rng.uuid,
            snap_start=st.c, snap_end=st.c))

    def close_stream(self, st: RangeRead) -> None:
        """Stop ``st`` on the server (if it has one); it is ``done`` once its STREAM_END, or
        the answer that there is no such stream, arrives."""
        if st.state in ("open", "requested") and self.client is not None:
            st.state = "closing"
            o = self.client.next_opaque()
            self.by_opaque[o] = st  # the answer: SUCCESS (a STREAM_END follows) or ENOENT
            self.outbox.append(codec.request(Opcode.DCP_CLOSE_STREAM, vbucket=st.rng.vbucket,
                                             opaque=o))
        elif st.state != "closing":
            st.state = "done"

    def settle(self, st: RangeRead) -> None:
        """After a decision: a range that is read needs no server-side stream any more."""
        if st.done and st.state in ("open", "requested"):
            self.close_stream(st)

    def rolled_back(self, st: RangeRead, uuid: int, seqno: int, r: int, detail: str) -> None:
        """Position ``(uuid, seqno)`` of this range is off the server's history."""
        rng = st.rng
        if self.cfg.on_rollback != "rewind":
            raise RollbackDetectedError(rng.vbucket, uuid, seqno, r, "reading", detail)
        at = min(r, rng.start)
        log.warning("vbucket %d: %s; emitting a rollback row to seqno %d", rng.vbucket,
                    detail, at)
        st.rollback(at)
        if st.state == "requested":  # the ROLLBACK answer: the server opened no stream
            st.state = "done"
        else:
            self.close_stream(st)

    # ------------------------------------------------------------------ control frames

    def stream_response(self, st: RangeRead, status: int, value: bytes) -> None:
        rng = st.rng
        if status == Status.SUCCESS:
            st.state = "open"
            if rng.end_uuid and len(value) % 16 == 0:
                flog = codec.parse_failover_log(value)
                r = rollback_seqno(VbPosition(rng.end_uuid, rng.end), flog, SEQNO_MAX)
                if r is not None:
                    self.rolled_back(st, rng.end_uuid, rng.end, r, (
                        f"the planned end (uuid {rng.end_uuid}, seqno {rng.end}) is no longer "
                        f"on the server's history (failover log {flog})"))
            return
        if status == Status.ROLLBACK:
            r = _U64(value, 0)[0] if len(value) >= 8 else 0
            self.rolled_back(st, rng.uuid, st.c, r, (
                f"the stream request at (uuid {rng.uuid}, seqno {st.c}) was answered "
                f"ROLLBACK to {r}"))
            return
        if status in _RETRIABLE_STATUS:
            self.schedule_retry(st, f"stream request answered status 0x{status:02x}")
            return
        raise RangeUnavailableError(
            f"vbucket {rng.vbucket}: the server refused the stream request for (seqno {st.c}, "
            f"{rng.end}] (uuid {rng.uuid}) with status 0x{status:02x}: "
            f"{value[:200].decode('utf-8', 'replace')}")

    def stream_end(self, st: RangeRead, reason: int) -> None:
        if st.state == "closing":
            st.state = "done"
            return
        if reason in _RETRIABLE_END or reason == StreamEndStatus.OK:
            # An open-ended stream only ends when the server drops it: resume from the
            # last whole snapshot.
            self.schedule_retry(st, f"stream ended with reason {reason}")
            return
        raise RangeUnavailableError(f"vbucket {st.rng.vbucket}: stream ended with reason "
                                    f"{reason} at seqno {st.c} of (..., {st.end}]")

    def schedule_retry(self, st: RangeRead, why: str) -> None:
        if st.flags & _HISTORY:
            st.accept()  # a history prefix is a real state: keep it
        if st.partial:
            raise RangeUnavailableError(
                f"vbucket {st.rng.vbucket}: {why} after part of a range larger than "
                f"{BUFFER_BYTES} bytes was handed out; failing the task")
        now = time.monotonic()
        if st.failing_since is None:
            st.failing_since = now
        elif now - st.failing_since > self.cfg.retry_timeout:
            raise RangeUnavailableError(
                f"vbucket {st.rng.vbucket}: gave up after {now - st.failing_since:.1f} s of "
                f"retries: {why}")
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
                    self._pieces, self._have, self._need = [], 0, 0
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
        """Parse ``chunk`` after what is left of the previous one (an incomplete frame)."""
        if self._pieces:
            self._pieces.append(chunk)
            self._have += len(chunk)
            if self._have < self._need:
                return
            buf = b"".join(self._pieces)
        else:
            buf = chunk
        pos = self.parse(buf)
        if pos < len(buf):
            tail = buf[pos:]
            self._pieces, self._have = [tail], len(tail)
            self._need = 24 + _BODYLEN(tail, 8)[0] if self._have >= 24 else 24
        else:
            self._pieces, self._have, self._need = [], 0, 0

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

    def parse(self, buf: bytes) -> int:
        """Consume every complete frame of ``buf``; return where the unparsed tail starts.

        The hot path: DCP_MUTATION frames of an open stream are unpacked with one
        ``struct`` call and appended through bound ``append`` methods, re-bound only when
        the stream changes (the server sends runs of one stream's frames).
        """
        n = len(buf)
        pos = 0
        by_opaque = self.by_opaque
        mut = _MUT
        last = -1
        st = None
        stop = 0
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = None
        while n - pos >= 24:
            if buf[pos + 1] == 0x57 and n - pos >= 55:
                kl, el, dt, bodylen, opaque, cas, by, rev, flags, exp = mut(buf, pos)
                end = pos + 24 + bodylen
                if end > n:
                    break
                if opaque != last:
                    last = opaque
                    st = by_opaque.get(opaque)
                    if st is not None and st.state == "open":
                        r = st.rows
                        a0, a1, a2, a3, a4 = (r[0].append, r[1].append, r[2].append,
                                              r[3].append, r[4].append)
                        a5, a6, a7, a8 = r[5].append, r[6].append, r[7].append, r[8].append
                        stop = st.stop
                    else:
                        st = None
                if st is not None:
                    k = pos + 24 + el
                    a0(by)  # type: ignore[misc]
                    a1(0)  # type: ignore[misc]
                    a2(buf[k:k + kl])  # type: ignore[misc]
                    a3(buf[k + kl:end])  # type: ignore[misc]
                    a4(cas)  # type: ignore[misc]
                    a5(rev)  # type: ignore[misc]
                    a6(flags)  # type: ignore[misc]
                    a7(exp)  # type: ignore[misc]
                    a8(dt)  # type: ignore[misc]
                    if by >= stop:
                        st.item_done(by)
                        self.settle(st)
                        last = -1  # the stream's state may have changed
                pos = end
                continue
            end = pos + 24 + _BODYLEN(buf, pos + 8)[0]
            if end > n:
                break
            self.frame(buf, pos, end)
            last = -1
            pos = end
        for st in self.streams:  # memory bound: account what was buffered, now and then
            if st.state == "open":
                st.count_pending()
                self.settle(st)
        return pos

    def frame(self, buf: bytes, pos: int, end: int) -> None:
        magic, op, kl, el, dt, vb_or_status, _bl, opaque, cas = _HDR(buf, pos)
        if magic not in (0x80, 0x81):
            raise RangeUnavailableError(f"unexpected frame magic 0x{magic:02x} from the server")
        body = pos + 24
        if op == Opcode.DCP_NOOP and magic == 0x80:
            self.outbox.append(codec.response(Opcode.DCP_NOOP, opaque=opaque))
            return
        st = self.by_opaque.get(opaque)
        if st is None:
            return
        if magic == 0x81:
            if op == Opcode.DCP_STREAM_REQ and st.state == "requested":
                self.stream_response(st, vb_or_status, buf[body + el + kl:end])
            elif op == Opcode.DCP_CLOSE_STREAM and vb_or_status and st.state == "closing":
                st.state = "done"  # no stream to close (it had already ended)
            return
        if op == Opcode.DCP_STREAM_END:
            if st.state in ("open", "closing"):
                self.stream_end(st, _U32(buf, body)[0])
            return
        if st.state != "open":
            return
        if op == Opcode.DCP_SNAPSHOT_MARKER:
            s, e, f = _MARKER(buf, body if el == 20 else body + el)  # V1, or V2.x value
            st.marker(s, e, f)
            self.settle(st)
        elif op == Opcode.DCP_DELETION or op == Opcode.DCP_EXPIRATION:
            by, rev = _DEL(buf, pos)[9:11]
            k = body + el
            rows = st.rows
            rows[0].append(by)
            rows[1].append(OP_DELETION if op == Opcode.DCP_DELETION else OP_EXPIRATION)
            rows[2].append(buf[k:k + kl])
            rows[3].append(buf[k + kl:end] or None)
            rows[4].append(cas)
            rows[5].append(rev)
            rows[6].append(None)
            rows[7].append(None)
            rows[8].append(dt)
            st.pbytes += end - body
            if by >= st.stop or st.pbytes > BUFFER_BYTES:
                st.item_done(by)
                self.settle(st)
        elif op == Opcode.DCP_SEQNO_ADVANCED:
            st.item_done(_U64(buf, body)[0])
            self.settle(st)
        elif op == Opcode.DCP_MUTATION:
            raise RangeUnavailableError("malformed DCP_MUTATION from the server")


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
            ch.add_rollback(r.vbucket, r.rollback)  # type: ignore[arg-type]
        yield ch
    if not reads:
        return
    reader = _Reader(cfg, reads, name)
    try:
        yield from reader.run()
    finally:
        reader.shutdown()
