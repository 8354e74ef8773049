"""The streams of one replication connection: what is asked of the source for each
vbucket, and what its answers and items do to the ``ReplicaTarget``.

Rules of this module:
- ``StreamTable`` holds one ``ReplicaStream`` (``replica_stream.py``) per wanted vbucket
  and handles the session's events for them; ``source.py`` owns the connection and sets
  ``link``/``nursery`` while connected (None otherwise). Every handler is synchronous
  but the rollback, which runs as a task of the connection's nursery.
- Items are built as engine ``Item``s directly by the session's decoder (``make_session``,
  make_items.py) and buffered per vbucket; each WHOLE snapshot is applied with one
  ``target.apply_snapshot`` when the session completes it, then its bytes are reported
  ``handed`` so flow-control acks flow. A snapshot cut short is never applied.
- Bad input on one stream (the checks of ``replica_stream.py``, a snapshot or failover
  log the target refuses, a state message outside a takeover) closes THAT stream
  (CLOSE_STREAM; its late frames are ignored but for flow control), logs one error line
  and re-requests it after backoff. Other streams carry on.
- A closed stream stays at the source until its STREAM_END is out (we ask for one on
  close), and the source refuses another request for that vbucket on this connection
  meanwhile (KEY_EEXISTS). So a vbucket's new stream (a replica stream turned takeover,
  a retry after bad input) is requested only once the closed one's end (or its refusal)
  has come back, or after ``CLOSE_WAIT`` at the latest (``replica_stream.Closing``).
- Stream answers: ROLLBACK -> ``target.rollback`` (shielded from cancellation: a
  half-done rollback must finish) then re-request (at once the first time, with backoff
  when it repeats); refused -> retry with backoff, logged once per change of status;
  STREAM_END -> re-request after backoff, except the end of a finished takeover.
- Takeover: a DCP_SET_VBUCKET_STATE (pending, then active) of a takeover stream is
  applied with ``target.set_state(..., takeover=True)``, then acked; after ACTIVE the
  vbucket is finishing (``on_state`` tells the manager, which stops asking for it) and
  leaves the table at its STREAM_END (or when the connection goes).
- Acks (acks.py): an accepted plain stream and each applied snapshot mark the vbucket
  for a SEQNO_ACKNOWLEDGED, which ``source.py`` sends once per received chunk.
- Retries are due times in a heap (``due``) that the connection's opener task serves;
  an entry whose generation is stale (``ReplicaStream.gen``) is skipped.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable

import trio

from ...protocol import events as ev
from ...protocol.errors import StatusError
from ...protocol.frames import Frame
from ...protocol.opcodes import SEQNO_MAX, Status, StreamEndStatus, StreamRequestFlag, VBucketState
from .acks import Acks
from .link import Link, SourceSettings
from .replica_stream import (
    BACKOFF,
    CLOSE_WAIT,
    STREAMING,
    TAKEOVER,
    BadInput,
    Closing,
    ReplicaStream,
)
from .target import ReplicaTarget

__all__ = ["StreamTable"]

log = logging.getLogger("dcp.replication")

_TAKEOVER = int(StreamRequestFlag.TAKEOVER)


class StreamTable:
    """See the module rules. ``on_state(vb, state)``: a takeover stream changed the
    vbucket's state here; ``on_idle()``: nothing is left to stream or finish."""

    def __init__(
        self,
        name: str,
        target: ReplicaTarget,
        settings: SourceSettings,
        *,
        on_state: Callable[[int, VBucketState], None],
        on_idle: Callable[[], None],
    ) -> None:
        self.name = name
        self.target = target
        self.settings = settings
        self.on_state = on_state
        self.on_idle = on_idle
        self.streams: dict[int, ReplicaStream] = {}  # wanted vbuckets
        self.by_opaque: dict[int, ReplicaStream] = {}  # streams requested on this link
        self.due: list[tuple[float, int, int]] = []  # (time, vb, gen) of retries
        self.due_wake = trio.Event()
        self.closing = Closing()
        self.link: Link | None = None
        self.nursery: trio.Nursery | None = None
        self.acks = Acks(name, target)  # SEQNO_ACKNOWLEDGED to the source (acks.py)
        self.counters = dict.fromkeys(
            ("bytes_received", "items_applied", "snapshots_applied", "rollbacks", "reconnects"),
            0,
        )
        self.handlers: dict[type, Callable] = {
            ev.Items: self._items,
            ev.Marker: self._marker,
            ev.SnapshotDone: self._snapshot_done,
            ev.SeqnoAdvanced: self._advanced,
            ev.StreamOpened: self._opened,
            ev.StreamEnded: self._ended,
            ev.StreamRollback: self._rolled_back,
            ev.StreamRefused: self._refused,
            ev.VBucketStateSet: self._state_set,
            ev.Answer: self._answer,  # refused acks; CLOSE_STREAM and probe answers
        }

    # ------------------------------------------------------------------ wanted vbuckets

    def want(self, vb: int, takeover: bool) -> None:
        """Stream ``vb`` (with the TAKEOVER flag if ``takeover``)."""
        st = self.streams.get(vb)
        if st is not None and st.takeover == takeover:
            return
        if st is not None:
            self._close(st)
        st = self.streams[vb] = ReplicaStream(vb, takeover)
        if self.link is not None:
            self.request(st)

    def drop(self, vb: int) -> None:
        """Stop streaming ``vb`` (CLOSE_STREAM if a stream is open)."""
        st = self.streams.pop(vb, None)
        if st is not None:
            self._close(st)
            st.stopped()

    def idle(self) -> bool:
        return not self.streams

    def connected(self, link: Link, nursery: trio.Nursery) -> None:
        """A new link: request every wanted stream from its position."""
        self.link = link
        self.nursery = nursery
        self.acks.connected(link.acks)
        for st in list(self.streams.values()):
            self.request(st)

    def disconnected(self) -> None:
        """The link is gone: every stream stops, partial snapshots are dropped."""
        self.link = None
        self.nursery = None
        self.by_opaque.clear()
        self.due.clear()
        self.closing.clear()
        for vb, st in list(self.streams.items()):
            if st.finishing:  # the takeover is done; its STREAM_END was lost with the link
                del self.streams[vb]
            st.stopped()

    def serve_due(self, now: float) -> float | None:
        """Request the streams whose retry is due; the next due time (None: none)."""
        due = self.due
        while due and due[0][0] <= now:
            _, vb, gen = heapq.heappop(due)
            st = self.streams.get(vb)
            if st is not None and st.gen == gen and st.state == BACKOFF:
                self.request(st)
        return due[0][0] if due else None

    # ------------------------------------------------------------------ streams

    def request(self, st: ReplicaStream) -> None:
        link = self.link
        assert link is not None
        since = self.closing.since(st.vb)
        if since is not None:  # the vbucket's closed stream has not ended yet
            if trio.current_time() - since < CLOSE_WAIT:
                self.closing.waiting.add(st.vb)  # asked for at that stream's end
                heapq.heappush(self.due, (since + CLOSE_WAIT, st.vb, st.gen))
                self.due_wake.set()
                return
            old = self.closing.give_up(st.vb)
            if old is not None:
                link.session.forget(old)
        try:
            start, snap_start, snap_end, uuid = self.target.position(st.vb)
        except (ValueError, StatusError) as exc:
            self._retry(st, f"no position: {exc}")
            return
        opaque, data = link.session.stream_request(
            st.vb,
            start=start,
            end=SEQNO_MAX,
            vb_uuid=uuid,
            snap_start=snap_start,
            snap_end=snap_end,
            flags=_TAKEOVER if st.takeover else 0,
        )
        st.requested(opaque, start)
        self.by_opaque[opaque] = st
        link.send(data)

    def _retry(self, st: ReplicaStream, why: str | None = None, delay: float | None = None) -> None:
        """The stream is over; ask again after backoff (or ``delay``)."""
        if st.opaque is not None:
            self.by_opaque.pop(st.opaque, None)
        st.stopped()
        st.attempts += 1
        cfg = self.settings
        if delay is None:
            delay = st.delay(cfg.backoff_initial, cfg.backoff_max)
        if why is not None:
            log.info("%s vb %d: %s; again in %.2fs", self.name, st.vb, why, delay)
        heapq.heappush(self.due, (trio.current_time() + delay, st.vb, st.gen))
        self.due_wake.set()

    def _close(self, st: ReplicaStream) -> None:
        """CLOSE_STREAM; its late frames then only count for flow control, and its end
        lets the vbucket's next stream be asked for (module rules)."""
        link = self.link
        if st.opaque is not None and link is not None:
            self.by_opaque.pop(st.opaque, None)
            if st.state != BACKOFF:
                link.send(link.session.close_stream(st.vb)[1])
                self.closing.add(st.opaque, st.vb, trio.current_time())
            else:
                link.session.forget(st.opaque)

    def _closed(self, opaque: int) -> None:
        """A stream closed earlier ended (or its request was answered no): the new
        stream of its vbucket, if one waits, is asked for now."""
        vb = self.closing.ended(opaque)
        st = self.streams.get(vb) if vb is not None else None
        if st is not None and st.state == BACKOFF and self.link is not None:
            self.request(st)

    def _bad(self, st: ReplicaStream, why: str) -> None:
        log.error(
            "%s vb %d: bad input from the source: %s; stream closed",
            self.name,
            st.vb,
            why,
        )
        self._close(st)
        st.bad += 1
        self._retry(st)

    def _live(self, opaque: int) -> ReplicaStream | None:
        return self.by_opaque.get(opaque)

    # ------------------------------------------------------------------ session events

    def _opened(self, e: ev.StreamOpened) -> None:
        st = self._live(e.opaque)
        if st is None:
            return
        st.state = TAKEOVER if st.takeover else STREAMING
        st.attempts = 0
        st.refused = None
        if not st.takeover:
            self.acks.opened(st.vb)
        try:
            self.target.adopt_failover_log(st.vb, [(u, s) for u, s in e.failover_log])
        except (ValueError, StatusError) as exc:
            self._bad(st, f"failover log not adopted: {exc}")

    def _marker(self, e: ev.Marker) -> None:
        st = self._live(e.opaque)
        if st is not None:
            try:
                st.marker(e.start, e.end, e.flags)
            except BadInput as exc:
                self._bad(st, str(exc))

    def _items(self, e: ev.Items) -> None:
        st = self._live(e.opaque)
        if st is not None:
            try:
                st.add(e.items)
            except BadInput as exc:
                self._bad(st, str(exc))

    def _advanced(self, e: ev.SeqnoAdvanced) -> None:
        st = self._live(e.opaque)
        if st is not None:
            st.advanced(e.seqno)

    def _snapshot_done(self, e: ev.SnapshotDone) -> None:
        link = self.link
        assert link is not None
        st = self._live(e.opaque)
        if st is not None:
            try:
                start, end, flags, items = st.take()
                self.target.apply_snapshot(st.vb, start, end, flags, items)
            except (BadInput, ValueError, StatusError) as exc:
                self._bad(st, f"snapshot not applied: {exc}")
            else:
                st.applied(end)
                self.acks.applied(st.vb)
                self.counters["items_applied"] += len(items)
                self.counters["snapshots_applied"] += 1
        link.send(link.session.handed(e.nbytes))  # applied or dropped, its bytes are done

    def _ended(self, e: ev.StreamEnded) -> None:
        st = self.by_opaque.pop(e.opaque, None)
        if st is None:
            return self._closed(e.opaque)
        if st.finishing:
            if self.streams.get(st.vb) is st:
                del self.streams[st.vb]
            st.stopped()
            if self.idle():
                self.on_idle()
            return
        name = _name(StreamEndStatus, e.reason)
        self._retry(st, f"stream ended ({name})")

    def _rolled_back(self, e: ev.StreamRollback) -> None:
        st = self.by_opaque.pop(e.opaque, None)
        if st is None:
            return self._closed(e.opaque)
        if self.nursery is None:
            return
        self.counters["rollbacks"] += 1
        st.stopped()
        self.nursery.start_soon(self._rollback, st, e.seqno, st.gen)

    async def _rollback(self, st: ReplicaStream, seqno: int, gen: int) -> None:
        with trio.CancelScope(shield=True):
            try:
                got = await self.target.rollback(st.vb, seqno)
            except (ValueError, StatusError) as exc:
                log.error("%s vb %d: rollback to %d failed: %s", self.name, st.vb, seqno, exc)
                got = None
        if st.gen != gen or self.streams.get(st.vb) is not st:
            return  # dropped or re-requested meanwhile
        if got is None:
            self._retry(st)
            return
        log.info(
            "%s vb %d: the source asked for a rollback to %d; rolled back to %d",
            self.name,
            st.vb,
            seqno,
            got,
        )
        # the first rollback is followed at once; repeated ones back off
        self._retry(st, delay=0.0 if st.attempts == 0 else None)

    def _refused(self, e: ev.StreamRefused) -> None:
        st = self.by_opaque.pop(e.opaque, None)
        if st is None:
            return self._closed(e.opaque)
        if e.status != st.refused:
            log.warning(
                "%s vb %d: stream request refused: %s (retrying)",
                self.name,
                st.vb,
                _name(Status, e.status),
            )
            st.refused = e.status
        self._retry(st)

    def _answer(self, e: ev.Answer) -> None:
        if isinstance(e.result, Frame):  # an ack's refusal, else CLOSE_STREAM or a probe
            self.acks.answer(e.result)

    def _state_set(self, e: ev.VBucketStateSet) -> None:
        link = self.link
        assert link is not None
        st = self._live(e.opaque)
        if st is None:
            return
        if not st.takeover:
            return self._bad(st, f"DCP_SET_VBUCKET_STATE {e.state} on a stream that is no takeover")
        if e.state not in (VBucketState.PENDING, VBucketState.ACTIVE):
            return self._bad(st, f"DCP_SET_VBUCKET_STATE to state {e.state} in a takeover")
        state = VBucketState(e.state)
        if state == VBucketState.ACTIVE and self.target.state(st.vb) != VBucketState.PENDING:
            # the hand-over is pending first, always: a source that skips it may still be
            # active itself, and two active copies must never exist
            return self._bad(st, "DCP_SET_VBUCKET_STATE active before pending")
        try:
            self.target.set_state(st.vb, state, takeover=True)
        except (ValueError, StatusError) as exc:
            return self._bad(st, f"state {state.name.lower()} not applied: {exc}")
        link.send(link.session.ack_state(e))
        if state == VBucketState.ACTIVE:
            st.finishing = True
            log.info("%s vb %d: takeover done, active here", self.name, st.vb)
        self.on_state(st.vb, state)


def _name(enum: type, value: int) -> str:
    try:
        return enum(value).name
    except ValueError:
        return f"0x{value:02x}"
