"""Takeover: the hand-over at the end of a TAKEOVER stream (stream-request flag 0x01).

A takeover stream moves a vbucket's active copy to the consumer's node with no
acknowledged write lost (protocol_spec/README.md, "Takeover"). ``ActiveStream`` streams as
usual and delegates the hand-over to its ``Takeover``::

    STREAMING ─caught up─► DRAINING ─caught up─► PENDING_SENT ─ack─► DEAD_DRAINING
     (source active)    (source pending:         (DCP_SET_VBUCKET_     (source dead)
                         writes ETMPFAIL,         STATE pending sent)        │ caught up
                         other streams ended)                                ▼
                    DONE ◄─ack── ACTIVE_SENT (DCP_SET_VBUCKET_STATE active sent)
              (STREAM_END OK)

Rules of this module:
- Synchronous and socket-free, like active_stream.py: ``step`` runs inside the stream's
  ``fill`` when it has nothing else to send and appends at most one frame; ``acked``
  runs when the connection reads the consumer's SUCCESS to a state message
  (``events.StateAcked``, routed by opaque in dcp_handlers.py).
- "Caught up" is ``ActiveStream.is_caught_up``: in memory, nothing queued or half
  written, everything up to the high seqno out. The source turns PENDING only when
  caught up, so writes are refused for the shortest time; as PENDING refuses writes,
  what is drained after it is only what was queued before.
- The state changes it makes are real state changes of the vbucket: every other producer
  stream of the vbucket ends with StateChanged (``StreamRegistry.end_streams``), the
  flusher is woken to persist the state, and ``on_state`` records it with the node's
  assignment (``server.vbucket_states``, after the engine has it, so that nothing is
  changed twice): a later reconcile of the assignment must not undo a hand-over.
- The ACTIVE state is sent only once the source's DEAD state is on disk (``persisted``;
  the stream polls through ``StreamRegistry.wake_later`` meanwhile): a source that
  crashed after the destination turned active must not warm up active too.
- If the stream goes away before the end (connection lost, consumer refusal, close,
  shutdown; ``released``): a source this takeover left PENDING is ACTIVE again, with no
  new failover entry (nothing was handed over, the history is unchanged); a source that
  is already DEAD stays DEAD, because the consumer may have applied the active state:
  two active copies would be worse than none. Both are logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..protocol import codec
from ..protocol.opcodes import StreamEndStatus, VBucketState

if TYPE_CHECKING:
    from .active_stream import ActiveStream
    from .stream_registry import StreamRegistry

__all__ = ["Takeover", "TakeoverPhase"]

log = logging.getLogger("dcp.stream")


class TakeoverPhase(Enum):
    STREAMING = "streaming"
    DRAINING = "draining"
    PENDING_SENT = "pending-sent"
    DEAD_DRAINING = "dead-draining"
    ACTIVE_SENT = "active-sent"
    DONE = "done"
    ABORTED = "aborted"


_P = TakeoverPhase


class Takeover:
    """The hand-over state of one takeover stream (see the module rules)."""

    __slots__ = ("dead_version", "on_state", "persisted", "phase", "registry", "stream")

    def __init__(
        self,
        stream: ActiveStream,
        registry: StreamRegistry,
        on_state: Callable[[int, VBucketState], None] | None = None,
        persisted: Callable[[int, int], bool] | None = None,
    ) -> None:
        self.stream = stream
        self.registry = registry
        #: told (vbid, state) after each state change this takeover made
        self.on_state = on_state
        #: ``persisted(vbid, state_version)``: is that state of the vbucket on disk
        #: (``Flusher.state_persisted``)? None: do not wait (tests of the sequence)
        self.persisted = persisted
        self.dead_version = 0
        self.phase = _P.STREAMING

    def _set_state(self, state: VBucketState, *, takeover: bool = False) -> None:
        stream = self.stream
        stream.vbucket.set_state(state, takeover=takeover)
        ended = self.registry.end_streams(stream.vbid, StreamEndStatus.STATE_CHANGED, keep=stream)
        self.registry.wake_dirty()  # the flusher persists the new state
        if self.on_state is not None:
            self.on_state(stream.vbid, state)
        log.info(
            "takeover %s vb=%d: source is %s (other streams ended: %d)",
            stream.name,
            stream.vbid,
            state.name,
            ended,
        )

    def _send_state(self, buf: bytearray, buffer_log: Any, state: VBucketState) -> None:
        s = self.stream
        frame = codec.dcp_set_vbucket_state(s.vbid, s.opaque, int(state))
        buf += frame
        buffer_log.record(len(frame))
        log.info("takeover %s vb=%d: sent state %s", s.name, s.vbid, state.name)

    def step(self, buf: bytearray, buffer_log: Any) -> bool:
        """The stream has nothing else to send: move on if it is caught up. True when
        something changed (the stream should look again), False while it waits."""
        phase = self.phase
        if phase in (_P.PENDING_SENT, _P.ACTIVE_SENT, _P.DONE, _P.ABORTED):
            return False  # waiting for the consumer, or over
        if not self.stream.is_caught_up():
            return False
        if phase is _P.STREAMING:
            self.phase = _P.DRAINING
            self._set_state(VBucketState.PENDING)
        elif phase is _P.DRAINING:
            self.phase = _P.PENDING_SENT
            self._send_state(buf, buffer_log, VBucketState.PENDING)
        else:  # DEAD_DRAINING
            stream = self.stream
            if self.persisted is not None and not self.persisted(stream.vbid, self.dead_version):
                # the consumer becomes active on our answer: a crash before DEAD is on disk
                # would bring this copy back active too
                self.registry.wake_later(stream)
                return False
            self.phase = _P.ACTIVE_SENT
            self._send_state(buf, buffer_log, VBucketState.ACTIVE)
        return True

    def acked(self) -> bool:
        """The consumer applied the state last sent. False if none was waiting."""
        stream = self.stream
        if self.phase is _P.PENDING_SENT:
            self.phase = _P.DEAD_DRAINING
            self._set_state(VBucketState.DEAD)
            self.dead_version = stream.vbucket.state_version
        elif self.phase is _P.ACTIVE_SENT:
            self.phase = _P.DONE
            log.info(
                "takeover %s vb=%d: done at seqno %d",
                stream.name,
                stream.vbid,
                stream.last_sent_seqno,
            )
            stream.set_end(StreamEndStatus.OK)
        else:
            return False
        if stream.conn is not None:
            stream.conn.mark_ready(stream)
        return True

    def released(self, why: str) -> None:
        """The stream is gone (``ActiveStream.release``); undo what was not handed over."""
        phase = self.phase
        if phase in (_P.STREAMING, _P.DONE, _P.ABORTED):
            return
        self.phase = _P.ABORTED
        stream = self.stream
        vb = stream.vbucket
        if phase in (_P.DRAINING, _P.PENDING_SENT):
            if vb.state is VBucketState.PENDING:
                log.warning(
                    "takeover %s vb=%d aborted before the hand-over (%s): source active again",
                    stream.name,
                    stream.vbid,
                    why,
                )
                self._set_state(VBucketState.ACTIVE, takeover=True)
            else:
                log.warning(
                    "takeover %s vb=%d aborted (%s); the vbucket is %s, left as it is",
                    stream.name,
                    stream.vbid,
                    why,
                    vb.state.name,
                )
            return
        log.error(
            "takeover %s vb=%d lost after the consumer took the pending state (%s): the "
            "source stays %s; the consumer holds every item (seqno %d) and may not have "
            "the active state: make it active there",
            stream.name,
            stream.vbid,
            why,
            vb.state.name,
            stream.last_sent_seqno,
        )

    def statistics(self) -> dict[str, Any]:
        return {"takeover": self.phase.value}
