"""The construct spec validates layouts: what it refuses, and how it picks shapes."""

from __future__ import annotations

import pytest
from construct import ConstructError

from dcp.protocol import spec
from dcp.protocol.frames import encode_frame
from dcp.protocol.opcodes import Opcode, Status

_KEYED = {
    Opcode.GET,
    Opcode.SET,
    Opcode.ADD,
    Opcode.REPLACE,
    Opcode.DELETE,
    Opcode.DCP_OPEN,
    Opcode.DCP_MUTATION,
    Opcode.DCP_DELETION,
    Opcode.DCP_EXPIRATION,
    Opcode.DCP_CONTROL,
}


def _request(opcode: int, extras: bytes) -> bytes:
    return encode_frame(0x80, opcode, extras=extras, key=b"k" if opcode in _KEYED else b"")


@pytest.mark.parametrize("opcode", list(spec.REQUESTS), ids=lambda op: op.name)
def test_a_request_with_an_extras_length_its_opcode_does_not_have_fails_to_parse(opcode):
    legal = spec.REQUESTS[opcode][0]
    for extlen in range(256):
        if extlen in legal:
            continue
        with pytest.raises(ConstructError, match="extras length"):
            spec.parse_frame(_request(opcode, bytes(extlen)))


@pytest.mark.parametrize("opcode", list(spec.RESPONSES), ids=lambda op: op.name)
def test_a_response_with_extras_its_opcode_does_not_have_fails_to_parse(opcode):
    legal = spec.RESPONSES[opcode][0]
    for extlen in range(256):
        if extlen in legal:
            continue
        with pytest.raises(ConstructError, match="extras length"):
            spec.parse_frame(encode_frame(0x81, opcode, extras=bytes(extlen)))


@pytest.mark.parametrize(
    ("opcode", "extlen", "layout"),
    [
        (Opcode.DCP_OPEN, 8, spec.DcpOpenExtras),
        (Opcode.DCP_STREAM_REQ, 48, spec.StreamRequestExtras),
        (Opcode.DCP_STREAM_END, 4, spec.StreamEndExtras),
        (Opcode.DCP_SNAPSHOT_MARKER, 20, spec.SnapshotMarkerV1Extras),
        (Opcode.DCP_MUTATION, 31, spec.MutationExtras),
        (Opcode.DCP_DELETION, 18, spec.DeletionV1Extras),
        (Opcode.DCP_DELETION, 21, spec.DeletionV2Extras),
        (Opcode.DCP_EXPIRATION, 20, spec.ExpirationExtras),
        (Opcode.DCP_BUFFER_ACK, 4, spec.BufferAckExtras),
        (Opcode.DCP_SEQNO_ADVANCED, 8, spec.SeqnoAdvancedExtras),
        (Opcode.DCP_SEQNO_ACKNOWLEDGED, 8, spec.SeqnoAcknowledgedExtras),
        (Opcode.GET_ALL_VB_SEQNOS, 4, spec.GetAllVbSeqnosExtras),
        (Opcode.SET, 8, spec.StoreExtras),
    ],
)
def test_each_extras_layout_has_the_size_of_the_reference(opcode, extlen, layout):
    assert layout.sizeof() == extlen
    assert spec.REQUESTS[opcode][0][extlen] is layout


def test_value_layouts_have_the_sizes_of_the_reference():
    assert spec.SnapshotMarkerV2_0Value.sizeof() == 36
    assert spec.SnapshotMarkerV2_2Value.sizeof() == 52
    assert spec.FailoverEntry.sizeof() == 16
    assert spec.VbSeqno.sizeof() == 10
    assert spec.MutationSeqnoExtras.sizeof() == 16
    assert spec.GetResponseExtras.sizeof() == 4


@pytest.mark.parametrize(
    "opcode",
    [Opcode.DCP_STREAM_REQ, Opcode.DCP_BUFFER_ACK, Opcode.DCP_SNAPSHOT_MARKER, Opcode.DCP_NOOP],
)
def test_dcp_requests_that_take_no_key_refuse_one(opcode):
    extlen = min(spec.REQUESTS[opcode][0])
    with pytest.raises(ConstructError, match="key of 3 bytes"):
        spec.parse_frame(encode_frame(0x80, opcode, extras=bytes(extlen), key=b"abc"))


@pytest.mark.parametrize("opcode", sorted(_KEYED))
def test_requests_about_a_document_need_a_key(opcode):
    extlen = max(spec.REQUESTS[opcode][0])
    with pytest.raises(ConstructError, match="key of 0 bytes"):
        spec.parse_frame(encode_frame(0x80, opcode, extras=bytes(extlen)))


def test_dcp_open_names_are_at_most_200_bytes():
    spec.parse_frame(encode_frame(0x80, Opcode.DCP_OPEN, extras=bytes(8), key=b"n" * 200))
    with pytest.raises(ConstructError):
        spec.parse_frame(encode_frame(0x80, Opcode.DCP_OPEN, extras=bytes(8), key=b"n" * 201))


@pytest.mark.parametrize(
    "opcode",
    [
        Opcode.DCP_STREAM_END,
        Opcode.DCP_BUFFER_ACK,
        Opcode.DCP_SEQNO_ADVANCED,
        Opcode.DCP_CLOSE_STREAM,
        Opcode.GET,
    ],
)
def test_requests_without_a_value_refuse_one(opcode):
    extlen = min(spec.REQUESTS[opcode][0])
    key = b"k" if opcode == Opcode.GET else b""
    with pytest.raises(ConstructError):
        spec.parse_frame(encode_frame(0x80, opcode, extras=bytes(extlen), key=key, value=b"x"))


@pytest.mark.parametrize(
    ("status", "value_len"), [(Status.SUCCESS, 17), (Status.ROLLBACK, 4), (Status.ROLLBACK, 16)]
)
def test_stream_request_replies_need_exact_value_sizes(status, value_len):
    with pytest.raises(ConstructError):
        spec.parse_frame(
            encode_frame(0x81, Opcode.DCP_STREAM_REQ, vbucket=status, value=bytes(value_len))
        )


def test_error_replies_carry_any_value_as_raw_bytes():
    data = encode_frame(0x81, Opcode.DCP_STREAM_REQ, vbucket=Status.ERANGE, value=b"bad range")
    assert spec.parse_frame(data).value == b"bad range"


def test_snapshot_marker_version_1_was_never_used_and_fails_to_parse():
    with pytest.raises(ConstructError, match="version 1"):
        spec.parse_frame(
            encode_frame(0x80, Opcode.DCP_SNAPSHOT_MARKER, extras=b"\x01", value=bytes(36))
        )


def test_snapshot_marker_v2_2_is_accepted_with_its_52_byte_value():
    fields = spec.parse_frame(
        encode_frame(0x80, Opcode.DCP_SNAPSHOT_MARKER, extras=b"\x02", value=bytes(range(52)))
    )
    assert fields.value.high_prepared_seqno == int.from_bytes(bytes(range(44, 52)), "big")


def test_trailing_bytes_after_a_frame_fail_to_parse():
    with pytest.raises(ConstructError):
        spec.parse_frame(encode_frame(0x80, Opcode.DCP_NOOP) + b"\x00")


def test_body_shorter_than_its_parts_fails_to_parse():
    bad = bytearray(encode_frame(0x80, Opcode.DCP_MUTATION, extras=bytes(31), key=b"k"))
    bad[8:12] = (10).to_bytes(4, "big")
    with pytest.raises(ConstructError, match="exceed the body length"):
        spec.parse_frame(bytes(bad[:34]))


def test_unknown_magic_fails_to_parse():
    with pytest.raises(ConstructError):
        spec.parse_frame(b"\x99" + bytes(23))


def test_building_picks_the_extras_shape_from_the_fields_given():
    v1 = spec.build_frame(
        {
            "magic": 0x80,
            "opcode": Opcode.DCP_DELETION,
            "key": b"k",
            "extras": {"by_seqno": 1, "rev_seqno": 1},
        }
    )
    v2 = spec.build_frame(
        {
            "magic": 0x80,
            "opcode": Opcode.DCP_DELETION,
            "key": b"k",
            "extras": {"by_seqno": 1, "rev_seqno": 1, "delete_time": 5},
        }
    )
    assert (v1[4], v2[4]) == (18, 21)


def test_building_with_fields_that_fit_no_shape_fails():
    with pytest.raises(ConstructError, match="fit no extras layout"):
        spec.build_frame(
            {
                "magic": 0x80,
                "opcode": Opcode.DCP_DELETION,
                "key": b"k",
                "extras": {"by_seqno": 1, "delete_time": 5},
            }
        )


def test_building_computes_every_length_field():
    data = spec.build_frame(
        {
            "magic": 0x08,
            "opcode": Opcode.SET,
            "key": b"key",
            "framing_extras": [{"id": 1, "level": 3}],
            "extras": {"flags": 0, "expiration": 0},
            "value": b"value",
        }
    )
    assert (data[2], data[3], data[4]) == (2, 3, 8)
    assert int.from_bytes(data[8:12], "big") == 2 + 8 + 3 + 5


def test_compiled_spec_parses_and_builds_like_the_plain_one():
    compiled = spec.Frame.compile()
    fields = {
        "magic": 0x80,
        "opcode": Opcode.DCP_MUTATION,
        "vbucket": 5,
        "opaque": 1,
        "key": b"doc",
        "value": b"{}",
        "extras": {"by_seqno": 1, "rev_seqno": 1, "flags": 0, "expiration": 0, "lock_time": 0},
    }
    data = spec.build_frame(fields)
    assert spec.build_frame(fields, compiled) == data
    assert spec.to_plain(compiled.parse(data)) == spec.to_plain(spec.parse_frame(data))


def test_frame_infos_of_alt_responses_keep_raw_payloads():
    # In responses id 1/2 are read/write units, not durability/stream id.
    data = encode_frame(0x18, Opcode.GET, framing_extras=b"\x12\x00\x05", extras=bytes(4))
    fields = spec.to_plain(spec.parse_frame(data))
    assert fields["framing_extras"] == [{"id": 1, "payload": b"\x00\x05"}]
    assert spec.build_frame(fields) == data
