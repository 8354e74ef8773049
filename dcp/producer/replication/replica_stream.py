"""One replicated vbucket on a source connection: its stream's state, the snapshot being
received, and the checks that keep a hostile or broken source from corrupting it.

Rules of this module:
- State and checks only, no I/O: ``source.py`` drives a ``ReplicaStream`` from the
  session's events and decides what to send. Every check that fails raises
  ``BadInput`` and leaves the record as it was; the caller then closes that one stream.
- A snapshot is buffered whole (``marker`` ... ``add`` ... ``take``) and handed to the
  target only when the session says it is complete, so a replica only ever holds whole
  snapshots: a snapshot cut short (bad input, a closed stream, a lost connection) is
  dropped with ``discard``.
- The checks (with ``last_end``: the replica's high seqno as this stream knows it): a
  marker must not open inside another, must have start <= end and end > last_end; every
  item must belong to this vbucket, lie in the marker's [start, end], and be above
  last_end and above the item before it (strictly increasing seqnos).
- ``gen`` changes whenever the stream is re-requested, closed or dropped: a retry or a
  rollback scheduled for an older generation does nothing.
- Backoff: ``attempts`` counts failures since the stream was last accepted, ``bad``
  the bad-input failures since a snapshot was last applied (so a source that accepts
  streams and then sends garbage still backs off); the delay grows with the larger.
"""

from __future__ import annotations

import random

from ..engine.item import Item

__all__ = [
    "BACKOFF",
    "CLOSE_WAIT",
    "REQUESTED",
    "STREAMING",
    "TAKEOVER",
    "BadInput",
    "Closing",
    "ReplicaStream",
    "backoff_delay",
]

# stream states, as the STAT group ``replication`` shows them (vb_<N>:stream)
REQUESTED = "requested"
STREAMING = "streaming"
BACKOFF = "backoff"
TAKEOVER = "takeover"


#: seconds a new stream of a vbucket waits for the end of the one closed before it; then
#: it is asked for anyway (a source that never ends closed streams refuses it at worst)
CLOSE_WAIT = 2.0


class Closing:
    """Streams closed (DCP_CLOSE_STREAM sent) whose end has not come yet, and the
    vbuckets whose new stream waits for that end: the source keeps a closed stream until
    its STREAM_END is out, and refuses a new request for that vbucket until then."""

    __slots__ = ("by_opaque", "by_vb", "waiting")

    def __init__(self) -> None:
        self.by_opaque: dict[int, int] = {}  # opaque of the closed stream -> vb
        self.by_vb: dict[int, tuple[int, float]] = {}  # vb -> (that opaque, when closed)
        self.waiting: set[int] = set()  # vbuckets whose request waits for the end

    def add(self, opaque: int, vb: int, now: float) -> None:
        self.by_opaque[opaque] = vb
        self.by_vb[vb] = (opaque, now)

    def since(self, vb: int) -> float | None:
        """When the stream of ``vb`` still being closed was closed (None: none is)."""
        got = self.by_vb.get(vb)
        return None if got is None else got[1]

    def ended(self, opaque: int) -> int | None:
        """The closed stream ``opaque`` is over: its vbucket if one waits for it."""
        vb = self.by_opaque.pop(opaque, None)
        if vb is None:
            return None
        if self.by_vb.get(vb, (None, 0.0))[0] == opaque:
            del self.by_vb[vb]
        if vb in self.waiting:
            self.waiting.discard(vb)
            return vb
        return None

    def give_up(self, vb: int) -> int | None:
        """Stop waiting for ``vb``'s closed stream; its opaque (to forget), or None."""
        got = self.by_vb.pop(vb, None)
        self.waiting.discard(vb)
        if got is None:
            return None
        self.by_opaque.pop(got[0], None)
        return got[0]

    def clear(self) -> None:
        self.by_opaque.clear()
        self.by_vb.clear()
        self.waiting.clear()


class BadInput(Exception):
    """The source sent something this replica must not apply (the message says what)."""


def backoff_delay(attempts: int, initial: float, maximum: float) -> float:
    """Exponential backoff with jitter: up to ``initial * 2**(attempts-1)``, capped at
    ``maximum``, drawn from its upper half so that many vbuckets (or nodes) failing at
    once do not retry in lock-step."""
    if attempts <= 0:
        return 0.0
    d = min(maximum, initial * 2 ** min(attempts - 1, 30))
    return d * random.uniform(0.5, 1.0)


class ReplicaStream:
    """See the module rules. ``takeover``: requested with the TAKEOVER flag."""

    __slots__ = (
        "attempts",
        "bad",
        "finishing",
        "gen",
        "items",
        "last_end",
        "opaque",
        "reached",
        "refused",
        "snap",
        "source_seqno",
        "state",
        "takeover",
        "vb",
    )

    def __init__(self, vb: int, takeover: bool) -> None:
        self.vb = vb
        self.takeover = takeover
        self.state = BACKOFF
        self.opaque: int | None = None  # of the current stream request, None when none
        self.gen = 0
        self.last_end = 0
        self.source_seqno = 0  # highest snapshot end (or advanced seqno) the source sent
        self.snap: tuple[int, int, int] | None = None  # (start, end, flags) being received
        #: the highest seqno the open snapshot has reached (an item or SEQNO_ADVANCED):
        #: it is whole only when that is its end
        self.reached = 0
        self.items: list[Item] = []
        self.attempts = 0
        self.bad = 0
        self.refused: int | None = None  # last refusal status logged (log once per change)
        #: a takeover reached ACTIVE: nothing more to stream, waiting for its STREAM_END
        self.finishing = False

    def requested(self, opaque: int, high_seqno: int) -> None:
        self.gen += 1
        self.opaque = opaque
        self.state = REQUESTED
        self.last_end = high_seqno
        self.discard()

    def stopped(self) -> None:
        """The stream is closed, refused, ended or its connection lost."""
        self.gen += 1
        self.opaque = None
        self.state = BACKOFF
        self.discard()

    def discard(self) -> None:
        self.snap = None
        self.items = []
        self.reached = 0

    def marker(self, start: int, end: int, flags: int) -> None:
        if self.snap is not None:
            raise BadInput(
                f"snapshot marker [{start}, {end}] inside the open {list(self.snap[:2])}"
            )
        if start > end:
            raise BadInput(f"snapshot marker start {start} > end {end}")
        if end <= self.last_end:
            raise BadInput(
                f"snapshot marker [{start}, {end}] does not advance past {self.last_end}"
            )
        self.snap = (start, end, flags)
        self.items = []
        self.reached = 0
        if end > self.source_seqno:
            self.source_seqno = end

    def add(self, items: list[Item]) -> None:
        snap = self.snap
        if snap is None:
            raise BadInput("items outside a snapshot")
        start, end, _flags = snap
        have = self.items
        lo = have[-1].seqno if have else max(self.last_end, start - 1)
        vb = self.vb
        for it in items:
            s = it.seqno
            if it.vbucket != vb:
                raise BadInput(f"seqno {s} is an item of vb {it.vbucket}")
            if not lo < s <= end:
                if s <= lo:
                    raise BadInput(f"seqno {s} is not above {lo} (out of order or repeated)")
                raise BadInput(f"seqno {s} is outside the snapshot [{start}, {end}]")
            lo = s
        if have:
            have.extend(items)
        else:
            self.items = list(items)
        if items:
            self.reached = items[-1].seqno

    def advanced(self, seqno: int) -> None:
        if seqno > self.source_seqno:
            self.source_seqno = seqno
        if self.snap is not None and seqno > self.reached:
            self.reached = seqno

    def take(self) -> tuple[int, int, int, list[Item]]:
        """The complete snapshot: ``(start, end, flags, items)``; the buffer is emptied."""
        snap = self.snap
        if snap is None:
            raise BadInput("snapshot end without a marker")
        items = self.items
        reached = self.reached
        self.discard()
        if reached != snap[1]:
            # the session completes a snapshot at the next marker or a STREAM_END(OK)
            # too; a replica applying it would hold half of the source's snapshot
            raise BadInput(
                f"snapshot [{snap[0]}, {snap[1]}] ended at seqno {reached}, before its end"
            )
        return snap[0], snap[1], snap[2], items

    def applied(self, end: int) -> None:
        self.last_end = end
        self.bad = 0

    def delay(self, initial: float, maximum: float) -> float:
        return backoff_delay(max(self.attempts, self.bad), initial, maximum)
