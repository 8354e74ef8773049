"""The receive hot path of a ``ClientSession(item_frames=True)``: runs of items as offsets.

A consumer that decodes a run's frames itself, all at once (the Spark executor, with
numpy), does not want the per-item objects ``decode.py`` builds: this decoder finds and
validates the same frames and reports each run as one ``ItemFrames`` (the offsets of its
frames in the receive buffer) instead of one ``Items``.

Rules of this module:
- ``decode_frames`` has the signature, the byte counts and the rules of
  ``decode.decode`` (see that module), which ``ClientSession.receive_data`` calls in its
  place when the session was made with ``item_frames``: the same headers are validated
  in the same order with the same errors, a run ends where ``decode`` ends its ``Items``
  (another kind of frame, another stream, the buffer's end, the snapshot's end, which
  is followed by the same ``SnapshotDone``), and every frame that is no item of an
  open snapshot goes through the same ``decode.other_frame``. A property test
  (tests/protocol/test_session_decoder.py) holds the two decoders to each other.
- Per item it reads what it checks of the header and the by_seqno every item's extras
  start with (one ``unpack_from`` of ``HDR_ITEM_CHECK``) and appends its offset: no key
  or value is sliced, no object built. A frame off that path is read again whole with
  ``HEADER``; a run's first item only starts the run there and is then taken by the
  shortest path like the others (one more unpack a run, one place that appends). A
  run's ``last`` seqno is read back when the run is closed, not kept per item.
- ``frame_items`` turns offsets back into items (``ItemFrames.items``): the slow,
  obvious decoding, with the item callables called exactly as ``decode.py`` calls them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .decode import header_error, other_frame
from .errors import RemoteProtocolError
from .events import ItemFrames
from .layout import (
    ALT_MAGIC,
    HDR_DELETION_V1,
    HDR_DELETION_V2,
    HDR_EXPIRATION,
    HDR_ITEM_CHECK,
    HDR_MUTATION,
    HEADER,
    KNOWN_MAGIC,
    RESPONSE_MAGIC,
    U64,
)
from .opcodes import Opcode

if TYPE_CHECKING:  # the session calls this module
    from .session import ClientSession
    from .session_stream import SessionStream

__all__ = ["decode_frames", "frame_items"]

_HDR = HEADER.unpack_from
_HDR_CHECK = HDR_ITEM_CHECK.unpack_from
_SEQ = U64.unpack_from
_NOOP = int(Opcode.DCP_NOOP)
#: (opcode, extras length) of the item frames: mutation, deletion V1/V2, expiration
_SHAPES = frozenset(((0x57, 31), (0x58, 18), (0x58, 21), (0x59, 20)))
assert HDR_ITEM_CHECK.size == 32  # spelled as a literal below; an item frame has >= 42


def decode_frames(session: ClientSession, buf: bytes, out: list[Any]) -> tuple[int, int, int, int]:
    """``decode.decode`` with ``ItemFrames`` for ``Items`` (see the module rules).

    Returns:
        ``(pos, need, held, uncounted)`` as ``decode.decode`` does.
    Raises:
        RemoteProtocolError: a header breaks the rules, or an item's extras are wrong.
    """
    n = len(buf)
    pos = 0
    need = 24
    held = uncounted = 0
    streams = session.streams
    max_body = session.max_body_size
    hold = not session.queue_per_chunk
    hdr_check = _HDR_CHECK
    cur: Any = None  # the stream of the run being decoded, and the run itself
    cur_opq = -1
    starts: list[int] = []
    cur_append: Any = None
    cur_end = run = 0
    while True:
        if n - pos >= 32:
            magic, op, kl, el, body, opq, by = hdr_check(buf, pos)
            end = pos + 24 + body
            if (
                opq == cur_opq
                and magic == 0x80
                and ((op == 0x57 and el == 31) or (op, el) in _SHAPES)
                and end <= n
                and kl + el <= body
                and body <= max_body
            ):
                cur_append(pos)
                run += end - pos
                pos = end
                if by >= cur_end:
                    held += _close(session, cur, buf, starts, run, hold, True, out)
                    cur_opq = -1
                    run = 0
                continue
        elif n - pos < 24:
            break
        magic, op, kl, el, dt, vb, body, opq, cas = _HDR(buf, pos)
        end = pos + 24 + body
        if magic in ALT_MAGIC:
            fel = kl >> 8
            kl &= 0xFF
        else:
            fel = 0
        if magic not in KNOWN_MAGIC or body > max_body or fel + el + kl > body:
            raise header_error(magic, op, kl, el, fel, body, max_body)
        if end > n:
            need = 24 + body
            break
        if magic == 0x80 and 0x57 <= op <= 0x59:
            st = streams.get(opq)
            if st is not None and st.open:
                if (op, el) not in _SHAPES:
                    raise RemoteProtocolError(f"opcode 0x{op:02x} with {el} bytes of extras")
                # a valid item of another stream than the run's (a valid one of the run's
                # stream took the shortest path): start its run and go round again, where
                # the shortest path takes this frame (it checks nothing this did not)
                if run:
                    held += _close(session, cur, buf, starts, run, hold, False, out)
                cur = st
                cur_opq = opq
                starts = []
                cur_append = starts.append
                cur_end = st.end
                run = 0
                continue
        if run:
            held += _close(session, cur, buf, starts, run, hold, False, out)
            run = 0
        cur_opq = -1
        if magic in RESPONSE_MAGIC or magic == 0x82 or op == _NOOP:
            uncounted += end - pos
        held += other_frame(session, buf, pos, end, magic, op, kl, el, fel, dt, vb, opq, cas, out)
        pos = end
    if run:
        held += _close(session, cur, buf, starts, run, hold, False, out)
    return pos, need, held, uncounted


def _close(
    session: ClientSession,
    st: SessionStream,
    buf: bytes,
    starts: list[int],
    run: int,
    hold: bool,
    done: bool,
    out: list[Any],
) -> int:
    """Report the run of ``st`` at ``starts`` (``run``: its bytes) and, when its last item
    reached the snapshot's end (``done``), the ``SnapshotDone``: the order and counts of
    ``decode.py``. Called once a run. Returns the bytes it made flow control hold."""
    out.append(ItemFrames(st.opaque, st.vbucket, buf, starts, _SEQ(buf, starts[-1] + 24)[0], run))
    if hold:
        st.held += run  # before complete_snapshot, which hands the stream's held on
    if done:
        out.append(session.complete_snapshot(st))
    return run if hold else 0


def frame_items(
    buf: bytes, starts: list[int], mutation: Any, deletion: Any, expiration: Any
) -> list:
    """The items of the (validated) item frames at ``starts``, built as ``decode.py``
    builds them: the callables get the same arguments in the same order."""
    items = []
    for p in starts:
        _m, op, kl, el, dt, vb, body, _o, cas = _HDR(buf, p)
        a = p + 24 + el
        b = a + kl
        end = p + 24 + body
        if op == 0x57:
            by, rev, flg, exp, lk = HDR_MUTATION.unpack_from(buf, p)[9:14]
            items.append(mutation(vb, by, rev, cas, flg, exp, lk, dt, buf[a:b], buf[b:end]))
        elif op == 0x58 and el == 18:
            by, rev = HDR_DELETION_V1.unpack_from(buf, p)[9:11]
            items.append(deletion(vb, by, rev, cas, dt, buf[a:b], buf[b:end], None))
        elif op == 0x58:
            by, rev, dtime = HDR_DELETION_V2.unpack_from(buf, p)[9:12]
            items.append(deletion(vb, by, rev, cas, dt, buf[a:b], buf[b:end], dtime))
        else:
            by, rev, dtime = HDR_EXPIRATION.unpack_from(buf, p)[9:12]
            items.append(expiration(vb, by, rev, cas, buf[a:b], dtime))
    return items
