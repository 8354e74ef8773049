"""The receive hot path of ``ClientSession``: one pass over a buffer of received frames.

Rules of this module:
- ``decode`` is called by ``ClientSession.receive_data`` alone (``decode_frames.py``'s
  loop in its place for a session with ``item_frames``); it reads the session's stream
  table and item classes and never keeps state of its own (the unparsed tail and the
  byte counts go back to the session). ``other_frame``, the handling of every frame
  that is no item of an open snapshot, is shared by both loops: a frame not on the
  item path costs one call more, an item none.
- Every header is validated with the rules of ``frames.FrameReader`` (known magic,
  body <= ``max_body_size``, framing extras + extras + key <= body) before its body is
  awaited or used; a frame that fails raises ``RemoteProtocolError``. A property test
  (tests/protocol/test_session_decoder.py) holds this decoder to ``FrameReader`` on
  random frame sequences split at random points.
- Items of a stream's open snapshot are decoded in place: one ``unpack_from`` of header
  + extras per frame (a mutation following one of the same stream takes the shortest
  path), appended to the current run, which becomes one ``Items`` event when another
  kind of frame, another stream, the chunk's end or the snapshot's end interrupts it.
  An item carries the vbucket of its own header (the run, its stream's), so a consumer
  can refuse an item a broken producer sent for another vbucket on a stream's opaque.
  V1 snapshot markers of streaming streams are decoded here too (``other_frame``);
  every other frame is built as a ``Frame`` and handed to ``ClientSession.on_frame``.
- Byte counts (see ``session.py`` for what they mean to flow control): ``uncounted``
  are responses, server requests and DCP_NOOPs; ``held`` are the snapshot bytes added
  to streams' ``held`` during this pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import RemoteProtocolError
from .events import Items, Marker
from .frames import Frame
from .layout import (
    ALT_MAGIC,
    HDR_DELETION_V1,
    HDR_DELETION_V2,
    HDR_EXPIRATION,
    HDR_MARKER_V1,
    HDR_MUTATION,
    HEADER,
    HEADER_SIZE,
    KNOWN_MAGIC,
    MUTATION_FRAME_OVERHEAD,
    RESPONSE_MAGIC,
)
from .opcodes import Opcode
from .session_stream import STREAMING

if TYPE_CHECKING:  # the session calls this module
    from .session import ClientSession

__all__ = ["decode", "header_error", "other_frame"]

_HDR = HEADER.unpack_from
_HDR_MUT = HDR_MUTATION.unpack_from
_HDR_DEL1 = HDR_DELETION_V1.unpack_from
_HDR_DEL2 = HDR_DELETION_V2.unpack_from
_HDR_EXP = HDR_EXPIRATION.unpack_from
_HDR_MARKER = HDR_MARKER_V1.unpack_from
_MARKER_SIZE = HDR_MARKER_V1.size  # a V1 marker frame: header + 20 bytes of extras
_NOOP = int(Opcode.DCP_NOOP)
assert HEADER_SIZE == 24 and MUTATION_FRAME_OVERHEAD == 55  # spelled as literals below


def decode(session: ClientSession, buf: bytes, out: list[Any]) -> tuple[int, int, int, int]:
    """Decode the complete frames of ``buf``, appending events to ``out``.

    Returns:
        ``(pos, need, held, uncounted)``: where the unparsed tail starts, how many bytes
        from there the next frame needs, and the byte counts of the module rules.
    Raises:
        RemoteProtocolError: a header breaks the rules, or an item's extras are wrong.
    """
    # The hot path, kept in one frame on purpose (locals bound, no per-item calls).
    n = len(buf)
    pos = 0
    need = 24
    held = uncounted = 0
    streams = session.streams
    max_body = session.max_body_size
    hold = not session.queue_per_chunk
    mk_mut = session.mutation
    hdr_mut = _HDR_MUT
    append = out.append
    cur: Any = None  # the stream of the run being decoded, and the run itself
    cur_opq = -1
    cur_items: list = []
    cur_append: Any = None
    cur_end = cur_vb = run = 0
    while True:
        if n - pos >= 55:
            (magic, op, kl, el, dt, vb, body, opq, cas, by, rev, flg, exp, lk, _nm, _nru) = hdr_mut(
                buf, pos
            )
            end = pos + 24 + body
            if (
                opq == cur_opq
                and op == 0x57
                and magic == 0x80
                and el == 31
                and end <= n
                and kl + 31 <= body
                and body <= max_body
            ):
                a = pos + 55
                b = a + kl
                cur_append(mk_mut(vb, by, rev, cas, flg, exp, lk, dt, buf[a:b], buf[b:end]))
                run += end - pos
                pos = end
                if by >= cur_end:
                    append(Items(cur_opq, cur_vb, cur_items, run))
                    if hold:
                        cur.held += run
                        held += run
                    append(session.complete_snapshot(cur))
                    cur_opq = -1
                    run = 0
                continue
        elif n - pos < 24:
            break
        else:
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
                a = pos + 24 + el
                b = a + kl
                if op == 0x57 and el == 31:
                    (_m, _o, _k, _e, _d, _v, _b, _q, _c, by, rev, flg, exp, lk, _nm, _nru) = (
                        hdr_mut(buf, pos)
                    )
                    item = mk_mut(vb, by, rev, cas, flg, exp, lk, dt, buf[a:b], buf[b:end])
                elif op == 0x58 and el == 18:
                    by, rev = _HDR_DEL1(buf, pos)[9:11]
                    item = session.deletion(vb, by, rev, cas, dt, buf[a:b], buf[b:end], None)
                elif op == 0x58 and el == 21:
                    by, rev, dtime = _HDR_DEL2(buf, pos)[9:12]
                    item = session.deletion(vb, by, rev, cas, dt, buf[a:b], buf[b:end], dtime)
                elif op == 0x59 and el == 20:
                    by, rev, dtime = _HDR_EXP(buf, pos)[9:12]
                    item = session.expiration(vb, by, rev, cas, buf[a:b], dtime)
                else:
                    raise RemoteProtocolError(f"opcode 0x{op:02x} with {el} bytes of extras")
                if opq != cur_opq:
                    if run:
                        append(Items(cur_opq, cur_vb, cur_items, run))
                        if hold:
                            cur.held += run
                            held += run
                    cur = st
                    cur_opq = opq
                    cur_items = []
                    cur_append = cur_items.append
                    cur_end = st.end
                    cur_vb = st.vbucket
                    run = 0
                cur_append(item)
                run += end - pos
                pos = end
                if by >= cur_end:
                    append(Items(cur_opq, cur_vb, cur_items, run))
                    if hold:
                        cur.held += run
                        held += run
                    append(session.complete_snapshot(cur))
                    cur_opq = -1
                    run = 0
                continue
        if run:
            append(Items(cur_opq, cur_vb, cur_items, run))
            if hold:
                cur.held += run
                held += run
            run = 0
        cur_opq = -1
        if magic in RESPONSE_MAGIC or magic == 0x82 or op == _NOOP:
            uncounted += end - pos
        held += other_frame(session, buf, pos, end, magic, op, kl, el, fel, dt, vb, opq, cas, out)
        pos = end
    if run:
        append(Items(cur_opq, cur_vb, cur_items, run))
        if hold:
            cur.held += run
            held += run
    return pos, need, held, uncounted


def header_error(
    magic: int, op: int, kl: int, el: int, fel: int, body: int, max_body: int
) -> RemoteProtocolError:
    """What is wrong with a header that breaks the rules of ``frames.FrameReader`` (the
    decoders check them inline and call this only to word the error)."""
    if magic not in KNOWN_MAGIC:
        return RemoteProtocolError(f"bad magic 0x{magic:02x} at opcode 0x{op:02x}")
    if body > max_body:
        return RemoteProtocolError(
            f"body of {body} bytes exceeds the limit of {max_body} (opcode 0x{op:02x})"
        )
    return RemoteProtocolError(
        f"framing extras {fel} + extras {el} + key {kl} exceed body length {body} "
        f"(opcode 0x{op:02x})"
    )


def other_frame(
    session: ClientSession,
    buf: bytes,
    pos: int,
    end: int,
    magic: int,
    op: int,
    kl: int,
    el: int,
    fel: int,
    dt: int,
    vb: int,
    opq: int,
    cas: int,
    out: list[Any],
) -> int:
    """A validated frame at ``buf[pos:end]`` that is no item of an open snapshot: a V1
    marker of a streaming stream is decoded here, anything else is built as a ``Frame``
    for ``ClientSession.on_frame``. Returns the bytes it made flow control hold.

    Shared by both decoders (this module's and ``decode_frames.py``'s); their loops
    flush the run being decoded first. A call per such frame, not per item.
    """
    if magic == 0x80 and op == 0x56 and el == 20 and end - pos == _MARKER_SIZE:
        st = session.streams.get(opq)
        if st is not None and st.state == STREAMING:  # a V1 marker, no Frame
            if st.open:
                out.append(session.complete_snapshot(st))
            ms, me, mf = _HDR_MARKER(buf, pos)[9:12]
            st.end = me if me < st.end_seqno else st.end_seqno
            st.open = True
            out.append(Marker(opq, st.vbucket, ms, st.end, mf, None))
            if session.queue_per_chunk:
                return 0
            st.held += _MARKER_SIZE
            return _MARKER_SIZE
    a = pos + 24
    b = a + fel
    c = b + el
    d = c + kl
    frame = Frame(magic, op, dt, vb, opq, cas, buf[a:b], buf[b:c], buf[c:d], buf[d:end])
    return session.on_frame(frame, end - pos, out)
