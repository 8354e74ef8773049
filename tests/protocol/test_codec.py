"""Builders refuse what the protocol forbids; parsers refuse what the peer got wrong."""

from __future__ import annotations

import pytest
from construct import ConstructError
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp.protocol import codec, spec
from dcp.protocol.errors import LocalProtocolError, RemoteProtocolError
from dcp.protocol.frames import encode_frame, encode_frame_infos, parse_frame_infos
from dcp.protocol.opcodes import DurabilityLevel, Opcode

from .fastcodec import decode_frame


@pytest.mark.parametrize(("key", "vb"), [(b"foo", 115), (b"hello", 528)])
def test_vbucket_for_key_matches_couchbase_clients(key, vb):
    assert codec.vbucket_for_key(key, 1024) == vb


def test_vbucket_for_key_with_64_vbuckets_keeps_the_low_bits():
    assert codec.vbucket_for_key(b"foo", 64) == 115 % 64


@pytest.mark.parametrize("n", [0, -1, 1000, 3])
def test_vbucket_for_key_refuses_a_vbucket_count_that_is_not_a_power_of_two(n):
    with pytest.raises(LocalProtocolError):
        codec.vbucket_for_key(b"foo", n)


# --------------------------------------------------------------------------- frame infos


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15 + 0xFF), st.binary(max_size=15 + 0xFF)), max_size=4))
def test_frame_infos_round_trip_including_nibble_escapes(infos):
    data = encode_frame_infos(infos)
    assert parse_frame_infos(data) == infos
    typed = [i for i in infos if i[0] not in (1, 2)]  # ids 1 and 2 have fixed payloads
    as_spec = [{"id": fid, "payload": payload} for fid, payload in typed]
    assert spec.FrameInfos.build(as_spec) == encode_frame_infos(typed)
    assert spec.to_plain(spec.FrameInfos.parse(encode_frame_infos(typed))) == as_spec


@pytest.mark.parametrize(
    ("fid", "n", "head"),
    [
        (2, 2, b"\x22"),
        (14, 14, b"\xee"),
        (15, 0, b"\xf0\x00"),
        (16, 3, b"\xf3\x01"),
        (3, 15, b"\x3f\x00"),
        (3, 20, b"\x3f\x05"),
        (20, 270, b"\xff\x05\xff"),
    ],
)
def test_frame_info_escapes_put_id_then_length_after_the_first_byte(fid, n, head):
    assert encode_frame_infos([(fid, bytes(n))]) == head + bytes(n)


@pytest.mark.parametrize("infos", [[(15 + 0x100, b"")], [(1, bytes(15 + 0x100))], [(-1, b"")]])
def test_frame_infos_that_cannot_be_encoded_are_refused(infos):
    with pytest.raises(LocalProtocolError):
        encode_frame_infos(infos)


@pytest.mark.parametrize("data", [b"\xf0", b"\x3f", b"\x23\x00", b"\xff\x01"])
def test_truncated_frame_infos_are_a_remote_protocol_error(data):
    with pytest.raises(RemoteProtocolError):
        parse_frame_infos(data)


def test_stream_id_frame_info_is_the_three_bytes_0x22_hi_lo():
    assert codec.stream_id_frame_info(0x0102) == b"\x22\x01\x02"


@pytest.mark.parametrize(("timeout", "encoded"), [(None, b"\x11\x03"), (2500, b"\x13\x03\x09\xc4")])
def test_durability_frame_info_carries_the_level_and_an_optional_timeout(timeout, encoded):
    fe = codec.durability_frame_info(DurabilityLevel.PERSIST_TO_MAJORITY, timeout)
    assert fe == encoded
    frame = decode_frame(
        codec.request(Opcode.SET, extras=codec.store_extras(), key=b"k", framing_extras=fe)
    )
    assert frame.magic == 0x08
    assert codec.parse_durability(frame) == DurabilityLevel.PERSIST_TO_MAJORITY


def test_frames_without_frame_infos_have_no_durability_and_no_stream_id():
    frame = decode_frame(codec.request(Opcode.SET, extras=codec.store_extras(), key=b"k"))
    assert codec.parse_durability(frame) == DurabilityLevel.NONE
    assert codec.parse_stream_id(frame) is None


@pytest.mark.parametrize("fe", [b"\x12\x03\x00", b"\x23\x00\x01\x02"])
def test_frame_infos_of_the_wrong_size_are_refused_by_both_codecs(fe):
    data = encode_frame(0x08, Opcode.SET, framing_extras=fe, extras=bytes(8), key=b"k")
    frame = decode_frame(data)
    parser = codec.parse_durability if fe[0] >> 4 == 1 else codec.parse_stream_id
    with pytest.raises(RemoteProtocolError):
        parser(frame)
    with pytest.raises(ConstructError):
        spec.parse_frame(data)


# --------------------------------------------------------------------------- builders

_BAD_BUILDS = {
    "negative seqno": lambda: codec.mutation(0, 0, -1, 0, b"k", b""),
    "seqno above 2**64-1": lambda: codec.deletion(0, 0, 2**64, 0, b"k"),
    "vbucket above 65535": lambda: codec.mutation(70000, 0, 1, 0, b"k", b""),
    "key above 65535 bytes": lambda: codec.mutation(0, 0, 1, 0, b"k" * 70000, b""),
    "negative delete time": lambda: codec.expiration(0, 0, 1, 0, b"k", delete_time=-1),
    "snapshot start after end": lambda: codec.snapshot_marker(0, 0, 5, 4, 1),
    "marker flags above uint32": lambda: codec.snapshot_marker(0, 0, 1, 2, 2**32),
    "negative max visible seqno": lambda: codec.snapshot_marker(
        0, 0, 1, 2, 1, max_visible_seqno=-1
    ),
    "buffer ack above uint32": lambda: codec.buffer_ack(2**32),
    "negative opaque": lambda: codec.buffer_ack(1, -1),
    "negative stream end status": lambda: codec.stream_end(0, 0, -1),
    "seqno advanced above uint64": lambda: codec.seqno_advanced(0, 0, 2**64),
    "empty connection name": lambda: codec.dcp_open("", 1),
    "connection name of 201 bytes": lambda: codec.dcp_open("x" * 201, 1),
    "open flags above uint32": lambda: codec.dcp_open("x", 2**32),
    "empty control key": lambda: codec.dcp_control("", "true"),
    "stream request with negative start": lambda: codec.stream_request(0, 0, start=-1),
    "failover uuid below zero": lambda: codec.failover_log_value([(-1, 0)]),
    "vbucket seqno pair with vbucket 65536": lambda: codec.all_vb_seqnos_value([(65536, 0)]),
    "store extras below zero": lambda: codec.store_extras(-1),
    "durability level 256": lambda: codec.durability_frame_info(256),
    "durability timeout above uint16": lambda: codec.durability_frame_info(1, 65536),
    "stream id above uint16": lambda: codec.stream_id_frame_info(65536),
    "write seqno below zero": lambda: codec.mutation_seqno_extras(0, -1),
    "hello feature above uint16": lambda: codec.hello("agent", [65536]),
    "extras above 255 bytes": lambda: codec.request(Opcode.SET, extras=bytes(256)),
    "framing extras without alt magic": lambda: encode_frame(0x80, 0x01, framing_extras=b"\x11"),
    "alt key above 255 bytes": lambda: codec.request(
        Opcode.SET, key=bytes(256), framing_extras=b"\x11\x01"
    ),
    "status above uint16": lambda: codec.response(Opcode.GET, 65536),
    "mutation body with negative rev": lambda: codec.mutation_body(1, -1, 0, 0, b"k", b""),
    "header with negative cas": lambda: codec.dcp_header(0x57, 0, 0, 0, 0, 0, 0, -1),
}


@pytest.mark.parametrize("build", list(_BAD_BUILDS.values()), ids=list(_BAD_BUILDS))
def test_builders_refuse_bad_input_with_local_protocol_error(build):
    with pytest.raises(LocalProtocolError):
        build()


# --------------------------------------------------------------------------- parsers

_BAD_FRAMES = {
    "mutation with 20-byte extras": (
        codec.parse_mutation,
        encode_frame(0x80, 0x57, extras=bytes(20)),
    ),
    "deletion with 19-byte extras": (
        codec.parse_deletion,
        encode_frame(0x80, 0x58, extras=bytes(19)),
    ),
    "expiration with 18-byte extras": (
        codec.parse_expiration,
        encode_frame(0x80, 0x59, extras=bytes(18)),
    ),
    "marker with 12-byte extras": (
        codec.parse_snapshot_marker,
        encode_frame(0x80, 0x56, extras=bytes(12)),
    ),
    "marker v2.0 with a 35-byte value": (
        codec.parse_snapshot_marker,
        encode_frame(0x80, 0x56, extras=b"\x00", value=bytes(35)),
    ),
    "marker version 1": (
        codec.parse_snapshot_marker,
        encode_frame(0x80, 0x56, extras=b"\x01", value=bytes(36)),
    ),
    "buffer ack without extras": (codec.parse_buffer_ack, encode_frame(0x80, 0x5D)),
    "stream end with 8-byte extras": (
        codec.parse_stream_end,
        encode_frame(0x80, 0x55, extras=bytes(8)),
    ),
    "open without a name": (codec.parse_open, encode_frame(0x80, 0x50, extras=bytes(8))),
    "stream request with a key": (
        codec.parse_stream_request,
        encode_frame(0x80, 0x53, extras=bytes(48), key=b"x"),
    ),
    "set with 4-byte extras": (
        codec.parse_store_extras,
        encode_frame(0x80, 0x01, extras=bytes(4), key=b"k"),
    ),
    "write response with 8-byte extras": (
        codec.parse_mutation_seqno,
        encode_frame(0x81, 0x01, extras=bytes(8)),
    ),
}


@pytest.mark.parametrize(("parse", "data"), list(_BAD_FRAMES.values()), ids=list(_BAD_FRAMES))
def test_parsers_refuse_wrong_extras_with_remote_protocol_error(parse, data):
    with pytest.raises(RemoteProtocolError):
        parse(decode_frame(data))
    with pytest.raises(ConstructError):
        spec.parse_frame(data)


def test_stream_request_round_trips_through_its_event_class():
    req = codec.StreamRequest(
        vbucket=5, opaque=9, start_seqno=10, snap_start_seqno=10, snap_end_seqno=10, vb_uuid=77
    )
    assert codec.parse_stream_request(decode_frame(req.encode())) == req


def test_mutation_body_after_dcp_header_equals_the_one_shot_mutation():
    body = codec.mutation_body(7, 3, 0xDEADBEEF, 0, b"doc-1", b"{}")
    head = codec.dcp_header(Opcode.DCP_MUTATION, 5, 31, 1, 5, len(body), 0x2A, 99)
    assert head + body == codec.mutation(
        5, 0x2A, 7, 3, b"doc-1", b"{}", cas=99, datatype=1, flags=0xDEADBEEF
    )
