"""Executor side: read planned vbucket ranges ``(start, end]`` from the server, in whole
snapshots, into change sets (the I/O half; the decisions are in ``ranges.py``).

Rules of this module:
- One connection per Spark task; every vbucket of the task is streamed on it at once
  (stream requests pipelined, streams matched by opaque). When the task ends, every
  stream is closed and its STREAM_END awaited (briefly) before the socket is closed.
- On a cluster the task's ranges were planned on one node (the partition's ``node``);
  a range whose vbucket leaves it while it is read (the node is gone, answers
  NOT_MY_VBUCKET, or ends the stream STATE_CHANGED) is handed to the vbucket's new
  owner by the refreshed map (``relocate``) and read there from its last accepted
  snapshot end with its own uuid: one connection per node, one node after another.
- Streams are requested open-ended (end seqno 2**64-1) and stopped by the reader once
  the range is read: the server keeps every marker's real end, and a finite end would
  add nothing but a server-side cut (whose disk-backfill path currently ends streams
  early: docs/spark.md, "Limits and server notes").
- A lost connection, a stream end or a retriable refusal is retried from the range's
  last accepted snapshot end, with back-off, for ``retryTimeout`` seconds; then the task
  fails with ``RangeUnavailableError``.
- What each frame means for its range (history checks included) is
  ``stream_frames.py``'s; the decisions themselves are ``ranges.py``'s.
- An I/O shell over the connection's ``ClientSession`` (``dcp.protocol.session``): it
  decodes (magic, opcode and extras decide what a frame is), answers noops and matches
  stream answers. With ``item_frames`` the session hands a run of items over as frame
  offsets in the receive buffer (one ``ItemFrames`` event), which ``columns.py`` turns
  into one Arrow record batch without a Python object per row. A frame that breaks the
  protocol fails the task with ``RangeUnavailableError``.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dcp.protocol import SEQNO_MAX, DcpOpenFlag, RemoteProtocolError
from dcp.protocol import events as ev
from dcp.protocol.cluster_config import Address, format_address
from dcp.protocol.opcodes import SnapshotMarkerFlag
from dcp.protocol.session import ClientSession

from .batch_plan import VbRange
from .changes import Chunk, deletion_row, expiration_row, mutation_row
from .cluster import Topology
from .errors import RangeUnavailableError
from .options import SourceConfig
from .ranges import BUFFER_BYTES, RangeRead
from .stream_frames import StreamFrames
from .wire import ConnectionLost, WireClient

__all__ = ["DRAIN_SECONDS", "read_ranges"]

log = logging.getLogger("dcp.spark")

#: How long a finished task waits for the STREAM_ENDs of the streams it closed.
DRAIN_SECONDS = 2.0
_HISTORY = int(SnapshotMarkerFlag.HISTORY)
_FRAMES = ev.ItemFrames


class _Reader(StreamFrames):
    """The ranges of one Spark task, read over one connection (see the module rules)."""

    def __init__(
        self,
        cfg: SourceConfig,
        streams: Sequence[RangeRead],
        name: str,
        out: Chunk,
        address: Address | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.out = out
        self.streams = list(streams)
        self.address = address  # the node (None: the query's single server)
        self.topology = topology  # a cluster's map (None: a single server)
        self.moved: list[tuple[Address, RangeRead]] = []  # ranges that left for another node
        self.by_opaque: dict[int, RangeRead] = {}
        self.client: WireClient | None = None
        self.outbox: list[bytes] = []  # requests to send with the next write
        self.retry_at: dict[int, float] = {}  # vbucket -> monotonic time of the next request
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.Items: self._items,
            ev.ItemFrames: self._items,
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
            ClientSession(
                item_frames=True,
                mutation=mutation_row,
                deletion=deletion_row,
                expiration=expiration_row,
            ),
            self.address,
        )
        client.connect()
        controls = {
            "send_stream_end_on_client_close_stream": "true",
            "enable_expiry_opcode": "true",
            # A disk range whose last seqno was a purged tombstone
            # then completes without waiting for the next change.
            "send_seqno_advanced": "true",
            # Refused without a history window on the server: fine.
            "change_streams": "true",
        }
        if self.cfg.stable_only:
            controls["stable_only"] = "true"
        try:
            accepted = client.dcp_open(
                f"{self.name}:{os.getpid()}:{secrets.token_hex(4)}",
                flags=int(DcpOpenFlag.PRODUCER | DcpOpenFlag.INCLUDE_DELETE_TIMES),
                controls=controls,
            )
            if self.cfg.stable_only and not accepted["stable_only"]:
                # never read unstable changes instead: the query asked not to
                raise RangeUnavailableError(
                    f"option stableOnly=true: {self.where()} refused the "
                    f"DCP control stable_only (a server without stable-only streams); "
                    f"upgrade it or drop the option"
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
                f"vbucket {st.rng.vbucket} on {self.where()}: gave up after "
                f"{now - st.failing_since:.1f} s of "
                f"retries (option retryTimeout={self.cfg.retry_timeout:g}; 'forever' never "
                f"gives up): {why}"
            )
        if st.failing_since == now:
            log.warning("vbucket %d: %s; retrying (option retryTimeout)", st.rng.vbucket, why)
        st.attempts += 1
        st.drop_pending()
        st.state = "retry"
        self.retry_at[st.rng.vbucket] = now + min(2.0, 0.05 * 2 ** min(st.attempts, 6))

    def where(self) -> str:
        return format_address(self.address or (self.cfg.host, self.cfg.port))

    def relocate(self, sts: Sequence[RangeRead], body: bytes | None = None) -> None:
        """On a cluster, after trouble with ``sts`` (each waiting to be retried): refresh
        the map (``body``: the config a NOT_MY_VBUCKET answer carried) and hand each range
        whose vbucket is now active elsewhere to that node (``moved``), to be requested
        there from its last accepted snapshot end with its own uuid, so the new owner
        answers ROLLBACK exactly when the range is not on its branch. A range whose
        vbucket has no active yet stays, retried here with back-off until one appears or
        ``retryTimeout`` ends."""
        topo = self.topology
        if topo is None:
            return
        topo.refresh(body)
        for st in sts:
            owner = topo.owner(st.rng.vbucket)
            if st.state == "retry" and owner is not None and owner != self.address:
                log.info(
                    "vbucket %d moved from %s to %s; reading the rest of (%d, %d] there",
                    st.rng.vbucket,
                    self.where(),
                    format_address(owner),
                    st.c,
                    st.end,
                )
                self.retry_at.pop(st.rng.vbucket, None)
                st.state = "moved"
                self.streams.remove(st)
                self.moved.append((owner, st))

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
        runs = [e for e in events if type(e) is _FRAMES]
        if runs:  # every run of the chunk decoded at once (columns.from_runs)
            from .columns import from_runs

            batches = iter(from_runs(runs))
            for e in events:
                if type(e) is _FRAMES:
                    self._items(e, next(batches))
                else:
                    handlers[type(e)](e)
        else:
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
        pending = [st for st in self.streams if not st.done]
        for st in pending:
            self.schedule_retry(st, f"connection lost: {exc}")
        self.relocate(pending)
        if not self.retry_at:
            return  # every range left for another node
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


def _ignore(_e: object) -> None:
    pass


def read_ranges(
    cfg: SourceConfig, ranges: Sequence[VbRange], name: str, node: Address | None = None
) -> Iterator[Chunk]:
    """The change set of every range, in chunks of about ``cfg.arrow_batch_rows`` rows.

    Rollback ranges (``VbRange.rollback`` set, planned by the driver) yield their
    rollback row without touching the server. ``node``: the cluster node the planner
    found holding the ranges' vbuckets (None: the query's single server); ranges whose
    vbucket moves while they are read are read on, node after node (``_Reader.relocate``).
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
    out = Chunk()
    topology = Topology(cfg) if node is not None else None
    todo: dict[Address | None, list[RangeRead]] = {
        node: [RangeRead(r, out, cfg.on_merged_snapshot) for r in reads]
    }
    while todo:  # bounded: every move is a retry of its range (``schedule_retry``'s deadline)
        addr = next(iter(todo))
        reader = _Reader(cfg, todo.pop(addr), name, out, addr, topology)
        try:
            yield from reader.run()
        finally:
            reader.shutdown()
        for owner, st in reader.moved:
            todo.setdefault(owner, []).append(st)
