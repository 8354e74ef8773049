"""RawSession (the framing-only client session of test and tool clients) against
``FrameReader``: the same frames in the same order under any split, the same verdict on
hostile bytes, and nothing acted on."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp.protocol import codec
from dcp.protocol.errors import LocalProtocolError, RemoteProtocolError
from dcp.protocol.frames import FrameReader
from dcp.protocol.opcodes import Opcode
from dcp.protocol.raw_session import RawSession
from tools.strategies import KINDS

from . import fastcodec
from .test_frame_reader import plausible_streams

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
frame_lists = st.lists(
    st.sampled_from(list(KINDS)).flatmap(lambda k: KINDS[k]).map(fastcodec.encode), max_size=10
)


def _cuts(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def _read(session_or_reader: RawSession | FrameReader, chunks: list[bytes]) -> tuple[list, bool]:
    got: list = []
    try:
        for chunk in chunks:
            if isinstance(session_or_reader, RawSession):
                got += session_or_reader.receive_data(chunk)
            else:
                session_or_reader.feed(chunk)
                got += session_or_reader.read_frames()
    except RemoteProtocolError:
        return got, False
    return got, True


@FUZZ
@given(frames=frame_lists, points=st.lists(st.integers(0, 3000), max_size=15))
def test_any_split_gives_the_frame_reader_frames_and_no_replies(frames, points):
    data = b"".join(frames)
    want, ok = _read(FrameReader(), [data])
    session = RawSession()
    got, session_ok = _read(session, _cuts(data, points))
    assert ok and session_ok and got == want
    assert session.data_to_send() == b"" and session.noops == 0


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=2000), plausible_streams),
    points=st.lists(st.integers(0, 2000), max_size=12),
    limit=st.sampled_from([0, 24, 512, 1 << 20]),
)
def test_hostile_bytes_are_refused_exactly_when_frame_reader_refuses_them(data, points, limit):
    bytewise = [data[i : i + 1] for i in range(len(data))]  # the frames before a bad one too
    want, ok = _read(FrameReader(max_body_size=limit), bytewise)
    got, session_ok = _read(RawSession(max_body_size=limit), _cuts(data, points))
    assert session_ok == ok
    # a chunk holding good frames then bad bytes raises for all of it: the frames of
    # that chunk are not handed out (the connection is closed anyway)
    assert got == want if ok else got == want[: len(got)]


def test_dcp_traffic_comes_out_raw_and_unanswered():
    s = RawSession()
    data = (
        codec.request(Opcode.DCP_NOOP, opaque=5)
        + codec.snapshot_marker(0, 9, 1, 2, 1)
        + codec.mutation(0, 9, 1, 1, b"k", b"v")
        + codec.response(Opcode.GET, opaque=3)
    )
    got = s.receive_data(data)
    assert [f.opcode for f in got] == [
        Opcode.DCP_NOOP,
        Opcode.DCP_SNAPSHOT_MARKER,
        Opcode.DCP_MUTATION,
        Opcode.GET,
    ]
    assert s.data_to_send() == b""
    with pytest.raises(LocalProtocolError):
        s.stream_request(0)
