"""The session's decoder (``dcp.protocol.decode``) against ``FrameReader`` + the codec parsers.

Every client (SDK reader, KV connection, Spark executor, dcpctl) decodes through
``ClientSession.receive_data``, whose hot path reads headers and extras with its own
``unpack_from`` calls. These properties hold it to the slow, obviously-right decoding:
``FrameReader`` frames parsed with ``codec.parse_*``, on random frame sequences split at
random points, and to ``FrameReader``'s verdict on hostile bytes.
"""

from __future__ import annotations

import itertools
import struct

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dcp.protocol import codec
from dcp.protocol.errors import RemoteProtocolError
from dcp.protocol.events import Answer, Deletion, Expiration, ItemFrames, Items, Marker, Mutation
from dcp.protocol.frames import Frame, FrameReader
from dcp.protocol.layout import HEADER
from dcp.protocol.opcodes import SEQNO_MAX, Opcode
from dcp.protocol.session import ClientSession
from tools.strategies import KINDS

from . import fastcodec
from .test_frame_reader import plausible_streams

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VB = 7
keys = st.binary(min_size=1, max_size=20)
vals = st.binary(max_size=40)


def _cuts(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def _opened(end_seqno: int = SEQNO_MAX, vb: int = VB, s=None, **kw) -> tuple[ClientSession, int]:
    s = s or ClientSession(**kw)
    o, _ = s.stream_request(vb, end=end_seqno)
    assert s.receive_data(codec.response(Opcode.DCP_STREAM_REQ, opaque=o)) != []
    return s, o


# One stream's messages (opaque filled in later), as builders of its frames.
def _mutation(seq: int, key: bytes, val: bytes, cas: int, dt: int):
    return lambda o: codec.mutation(
        VB, o, seq, 3, key, val, cas=cas, datatype=dt, flags=9, expiry=11, lock_time=13
    )


def _deletion(seq: int, key: bytes, val: bytes, v2: bool):
    return lambda o: codec.deletion(
        VB, o, seq, 3, key, value=val, cas=5, delete_time=17 if v2 else None
    )


def _expiration(seq: int, key: bytes):
    return lambda o: codec.expiration(VB, o, seq, 3, key, cas=6, delete_time=19)


def _marker(start: int, end: int, v2: bool):
    if v2:
        return lambda o: codec.snapshot_marker(VB, o, start, end, 1, max_visible_seqno=end)
    return lambda o: codec.snapshot_marker(VB, o, start, end, 1)


def _item(seq: int):
    return st.one_of(
        st.builds(
            _mutation, st.just(seq), keys, vals, st.integers(0, 2**64 - 1), st.integers(0, 7)
        ),
        st.builds(_deletion, st.just(seq), keys, vals, st.booleans()),
        st.builds(_expiration, st.just(seq), keys),
    )


#: Frames of other opaques (never the stream's, which is 1): noops, answers, requests.
noise = (
    st.sampled_from(list(KINDS))
    .flatmap(lambda k: KINDS[k])
    .map(lambda f: lambda o, f=f: fastcodec.encode({**f, "opaque": f["opaque"] | 0x100}))
)


@st.composite
def streams(draw) -> list:
    """Snapshots (a marker, then items in seqno order, the last one at the end or not),
    noise frames anywhere, and sometimes a stray item after a completed snapshot."""
    out: list = []
    seq = 1
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(0, 12))
        complete = draw(st.booleans())
        end = seq + n - 1 if complete and n else seq + n + 5
        out.append(_marker(seq, end, draw(st.booleans())))
        for i in range(n):
            out.append(draw(_item(seq + i)))
            if draw(st.integers(0, 5)) == 0:
                out.append(draw(noise))
        seq = end + 1
    if draw(st.integers(0, 4)) == 0:
        out.append(draw(_item(draw(st.integers(1, seq + 3)))))
    return out


def _reference(data: bytes, opaque: int) -> tuple[list, int, int]:
    """(events, noop replies, counted bytes) the spec says ``data`` gives a session with
    one streaming stream of ``opaque`` (end seqno: none), decoded with FrameReader."""
    reader = FrameReader()
    reader.feed(data)
    out: list = []
    noops = counted = 0
    is_open, end = False, 0
    for f in reader.read_frames():
        if f.is_response or f.magic == 0x82:
            continue
        counted += f.size
        if f.opcode == Opcode.DCP_NOOP:
            noops += 1
            counted -= f.size
            continue
        if f.opaque != opaque:
            continue
        if f.opcode == Opcode.DCP_SNAPSHOT_MARKER:
            s, e, flags, _m, _h = codec.parse_snapshot_marker(f)
            out.append(("marker", s, e, flags))
            is_open, end = True, e
        elif f.opcode in (Opcode.DCP_MUTATION, Opcode.DCP_DELETION, Opcode.DCP_EXPIRATION):
            if f.opcode == Opcode.DCP_MUTATION:
                by, rev, flg, exp, lk = codec.parse_mutation(f)
                item = ("mutation", by, rev, f.cas, flg, exp, lk, f.datatype, f.key, f.value)
            elif f.opcode == Opcode.DCP_DELETION:
                by, rev, dtime = codec.parse_deletion(f)
                item = ("deletion", by, rev, f.cas, f.datatype, f.key, f.value, dtime)
            else:
                by, rev, dtime = codec.parse_expiration(f)
                item = ("expiration", by, rev, f.cas, f.key, dtime)
            if not is_open:
                out.append(("error",))
                return out, noops, counted
            out.append(item)
            if by >= end:
                is_open = False
    return out, noops, counted


def _plain(e: object) -> tuple:
    if type(e) is Mutation:
        return (
            "mutation",
            e.seqno,
            e.rev_seqno,
            e.cas,
            e.flags,
            e.expiry,
            e.lock_time,
            e.datatype,
            bytes(e.key),
            bytes(e.value),
        )
    if type(e) is Deletion:
        return (
            "deletion",
            e.seqno,
            e.rev_seqno,
            e.cas,
            e.datatype,
            bytes(e.key),
            bytes(e.value),
            e.delete_time,
        )
    assert type(e) is Expiration
    return ("expiration", e.seqno, e.rev_seqno, e.cas, bytes(e.key), e.delete_time)


@FUZZ
@given(builders=streams(), points=st.lists(st.integers(0, 5000), max_size=15))
def test_any_split_of_a_stream_decodes_as_frame_reader_and_the_parsers_say(builders, points):
    session, o = _opened(queue_per_chunk=True)
    data = b"".join(b(o) for b in builders)
    want, want_noops, want_counted = _reference(data, o)
    event("item outside a snapshot" if want[-1] == ("error",) else f"{len(want)} events")
    got: list = []
    counted = 0
    replies = b""
    try:
        for chunk in _cuts(data, points):
            for e in session.receive_data(chunk):
                assert e.opaque == o or type(e).__name__ == "Answer"
                if type(e) is Items:
                    assert e.vbucket == VB and e.items
                    got.extend(_plain(i) for i in e.items)
                elif type(e) is Marker:
                    got.append(("marker", e.start, e.end, e.flags))
            counted += session.counted
            replies += session.data_to_send()
    except RemoteProtocolError:
        got.append(("error",))
    if want[-1] == ("error",):
        # the call that meets the bad frame raises (its other events are not returned)
        assert got[-1] == ("error",) and got[:-1] == want[: len(got) - 1]
    else:
        assert got == want
        assert counted == want_counted
        assert replies.count(bytes([0x81, Opcode.DCP_NOOP])) == want_noops
        assert session.flow.queued == want_counted


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=2000), plausible_streams),
    points=st.lists(st.integers(0, 2000), max_size=12),
    limit=st.sampled_from([0, 24, 512, 1 << 20]),
)
def test_hostile_bytes_are_refused_exactly_when_frame_reader_refuses_them(data, points, limit):
    reader = FrameReader(max_body_size=limit)
    session = ClientSession(max_body_size=limit)  # no streams: only the framing matters
    reader_ok = session_ok = True
    try:
        reader.feed(data)
        reader.read_frames()
    except RemoteProtocolError:
        reader_ok = False
    try:
        for chunk in _cuts(data, points):
            session.receive_data(chunk)
    except RemoteProtocolError:
        session_ok = False
    assert session_ok == reader_ok


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=2000), plausible_streams),
    points=st.lists(st.integers(0, 2000), max_size=12),
)
def test_hostile_bytes_on_an_open_stream_give_events_or_a_remote_protocol_error(data, points):
    session, o = _opened()
    session.receive_data(codec.snapshot_marker(VB, o, 0, 100, 1))
    try:
        for chunk in _cuts(data, points):
            session.receive_data(chunk)
            session.data_to_send()
    except RemoteProtocolError:
        pass


# --------------------------------------------------------------------------- item_frames mode


def _comparable(e: object) -> object:
    """An event as something ``==`` compares by value; an ``ItemFrames`` as the ``Items``
    its frames stand for (checking what only it carries: offsets, last, nbytes)."""
    if type(e) is ItemFrames:
        items = e.items(Mutation, Deletion, Expiration)
        assert isinstance(e.buf, bytes) and items and e.last == items[-1].seqno
        ends = [p + 24 + HEADER.unpack_from(e.buf, p)[6] for p in e.starts]
        assert all(a < b for a, b in itertools.pairwise(e.starts))
        assert e.nbytes == sum(b - a for a, b in zip(e.starts, ends, strict=True))
        e = Items(e.opaque, e.vbucket, items, e.nbytes)
    if type(e) is Items:
        return ("items", e.opaque, e.vbucket, [_plain(i) for i in e.items], e.nbytes)
    if type(e) is Answer and type(e.result) is Frame:
        return ("answer", e.opaque, e.result.encode())
    return e


def _calls(session: ClientSession, chunks: list[bytes]) -> list:
    """What each ``receive_data`` call gives: its events, counts, replies, flow state."""
    got: list = []
    for chunk in chunks:
        try:
            events = session.receive_data(chunk)
        except RemoteProtocolError as exc:
            got.append(("error", str(exc)))
            break
        fc = session.flow
        got.append(
            (
                [_comparable(e) for e in events],
                session.counted,
                session.data_to_send(),
                (fc.held, fc.queued, fc.ackable),
                sorted((st.opaque, st.open, st.end, st.held) for st in session.streams.values()),
            )
        )
    return got


def _two_modes(chunks: list[bytes], setup, **kw) -> tuple[list, list]:
    """``_calls`` of an Items session and of an item_frames one, both set up by ``setup``."""
    items = ClientSession(**kw)
    frames = ClientSession(item_frames=True, **kw)
    setup(items)
    setup(frames)
    return _calls(items, chunks), _calls(frames, chunks)


@FUZZ
@given(
    a=streams(),
    b=streams(),
    order=st.lists(st.booleans(), max_size=130),
    points=st.lists(st.integers(0, 5000), max_size=15),
    end_seqno=st.sampled_from([SEQNO_MAX, 3, 9, 25]),
    queue_per_chunk=st.booleans(),
)
def test_item_frames_mode_gives_the_items_mode_events_on_any_split(
    a, b, order, points, end_seqno, queue_per_chunk
):
    # two streams (the second on another vbucket than its frames' headers say), their
    # frames interleaved: runs end at stream switches as well as at other frames
    setup = lambda s: (_opened(end_seqno, s=s), _opened(end_seqno, vb=VB + 1, s=s))  # noqa: E731
    frames, rest = [], [list(a), list(b)]
    for which in order:
        if rest[which]:
            frames.append(rest[which].pop(0)(1 + which))
    frames += [f(1) for f in rest[0]] + [f(2) for f in rest[1]]
    data = b"".join(frames)
    items, item_frames = _two_modes(
        _cuts(data, points), setup, window=300, ack_ratio=0.3, queue_per_chunk=queue_per_chunk
    )
    event(f"{sum(1 for c in items for e in c[0] if type(e) is tuple)} runs" if items else "none")
    assert item_frames == items


#: Runs of valid items of the open stream (opaque 1), each followed by a hostile frame on
#: its opaque: a valid item with one header field overwritten, or a header of an item
#: opcode (or the marker's, or a noop's) with random lengths and bytes. A hostile frame
#: inside a run meets the checks of both decoders' shortest paths, not just the framing's.
_valid_item = st.integers(1, 60).flatmap(_item).map(lambda build: build(1))
_FIELDS = {  # offset in the header, struct format, values
    "magic": (0, ">B", st.sampled_from([0x08, 0x81, 0x82, 0x18])),
    "opcode": (1, ">B", st.sampled_from([0x56, 0x57, 0x58, 0x59, int(Opcode.DCP_NOOP)])),
    "key length": (2, ">H", st.integers(0, 100)),
    "extras length": (4, ">B", st.sampled_from([0, 8, 18, 19, 20, 21, 30, 31, 32])),
    "body length": (8, ">I", st.integers(0, 130)),
}


def _overwritten(frame: bytes, field: str, value: int) -> bytes:
    at, fmt, _ = _FIELDS[field]
    raw = struct.pack(fmt, value)
    return frame[:at] + raw + frame[at + len(raw) :]


_hostile_item = st.one_of(
    st.sampled_from(sorted(_FIELDS)).flatmap(
        lambda field: st.builds(_overwritten, _valid_item, st.just(field), _FIELDS[field][2])
    ),
    st.builds(
        lambda magic, opcode, kl, el, body, rest: (
            HEADER.pack(magic, opcode, kl, el, 0, VB, body, 1, 0) + rest
        ),
        st.sampled_from([0x80, 0x80, 0x80, 0x08, 0x81]),
        st.sampled_from([0x56, 0x57, 0x57, 0x58, 0x59, int(Opcode.DCP_NOOP)]),
        st.integers(0, 12),
        st.sampled_from([18, 20, 21, 31, 0, 30]),
        st.integers(0, 80),
        st.binary(min_size=0, max_size=80),
    ),
)
hostile_items = st.lists(
    st.tuples(st.lists(_valid_item, max_size=3), _hostile_item).map(
        lambda run: b"".join(run[0]) + run[1]
    ),
    max_size=4,
).map(b"".join)


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=2000), plausible_streams, hostile_items),
    points=st.lists(st.integers(0, 2000), max_size=4),
    limit=st.sampled_from([56, 1 << 20]),
)
def test_item_frames_mode_gives_the_items_mode_events_and_errors_on_hostile_bytes(
    data, points, limit
):
    def setup(s: ClientSession) -> None:
        _opened(s=s)
        s.receive_data(codec.snapshot_marker(VB, 1, 0, 1 << 40, 1))

    items, item_frames = _two_modes(_cuts(data, points), setup, max_body_size=limit)
    event("error" if items and items[-1][0] == "error" else "no error")
    assert item_frames == items
