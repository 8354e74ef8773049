"""DCP_SEQNO_ACKNOWLEDGED (0x61) and durability level 4 in the codec and ClientSession,
driven with bytes only (protocol_spec/README.md §5.10 and §6.3)."""

from __future__ import annotations

import pytest
from construct import ConstructError

from dcp.protocol import codec, spec
from dcp.protocol.errors import LocalProtocolError, RemoteProtocolError
from dcp.protocol.events import StreamEnded, StreamOpened
from dcp.protocol.frames import encode_frame
from dcp.protocol.layout import HEADER
from dcp.protocol.opcodes import DurabilityLevel, Opcode, Status, StreamEndStatus
from dcp.protocol.session import ClientSession

from .fastcodec import decode_frame

ACK = Opcode.DCP_SEQNO_ACKNOWLEDGED
SEQ9 = codec.U64.pack(9)


def test_the_ack_is_a_request_with_8_byte_extras_and_an_optional_8_byte_value():
    plain = codec.seqno_acknowledged(5, 0x2A, 9)
    assert plain == HEADER.pack(0x80, 0x61, 0, 8, 0, 5, 8, 0x2A, 0) + SEQ9
    both = codec.seqno_acknowledged(5, 0x2A, 9, 6)
    assert both == HEADER.pack(0x80, 0x61, 0, 8, 0, 5, 16, 0x2A, 0) + SEQ9 + codec.U64.pack(6)
    assert codec.parse_seqno_acknowledged(decode_frame(plain)) == (9, None)
    assert codec.parse_seqno_acknowledged(decode_frame(both)) == (9, 6)
    top = 2**64 - 1
    edge = codec.seqno_acknowledged(1023, 1, top, top)
    assert codec.parse_seqno_acknowledged(decode_frame(edge)) == (top, top)


@pytest.mark.parametrize(
    ("extras", "key", "value", "why"),
    [
        (b"", b"", b"", "extras"),
        (SEQ9 + SEQ9, b"", b"", "extras"),  # Couchbase's layout has 8 bytes, never 16
        (SEQ9[:4], b"", b"", "extras"),
        (SEQ9, b"k", b"", "key"),
        (SEQ9, b"", b"\0\0\0\x06", "value of 4 bytes"),
        (SEQ9, b"", bytes(16), "value of 16 bytes"),
    ],
    ids=["no-extras", "16-byte-extras", "4-byte-extras", "key", "4-byte-value", "16-byte-value"],
)
def test_a_malformed_ack_is_refused_by_both_codecs(extras, key, value, why):
    data = encode_frame(0x80, ACK, vbucket=5, opaque=0x2A, extras=extras, key=key, value=value)
    with pytest.raises(RemoteProtocolError, match=why):
        codec.parse_seqno_acknowledged(decode_frame(data))
    with pytest.raises(ConstructError):
        spec.parse_frame(data)


@pytest.mark.parametrize(("seqno", "persisted"), [(2**64, None), (-1, None), (1, 2**64)])
def test_building_an_ack_with_a_seqno_out_of_range_is_a_local_error(seqno, persisted):
    with pytest.raises(LocalProtocolError):
        codec.seqno_acknowledged(5, 1, seqno, persisted)


# --------------------------------------------------------------------------- ClientSession


def _accept(s: ClientSession, o: int, vb: int) -> None:
    (ev,) = s.receive_data(
        codec.response(Opcode.DCP_STREAM_REQ, opaque=o, value=codec.failover_log_value([(7, 0)]))
    )
    assert ev == StreamOpened(o, vb, ((7, 0),))


def test_the_session_acks_with_the_opaque_of_the_accepted_stream_of_that_vbucket():
    s = ClientSession()
    o3, _ = s.stream_request(3)
    o4, _ = s.stream_request(4)
    _accept(s, o3, 3)
    _accept(s, o4, 4)
    assert o3 != o4
    ack = s.seqno_acknowledged(4, 12, 10)
    assert ack == codec.seqno_acknowledged(4, o4, 12, 10)
    frame = decode_frame(ack)
    assert (frame.magic, frame.opcode, frame.vbucket, frame.opaque) == (0x80, ACK, 4, o4)
    assert codec.parse_seqno_acknowledged(frame) == (12, 10)
    assert s.seqno_acknowledged(3, 5) == codec.seqno_acknowledged(3, o3, 5)
    # building an ack sends nothing by itself: the caller writes the bytes it got
    assert s.data_to_send() == b""


def test_the_session_has_no_ack_for_a_vbucket_it_does_not_stream():
    s = ClientSession()
    assert s.seqno_acknowledged(3, 5) is None  # no stream at all
    o, _ = s.stream_request(3)
    # requested but not yet accepted: the producer would ignore an ack under that opaque
    assert s.seqno_acknowledged(3, 5, 5) is None
    _accept(s, o, 3)
    assert s.seqno_acknowledged(4, 5) is None  # another vbucket
    assert s.seqno_acknowledged(3, 5) is not None
    events = s.receive_data(codec.stream_end(3, o, StreamEndStatus.STATE_CHANGED))
    assert events == [StreamEnded(o, 3, StreamEndStatus.STATE_CHANGED)]
    assert s.seqno_acknowledged(3, 5) is None  # the stream ended


def test_a_refused_stream_has_no_ack():
    s = ClientSession()
    o, _ = s.stream_request(3, start=50)
    s.receive_data(
        codec.response(Opcode.DCP_STREAM_REQ, Status.ROLLBACK, opaque=o, value=codec.U64.pack(10))
    )
    assert s.seqno_acknowledged(3, 5) is None


# --------------------------------------------------------------------------- level 4


@pytest.mark.parametrize("timeout", [None, 1500])
def test_durability_level_4_persist_to_active_round_trips(timeout):
    assert DurabilityLevel.PERSIST_TO_ACTIVE == 4
    info = codec.durability_frame_info(DurabilityLevel.PERSIST_TO_ACTIVE, timeout)
    assert info == (b"\x11\x04" if timeout is None else b"\x13\x04\x05\xdc")
    data = codec.request(
        Opcode.SET,
        vbucket=115,
        opaque=1,
        extras=codec.store_extras(),
        key=b"foo",
        value=b"bar",
        framing_extras=info,
    )
    assert codec.parse_durability(decode_frame(data)) == DurabilityLevel.PERSIST_TO_ACTIVE
    fi = spec.to_plain(spec.parse_frame(data))["framing_extras"]
    want = {"id": 1, "level": 4} if timeout is None else {"id": 1, "level": 4, "timeout_ms": 1500}
    assert fi == [want]
