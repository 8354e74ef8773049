"""What a replica tells its source it holds: DCP_SEQNO_ACKNOWLEDGED per vbucket, so the
active can count this copy towards its majority (dcp/producer/durability.py).

Rules of this module:
- One ``Acks`` per replication connection (``stream_table.py`` owns it). Acks are on
  only when the source accepted the ``consumer_name`` control at the handshake
  (``link.py``): without it the source cannot tell which copy acknowledges.
- An ack reports ``held`` = the replica's high seqno for the vbucket (always the end of
  a whole applied snapshot: partial snapshots are never applied) and ``persisted`` = its
  persisted seqno, never above ``held``. It goes on the vbucket's plain replica stream
  only (a takeover's copy is in no chain yet: the source would ignore it and log it),
  with that stream's opaque (``ClientSession.seqno_acknowledged``).
- Coalesced: an accepted stream or an applied snapshot only marks the vbucket
  ``dirty``; ``send`` (called once per received chunk, after its events) sends at most
  one ack per dirty vbucket. So a chunk that completes ten snapshots of a vbucket costs
  one ack, with the last of them.
- After a flush (``flushed``, the manager's flush listener) an ack goes for every
  streaming vbucket whose persisted seqno moved since its last ack. Only vbuckets
  whose last ack had persisted < held can move, so only those are looked at.
- A new stream starts from nothing: the source forgot this replica's acks when the old
  stream ended, so the first ack on it is sent even if it repeats the last one.
- A refusal from the source (any non-success answer: an older source without
  SEQNO_ACKNOWLEDGED, or one that lost our consumer name) turns acks off for the rest
  of the connection, logged once per replication connection (not at every reconnect);
  the replica itself is not affected.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ...protocol.frames import Frame
from ...protocol.opcodes import Opcode, Status
from .link import Link
from .replica_stream import STREAMING, ReplicaStream
from .target import ReplicaTarget

__all__ = ["Acks"]

log = logging.getLogger("dcp.replication")


class Acks:
    """See the module rules."""

    __slots__ = ("behind", "dirty", "enabled", "name", "refused", "sent", "target")

    def __init__(self, name: str, target: ReplicaTarget) -> None:
        self.name = name
        self.target = target
        self.enabled = False
        #: vbuckets owing an ack at the end of the chunk being handled
        self.dirty: set[int] = set()
        #: per vbucket the last (held, persisted) sent on its current stream
        self.sent: dict[int, tuple[int, int]] = {}
        #: vbuckets whose last ack had persisted < held: a flush may move them
        self.behind: set[int] = set()
        self.refused = False

    def connected(self, enabled: bool) -> None:
        """A new connection (``enabled``: the source took our consumer name)."""
        self.enabled = enabled
        self.dirty.clear()
        self.sent.clear()
        self.behind.clear()

    def opened(self, vb: int) -> None:
        """The source accepted a plain replica stream: tell it what we hold from the start
        (an up-to-date replica may get no snapshot for a long time)."""
        self.sent.pop(vb, None)
        self.behind.discard(vb)
        if self.enabled:
            self.dirty.add(vb)

    def applied(self, vb: int) -> None:
        if self.enabled:
            self.dirty.add(vb)

    def send(self, link: Link, streams: Mapping[int, ReplicaStream]) -> None:
        """One ack per dirty vbucket still streaming (see the module rules)."""
        if not self.dirty:
            return
        dirty, self.dirty = self.dirty, set()
        if not self.enabled:
            return
        for vb in sorted(dirty):
            st = streams.get(vb)
            if st is not None and st.state == STREAMING:
                self._ack(link, vb)

    def flushed(self, link: Link, streams: Mapping[int, ReplicaStream]) -> None:
        """After a flush: ack the vbuckets whose persisted seqno moved."""
        if not self.enabled or not self.behind:
            return
        persisted_seqno = self.target.persisted_seqno
        for vb in sorted(self.behind):
            st = streams.get(vb)
            if st is None or st.state != STREAMING:
                self.behind.discard(vb)
                continue
            held, persisted = self.sent[vb]
            if min(persisted_seqno(vb), held) > persisted:
                self._ack(link, vb)

    def _ack(self, link: Link, vb: int) -> None:
        held = self.target.position(vb)[0]
        persisted = min(self.target.persisted_seqno(vb), held)
        if self.sent.get(vb) == (held, persisted):
            return
        frame = link.session.seqno_acknowledged(vb, held, persisted)
        if frame is None:  # the session has no accepted stream of vb (closed meanwhile)
            return
        link.send(frame)
        self.sent[vb] = (held, persisted)
        if persisted < held:
            self.behind.add(vb)
        else:
            self.behind.discard(vb)

    def answer(self, f: Frame) -> bool:
        """An answer to one of our acks (only refusals are answered): acks stop on this
        connection. False: not an answer to an ack."""
        if f.opcode != Opcode.DCP_SEQNO_ACKNOWLEDGED:
            return False
        if f.status != Status.SUCCESS and self.enabled:
            self.enabled = False
            self.dirty.clear()
            self.behind.clear()
            if not self.refused:
                self.refused = True
                log.warning(
                    "%s: the source refused DCP_SEQNO_ACKNOWLEDGED (status 0x%02x: %s); no "
                    "more acknowledgements on this connection (this copy does not count "
                    "towards its durable writes)",
                    self.name,
                    f.status,
                    bytes(f.value[:200]).decode("utf-8", "replace"),
                )
        return True
