"""House rule 2: the struct codec and the construct spec produce and accept the same bytes."""

from __future__ import annotations

import pytest
from construct import ConstructError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp.protocol import codec, spec
from dcp.protocol.errors import RemoteProtocolError
from dcp.protocol.frames import HEADER, encode_frame
from tools.strategies import KINDS, u8, u16, u32, u64, untyped_frames

from . import fastcodec

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _given_fields(fields: dict, built: dict) -> None:
    """Every field we asked for comes back (the decoded dict also carries lengths)."""
    for name, want in fields.items():
        if want is None:
            assert name not in built
        elif isinstance(want, dict) and isinstance(built[name], dict):
            _given_fields(want, built[name])
        else:
            assert built[name] == want, name


@pytest.mark.parametrize("kind", list(KINDS))
@SETTINGS
@given(data=st.data())
def test_fast_codec_and_spec_build_and_read_the_same_bytes(kind, data):
    fields = data.draw(KINDS[kind], label=kind)
    fast_bytes = fastcodec.encode(fields)
    spec_bytes = spec.build_frame(fields)
    assert fast_bytes == spec_bytes

    by_spec = spec.to_plain(spec.parse_frame(spec_bytes))
    by_fast = fastcodec.decode(spec_bytes)
    assert by_fast == by_spec
    _given_fields(fields, by_spec)


@SETTINGS
@given(fields=untyped_frames)
def test_frames_of_untyped_opcodes_are_split_by_lengths_alike(fields):
    fast_bytes = fastcodec.encode(fields)
    assert fast_bytes == spec.build_frame(fields)
    assert fastcodec.decode(fast_bytes) == spec.to_plain(spec.parse_frame(fast_bytes))


@SETTINGS
@given(
    magic=st.sampled_from([0x80, 0x81, 0x82, 0x83]),
    opcode=u8,
    keylen=u16,
    extlen=u8,
    datatype=u8,
    vb=u16,
    body=u32,
    opaque=u32,
    cas=u64,
)
def test_header_layout_is_the_same_in_both_codecs(
    magic, opcode, keylen, extlen, datatype, vb, body, opaque, cas
):
    raw = HEADER.pack(magic, opcode, keylen, extlen, datatype, vb, body, opaque, cas)
    parsed = spec.Header.parse(raw)
    assert (
        parsed.magic,
        parsed.opcode,
        parsed.key_length,
        parsed.extras_length,
        parsed.datatype,
        parsed.body_length,
        parsed.opaque,
        parsed.cas,
    ) == (magic, opcode, keylen, extlen, datatype, body, opaque, cas)
    assert (parsed.status if magic in (0x81, 0x83) else parsed.vbucket) == vb
    assert spec.Header.build(parsed) == raw


@SETTINGS
@given(
    magic=st.sampled_from([0x08, 0x18]),
    opcode=u8,
    fel=u8,
    keylen=u8,
    extlen=u8,
    vb=u16,
    body=u32,
    opaque=u32,
    cas=u64,
)
def test_alt_header_puts_framing_extras_and_key_length_in_bytes_2_and_3(
    magic, opcode, fel, keylen, extlen, vb, body, opaque, cas
):
    raw = HEADER.pack(magic, opcode, (fel << 8) | keylen, extlen, 0, vb, body, opaque, cas)
    parsed = spec.Header.parse(raw)
    assert (parsed.framing_extras_length, parsed.key_length) == (fel, keylen)


# Wrong extras lengths: both codecs refuse. (parser, opcode, magic, legal extras lengths)
_TYPED = [
    (codec.parse_mutation, 0x57, 0x80, {31}),
    (codec.parse_deletion, 0x58, 0x80, {18, 21}),
    (codec.parse_expiration, 0x59, 0x80, {20}),
    (codec.parse_snapshot_marker, 0x56, 0x80, {20, 1}),
    (codec.parse_buffer_ack, 0x5D, 0x80, {4}),
    (codec.parse_stream_end, 0x55, 0x80, {4}),
    (codec.parse_seqno_advanced, 0x64, 0x80, {8}),
    (codec.parse_seqno_acknowledged, 0x61, 0x80, {8}),
    (codec.parse_open, 0x50, 0x80, {8}),
    (codec.parse_stream_request, 0x53, 0x80, {48}),
    (codec.parse_store_extras, 0x01, 0x80, {8}),
    (codec.parse_store_extras, 0x02, 0x80, {8}),
    (codec.parse_store_extras, 0x03, 0x80, {8}),
    (codec.parse_mutation_seqno, 0x01, 0x81, {0, 16}),
    (codec.parse_mutation_seqno, 0x04, 0x81, {0, 16}),
]


@pytest.mark.parametrize(
    ("parser", "opcode", "magic", "legal"),
    _TYPED,
    ids=[f"{p.__name__}-0x{o:02x}" for p, o, _, _ in _TYPED],
)
@settings(max_examples=25, deadline=None)
@given(extlen=st.integers(0, 60), data=st.data())
def test_both_codecs_refuse_a_wrong_extras_length(parser, opcode, magic, legal, extlen, data):
    if extlen in legal:
        extlen = max(legal) + 1
    extras = data.draw(st.binary(min_size=extlen, max_size=extlen), label="extras")
    needs_key = magic == 0x80 and opcode in (0x01, 0x02, 0x03, 0x50, 0x57, 0x58, 0x59)
    frame_bytes = encode_frame(magic, opcode, extras=extras, key=b"k" if needs_key else b"")
    with pytest.raises(ConstructError, match="extras length"):
        spec.parse_frame(frame_bytes)
    with pytest.raises(RemoteProtocolError):
        parser(fastcodec.decode_frame(frame_bytes))


@pytest.mark.parametrize(
    ("value_len", "parser"),
    [
        (20, codec.parse_failover_log),
        (15, codec.parse_failover_log),
        (11, codec.parse_all_vb_seqnos),
        (3, codec.parse_hello_features),
    ],
)
def test_both_codecs_refuse_a_list_value_of_the_wrong_size(value_len, parser):
    opcode = {
        codec.parse_failover_log: 0x54,
        codec.parse_all_vb_seqnos: 0x48,
        codec.parse_hello_features: 0x1F,
    }[parser]
    frame_bytes = codec.response(opcode, value=bytes(value_len))
    with pytest.raises(ConstructError):
        spec.parse_frame(frame_bytes)
    with pytest.raises(RemoteProtocolError):
        parser(fastcodec.decode_frame(frame_bytes).value)
