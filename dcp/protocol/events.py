"""What a protocol session reports: change items and connection events.

Rules of this module:
- Plain slotted classes, built positionally by the session's decoder (the hot path):
  no validation, no frozen dataclasses, no behaviour (but ``ItemFrames.items``, which
  builds the items a run stands for, with ``decode_frames.frame_items``). Treat them
  as read-only.
- Change items (``Mutation``, ``Deletion``, ``Expiration``) are what applications get
  (``dcp.consumer`` re-exports them); they never travel alone: a run of items of one
  stream arrives as one ``Items`` event, so the per-item cost is the item itself; a
  session asked for ``item_frames`` reports such a run as one ``ItemFrames`` instead:
  the offsets of its frames in the receive buffer, for a consumer that decodes them
  itself (vectorized), so the per-item cost is one int.
- Events name their stream by the opaque of its stream request and carry its vbucket.
  Events of the client side (``dcp.protocol.session.ClientSession``) are defined here,
  and the two events of the server side (``server_session.ServerSession``) that are not
  a client's request frame: ``Rejected`` and ``StateAcked``.
- No I/O, no trio.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Answer",
    "Deletion",
    "Expiration",
    "ItemFrames",
    "Items",
    "Marker",
    "Mutation",
    "Rejected",
    "SeqnoAdvanced",
    "SnapshotDone",
    "StateAcked",
    "StreamEnded",
    "StreamOpened",
    "StreamRefused",
    "StreamRollback",
    "VBucketStateSet",
]

FailoverLog = tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------- change items


class Mutation:
    """A document was created or updated (DCP_MUTATION)."""

    __slots__ = (
        "cas",
        "datatype",
        "expiry",
        "flags",
        "key",
        "lock_time",
        "rev_seqno",
        "seqno",
        "value",
        "vbucket",
    )
    kind = "mutation"

    def __init__(
        self,
        vbucket: int,
        seqno: int,
        rev_seqno: int,
        cas: int,
        flags: int,
        expiry: int,
        lock_time: int,
        datatype: int,
        key: bytes,
        value: bytes,
    ) -> None:
        self.vbucket = vbucket
        self.seqno = seqno
        self.rev_seqno = rev_seqno
        self.cas = cas
        self.flags = flags
        self.expiry = expiry
        self.lock_time = lock_time
        self.datatype = datatype
        self.key = key
        self.value = value

    def __repr__(self) -> str:
        return (
            f"Mutation(vb={self.vbucket}, seqno={self.seqno}, key={self.key!r}, "
            f"value={self.value[:32]!r}, cas={self.cas})"
        )


class Deletion:
    """A document was deleted (DCP_DELETION). ``delete_time`` is None for V1 deletions."""

    __slots__ = ("cas", "datatype", "delete_time", "key", "rev_seqno", "seqno", "value", "vbucket")
    kind = "deletion"

    def __init__(
        self,
        vbucket: int,
        seqno: int,
        rev_seqno: int,
        cas: int,
        datatype: int,
        key: bytes,
        value: bytes,
        delete_time: int | None,
    ) -> None:
        self.vbucket = vbucket
        self.seqno = seqno
        self.rev_seqno = rev_seqno
        self.cas = cas
        self.datatype = datatype
        self.key = key
        self.value = value
        self.delete_time = delete_time

    def __repr__(self) -> str:
        return f"Deletion(vb={self.vbucket}, seqno={self.seqno}, key={self.key!r})"


class Expiration:
    """A document expired (DCP_EXPIRATION; the consumer must have asked for them)."""

    __slots__ = ("cas", "delete_time", "key", "rev_seqno", "seqno", "vbucket")
    kind = "expiration"

    def __init__(
        self,
        vbucket: int,
        seqno: int,
        rev_seqno: int,
        cas: int,
        key: bytes,
        delete_time: int,
    ) -> None:
        self.vbucket = vbucket
        self.seqno = seqno
        self.rev_seqno = rev_seqno
        self.cas = cas
        self.key = key
        self.delete_time = delete_time

    def __repr__(self) -> str:
        return f"Expiration(vb={self.vbucket}, seqno={self.seqno}, key={self.key!r})"


# --------------------------------------------------------------------------- stream events


class _Event:
    __slots__: tuple[str, ...] = ()

    def __repr__(self) -> str:
        fields = ", ".join(f"{s}={getattr(self, s)!r}" for s in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    __hash__ = None  # type: ignore[assignment]


class Items(_Event):
    """A run of change items of one stream's open snapshot (seqno order), from one
    ``receive_data`` call. ``nbytes``: their wire bytes."""

    __slots__ = ("items", "nbytes", "opaque", "vbucket")

    def __init__(self, opaque: int, vbucket: int, items: list, nbytes: int) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.items = items
        self.nbytes = nbytes


class ItemFrames(_Event):
    """A run of change items of one stream's open snapshot, left in the receive buffer:
    ``starts`` are the offsets in ``buf`` of its frames (seqno order). Every frame is a
    validated magic-0x80 DCP_MUTATION (31 bytes of extras), DCP_DELETION (18 or 21) or
    DCP_EXPIRATION (20), with the stream's opaque and no framing extras; ``last`` is the
    seqno of the last one; ``nbytes`` their wire bytes.

    ``buf`` is an immutable ``bytes`` the event owns (often the whole buffer of one
    ``receive_data`` call, shared by the call's runs): a consumer reads each frame's
    header and extras at its offset with the layouts of ``layout.py`` (``HDR_MUTATION``
    ...), and keeps the event no longer than it needs the bytes."""

    __slots__ = ("buf", "last", "nbytes", "opaque", "starts", "vbucket")

    def __init__(
        self, opaque: int, vbucket: int, buf: bytes, starts: list[int], last: int, nbytes: int
    ) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.buf = buf
        self.starts = starts
        self.last = last
        self.nbytes = nbytes

    def __repr__(self) -> str:  # not the buffer: it may be a whole MiB
        return (
            f"ItemFrames(opaque={self.opaque}, vbucket={self.vbucket}, frames={len(self.starts)}"
            f", first={self.starts[:1]}, last={self.last}, nbytes={self.nbytes})"
        )

    def items(self, mutation: Any, deletion: Any, expiration: Any) -> list:
        """The items built with the session's item callables (same arguments, same order
        as decode.py passes them): for a consumer without a vectorized decoder, and tests."""
        from .decode_frames import frame_items  # it imports this module (the decoder's)

        return frame_items(self.buf, self.starts, mutation, deletion, expiration)


class Marker(_Event):
    """A snapshot marker of a streaming stream. ``end`` is clamped to the stream's end
    seqno; ``purge_seqno`` is set by a V2.2 marker only (else None)."""

    __slots__ = ("end", "flags", "opaque", "purge_seqno", "start", "vbucket")

    def __init__(
        self, opaque: int, vbucket: int, start: int, end: int, flags: int, purge_seqno: int | None
    ) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.start = start
        self.end = end
        self.flags = flags
        self.purge_seqno = purge_seqno


class SnapshotDone(_Event):
    """The open snapshot of the stream is complete. ``nbytes``: the wire bytes flow
    control held for it, now counted as queued until the client calls ``handed``."""

    __slots__ = ("nbytes", "opaque", "vbucket")

    def __init__(self, opaque: int, vbucket: int, nbytes: int) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.nbytes = nbytes


class SeqnoAdvanced(_Event):
    __slots__ = ("opaque", "seqno", "vbucket")

    def __init__(self, opaque: int, vbucket: int, seqno: int) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.seqno = seqno


class StreamEnded(_Event):
    """DCP_STREAM_END (``reason``: a ``StreamEndStatus``); the stream is forgotten. A
    snapshot still open was completed first if the reason is OK, else discarded."""

    __slots__ = ("opaque", "reason", "vbucket")

    def __init__(self, opaque: int, vbucket: int, reason: int) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.reason = reason


class StreamOpened(_Event):
    """The stream request was accepted; ``failover_log`` newest entry first."""

    __slots__ = ("failover_log", "opaque", "vbucket")

    def __init__(self, opaque: int, vbucket: int, failover_log: FailoverLog) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.failover_log = failover_log


class StreamRollback(_Event):
    """The stream request was answered ROLLBACK to ``seqno``; the stream is forgotten."""

    __slots__ = ("opaque", "seqno", "vbucket")

    def __init__(self, opaque: int, vbucket: int, seqno: int) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.seqno = seqno


class StreamRefused(_Event):
    """The stream request was answered with another error ``status``; forgotten."""

    __slots__ = ("opaque", "status", "value", "vbucket")

    def __init__(self, opaque: int, vbucket: int, status: int, value: bytes) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.status = status
        self.value = value


class VBucketStateSet(_Event):
    """DCP_SET_VBUCKET_STATE inside a (takeover) stream: the producer hands the vbucket
    over; the consumer applies ``state`` and answers with ``ClientSession.ack_state``."""

    __slots__ = ("opaque", "state", "vbucket")

    def __init__(self, opaque: int, vbucket: int, state: int) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.state = state


class Answer(_Event):
    """The response to a request the session sent. ``result`` is the ``Frame``, or for
    a pipelined write answered SUCCESS with no key, value or other extras (the bulk of
    writes) the tuple ``(cas, vb_uuid, seqno)`` (None, None without MutationSeqno)."""

    __slots__ = ("opaque", "result")

    def __init__(self, opaque: int, result: Any) -> None:
        self.opaque = opaque
        self.result = result


class Rejected(_Event):
    """Server side: the client answered a DCP message the server sent (``opcode``, with
    the stream's ``opaque``) with an error ``status``. kv_engine closes such a
    connection: the client cannot take the stream as it is sent."""

    __slots__ = ("opaque", "opcode", "status")

    def __init__(self, opaque: int, opcode: int, status: int) -> None:
        self.opaque = opaque
        self.opcode = opcode
        self.status = status


class StateAcked(_Event):
    """Server side: the client answered a DCP_SET_VBUCKET_STATE the server sent in a
    takeover stream (the stream's ``opaque``) with SUCCESS: it has applied the state,
    so the hand-over may go on (dcp/producer/takeover.py)."""

    __slots__ = ("opaque",)

    def __init__(self, opaque: int) -> None:
        self.opaque = opaque
