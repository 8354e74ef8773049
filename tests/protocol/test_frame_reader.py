"""FrameReader against hostile and oddly chunked input: frames or RemoteProtocolError, bounded."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp.protocol import codec
from dcp.protocol.errors import RemoteProtocolError
from dcp.protocol.frames import HEADER, HEADER_SIZE, FrameReader, encode_frame
from tools.strategies import KINDS

from . import fastcodec

SMALL_LIMIT = 512
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

valid_frames = st.lists(
    st.sampled_from(list(KINDS)).flatmap(lambda k: KINDS[k]), min_size=1, max_size=8
)


def _stream(frames_fields: list[dict]) -> bytes:
    return b"".join(fastcodec.encode(f) for f in frames_fields)


def _cuts(data: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(p % (len(data) + 1) for p in points)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def _feed_all(reader: FrameReader, chunks: list[bytes]) -> list:
    """Feed chunk by chunk; check the buffering bound after every read."""
    frames = []
    for chunk in chunks:
        reader.feed(chunk)
        got = reader.read_frames()
        frames.extend(got)
        assert len(got) <= len(chunk) // HEADER_SIZE + 1
        bound = reader.max_body_size + HEADER_SIZE + len(chunk)
        assert reader.buffered <= bound
        # What the reader holds on to, not only what it reports, stays within the bound.
        assert len(reader._buf) - reader._pos + reader._pending_len == reader.buffered
        assert len(reader._buf) + reader._pending_len <= bound
    return frames


#: Headers with a known magic and random lengths, each followed by random bytes that may be
#: shorter or longer than the header says: exercises the length checks, not just the magic.
plausible_streams = st.lists(
    st.builds(
        lambda magic, opcode, kl, el, body, rest: (
            HEADER.pack(magic, opcode, kl, el, 0, 0, body, 0, 0) + rest
        ),
        st.sampled_from([0x80, 0x81, 0x08, 0x18, 0x82, 0x83]),
        st.integers(0, 255),
        st.integers(0, 0xFFFF),
        st.integers(0, 255),
        st.integers(0, 700),
        st.binary(max_size=300),
    ),
    max_size=6,
).map(b"".join)


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=2000), plausible_streams),
    points=st.lists(st.integers(0, 2000), max_size=12),
    limit=st.sampled_from([0, 24, SMALL_LIMIT, 1 << 20]),
)
def test_random_bytes_give_frames_or_a_remote_protocol_error_and_nothing_else(data, points, limit):
    reader = FrameReader(max_body_size=limit)
    try:
        frames = _feed_all(reader, _cuts(data, points))
    except RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):
            reader.feed(b"\x80")  # broken for good
        with pytest.raises(RemoteProtocolError):
            reader.read_frames()
        return
    assert sum(f.size for f in frames) + reader.buffered == len(data)


@FUZZ
@given(frames_fields=valid_frames, points=st.lists(st.integers(0, 5000), max_size=20))
def test_any_split_of_a_valid_stream_gives_the_same_frames(frames_fields, points):
    data = _stream(frames_fields)
    whole = FrameReader()
    whole.feed(data)
    expected = whole.read_frames()
    assert len(expected) == len(frames_fields) and whole.buffered == 0

    chunked = _feed_all(FrameReader(), _cuts(data, points))
    assert chunked == expected

    one_byte_at_a_time = _feed_all(FrameReader(), [data[i : i + 1] for i in range(len(data))])
    assert one_byte_at_a_time == expected


@FUZZ
@given(frames_fields=valid_frames, cut=st.integers(0, 5000))
def test_a_truncated_stream_keeps_the_tail_buffered_until_the_rest_arrives(frames_fields, cut):
    data = _stream(frames_fields)
    cut %= len(data) + 1
    reader = FrameReader()
    reader.feed(data[:cut])
    first = reader.read_frames()
    assert sum(f.size for f in first) + reader.buffered == cut
    reader.feed(data[cut:])
    assert len(first) + len(reader.read_frames()) == len(frames_fields)
    assert reader.buffered == 0


@FUZZ
@given(
    frames_fields=valid_frames,
    which=st.integers(0, 7),
    offset=st.sampled_from([0, 2, 3, 4, 8, 9, 10, 11]),
    flip=st.integers(1, 255),
    points=st.lists(st.integers(0, 5000), max_size=6),
)
def test_flipped_header_bytes_never_escape_as_another_error(
    frames_fields, which, offset, flip, points
):
    data = bytearray(_stream(frames_fields))
    # Find the start of frame number `which` (mod count) and corrupt one header byte.
    starts, pos = [], 0
    reader = FrameReader()
    reader.feed(bytes(data))
    for frame in reader.read_frames():
        starts.append(pos)
        pos += frame.size
    data[starts[which % len(starts)] + offset] ^= flip
    try:
        _feed_all(FrameReader(max_body_size=SMALL_LIMIT), _cuts(bytes(data), points))
    except RemoteProtocolError:
        pass


def test_oversize_body_is_rejected_when_its_header_arrives():
    reader = FrameReader(max_body_size=1024)
    header = HEADER.pack(0x80, 0x57, 5, 31, 0, 0, 1025, 0, 0)
    reader.feed(header[:23])
    assert reader.read_frames() == []
    reader.feed(header[23:])
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        reader.read_frames()
    assert reader.buffered == HEADER_SIZE


def test_body_at_the_limit_is_accepted():
    reader = FrameReader(max_body_size=64)
    frame = encode_frame(0x80, 0x5E, key=b"k", value=bytes(63))
    reader.feed(frame)
    assert [f.value for f in reader.read_frames()] == [bytes(63)]


def test_oversize_frame_after_good_frames_is_rejected_before_its_body():
    good = codec.buffer_ack(10)
    reader = FrameReader(max_body_size=100)
    reader.feed(good + HEADER.pack(0x80, 0x57, 0, 0, 0, 0, 10**9, 0, 0))
    with pytest.raises(RemoteProtocolError):
        reader.read_frames()


def test_unknown_magic_is_a_remote_protocol_error():
    reader = FrameReader()
    reader.feed(b"\x99" + bytes(23))
    with pytest.raises(RemoteProtocolError, match="bad magic"):
        reader.read_frames()


def test_lengths_that_overrun_the_body_are_a_remote_protocol_error():
    reader = FrameReader()
    reader.feed(HEADER.pack(0x80, 0x57, 5, 31, 0, 0, 10, 0, 0) + bytes(10))
    with pytest.raises(RemoteProtocolError, match="exceed body length"):
        reader.read_frames()


def test_alt_framing_extras_that_overrun_the_body_are_a_remote_protocol_error():
    reader = FrameReader()
    reader.feed(HEADER.pack(0x08, 0x01, (9 << 8) | 1, 0, 0, 0, 5, 0, 0) + bytes(5))
    with pytest.raises(RemoteProtocolError):
        reader.read_frames()


def test_reader_needs_more_data_as_a_return_value_not_an_exception():
    reader = FrameReader()
    assert reader.read_frames() == []
    reader.feed(codec.buffer_ack(1)[:10])
    assert reader.read_frames() == []
    assert reader.buffered == 10


def test_reader_keeps_only_the_unparsed_tail_after_many_frames():
    burst = codec.buffer_ack(1) * 1000
    reader = FrameReader()
    reader.feed(burst + codec.buffer_ack(2)[:5])
    assert len(reader.read_frames()) == 1000
    assert reader.buffered == 5
    assert len(reader._buf) + reader._pending_len == 5
