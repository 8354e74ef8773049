"""The server session's framing (``ServerSession.next_event`` and the SET fast path's
hand-over) against ``FrameReader`` on random frame sequences split at random points.

The producer's connection frames every request through ``ServerSession``; its header checks
are its own code, so these properties hold it to ``FrameReader``: the same frames in the
same order (answers matched or reported as the session's rules say), a
``RemoteProtocolError`` exactly when ``FrameReader`` raises one, and the same bytes left
buffered, whatever the chunking and however much a fast path takes in between.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dcp.protocol import codec
from dcp.protocol.errors import RemoteProtocolError
from dcp.protocol.events import Rejected, StateAcked
from dcp.protocol.frames import Frame, FrameReader
from dcp.protocol.layout import ALT_HEADER, HDR_STORE, HEADER
from dcp.protocol.opcodes import Opcode
from dcp.protocol.server_session import ServerSession
from tools.strategies import KINDS

from . import fastcodec
from .test_frame_reader import plausible_streams

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_STORE = HDR_STORE.unpack_from


def _cuts(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def _plain(f: Frame) -> tuple:
    return (
        f.magic,
        f.opcode,
        f.datatype,
        f.vbucket,
        f.opaque,
        f.cas,
        bytes(f.framing_extras),
        bytes(f.extras),
        bytes(f.key),
        bytes(f.value),
    )


def _expected(f: Frame) -> tuple | None:
    """What the session's rules make of one FrameReader frame (None: absorbed)."""
    if f.magic in (0x81, 0x18):
        dcp_message = 0x55 <= f.opcode <= 0x59 or f.opcode == Opcode.DCP_SET_VBUCKET_STATE
        if f.opcode != Opcode.DCP_NOOP and f.status and dcp_message:
            return ("rejected", f.opaque, f.opcode, f.status)
        if f.opcode == Opcode.DCP_SET_VBUCKET_STATE and not f.status:
            return ("acked", f.opaque)
        return None
    return _plain(f)


def _fast_path(buf: bytes, pos: int, end: int, limit: int, out: list) -> tuple[int, int]:
    """A stand-in for the server's SET fast path: takes whole plain SETs, checking each
    header at least as strictly as the session's rules."""
    count = 0
    while end - pos >= 32:
        magic, op, kl, el, dt, vb, body, opq, cas, _fl, _ex = _STORE(buf, pos)
        if magic != 0x80 or op != Opcode.SET or el != 8 or kl + el > body or body > limit:
            break
        stop = pos + 24 + body
        if stop > end:
            break
        k = pos + 32
        out.append(
            (
                magic,
                op,
                dt,
                vb,
                opq,
                cas,
                b"",
                bytes(buf[pos + 24 : k]),
                bytes(buf[k : k + kl]),
                bytes(buf[k + kl : stop]),
            )
        )
        pos = stop
        count += 1
    return pos, count


def _drive(session: ServerSession, chunks: list[bytes], fast: bool) -> tuple[list, bool]:
    got: list = []
    try:
        for chunk in chunks:
            session.feed(chunk)
            while True:
                run = session.set_run() if fast else None
                if run is not None:
                    pos, n = _fast_path(*run, session.max_body_size, got)
                    if n:
                        session.consumed(pos, n)
                        continue
                ev = session.next_event()
                if ev is None:
                    break
                if isinstance(ev, Rejected):
                    got.append(("rejected", ev.opaque, ev.opcode, ev.status))
                elif isinstance(ev, StateAcked):
                    got.append(("acked", ev.opaque))
                else:
                    got.append(_plain(ev))
    except RemoteProtocolError:
        return got, False
    return got, True


def _reference(data: bytes, limit: int) -> tuple[list, bool, int, int]:
    """(session events, accepted, frames, buffered) FrameReader says ``data`` gives; fed a
    byte at a time so that the frames before a bad one are known too."""
    reader = FrameReader(max_body_size=limit)
    frames: list[Frame] = []
    ok = True
    try:
        for i in range(len(data)):
            reader.feed(data[i : i + 1])
            frames += reader.read_frames()
    except RemoteProtocolError:
        ok = False
    want = [e for e in map(_expected, frames) if e is not None]
    return want, ok, len(frames), reader.buffered if ok else 0


#: Requests (SET runs likely), the client's answers (noop answers, refusals) and anything
#: else the strategies build, in random order.
_sets = st.builds(
    lambda k, v, o: codec.request(
        Opcode.SET, opaque=o, key=k, value=v, extras=codec.store_extras(1, 2)
    ),
    st.binary(min_size=1, max_size=12),
    st.binary(max_size=30),
    st.integers(0, 2**32 - 1),
)
_refusals = st.builds(
    lambda op, status, o: codec.response(op, status, opaque=o),
    st.sampled_from(
        [
            Opcode.DCP_NOOP,
            Opcode.DCP_MUTATION,
            Opcode.DCP_STREAM_END,
            Opcode.DCP_SNAPSHOT_MARKER,
            Opcode.DCP_SET_VBUCKET_STATE,
            Opcode.GET,
        ]
    ),
    st.sampled_from([0, 1, 0x86]),
    st.integers(0, 9),
)
_kinds = st.sampled_from(list(KINDS)).flatmap(lambda k: KINDS[k]).map(fastcodec.encode)
frame_lists = st.lists(st.one_of(_sets, _sets, _refusals, _kinds), max_size=12)


@FUZZ
@given(
    frames=frame_lists,
    tail=st.binary(max_size=40),
    points=st.lists(st.integers(0, 3000), max_size=15),
    fast=st.booleans(),
)
def test_any_split_of_a_request_stream_frames_as_frame_reader_says(frames, tail, points, fast):
    data = b"".join(frames) + tail  # a random tail: an incomplete frame, or a broken one
    want, ok, nframes, buffered = _reference(data, 1 << 20)
    session = ServerSession(max_body_size=1 << 20)
    got, session_ok = _drive(session, _cuts(data, points), fast)
    event(f"accepted={ok} fast={fast}")
    assert session_ok == ok
    if ok:
        assert got == want
        assert session.frames_in == nframes and session.buffered == buffered
    else:
        assert got == want  # everything before the bad frame, then the error


def _edge(magic: int, kl: int, el: int, fel: int, slack: int, limit_slack: int) -> bytes:
    body = max(0, fel + el + kl + slack)
    if magic in (0x08, 0x18):
        head = ALT_HEADER.pack(magic, 0x01, fel, kl & 0xFF, el, 0, 0, body, 0, 0)
    else:
        head = HEADER.pack(magic, 0x01, kl, el, 0, 0, body, 0, 0)
    return head + b"\x00" * (body + limit_slack)


#: Headers whose lengths sit right at the rules' edges (one byte short of fitting, exact,
#: one spare), then their body or a little less or more: the off-by-ones.
edge_streams = st.lists(
    st.builds(
        _edge,
        st.sampled_from([0x80, 0x81, 0x08, 0x18]),
        st.integers(0, 20),
        st.integers(0, 9),
        st.integers(0, 6),
        st.integers(-1, 1),
        st.integers(-2, 0),
    ),
    min_size=1,
    max_size=5,
).map(b"".join)


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=2000), plausible_streams, edge_streams),
    points=st.lists(st.integers(0, 2000), max_size=12),
    limit=st.sampled_from([0, 24, 25, 512, 1 << 20]),
    fast=st.booleans(),
)
def test_hostile_bytes_are_refused_exactly_when_frame_reader_refuses_them(
    data, points, limit, fast
):
    want, ok, _nframes, buffered = _reference(data, limit)
    session = ServerSession(max_body_size=limit)
    got, session_ok = _drive(session, _cuts(data, points), fast)
    assert session_ok == ok and got == want
    if ok:
        assert session.buffered == buffered
