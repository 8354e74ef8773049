"""ServerSession: what a server gets right on one connection's wire, driven with bytes only."""

from __future__ import annotations

import time

import pytest

from dcp.protocol import codec
from dcp.protocol.errors import RemoteProtocolError
from dcp.protocol.events import Rejected, StateAcked
from dcp.protocol.frames import Frame, FrameReader
from dcp.protocol.layout import ALT_HEADER, HEADER
from dcp.protocol.opcodes import Opcode, Status
from dcp.protocol.server_session import SESSION_CONTROLS, ServerSession


def _frames(data: bytes) -> list[Frame]:
    r = FrameReader()
    r.feed(data)
    return r.read_frames()


def _set(key: bytes, opaque: int, value: bytes = b"v") -> bytes:
    return codec.request(
        Opcode.SET, opaque=opaque, extras=codec.store_extras(0, 0), key=key, value=value
    )


# --------------------------------------------------------------------------- framing


def test_a_big_frame_trickling_in_costs_linear_time_not_quadratic():
    """16 MiB in 1 KiB reads: re-copying the buffer per read moves ~128 GB (tens of
    seconds); buffering the reads and joining them once takes milliseconds. The bound is
    far from both, and the loop gives up early rather than grind through the slow case."""
    value = bytes(range(256)) * (16 * 4096)
    data = _set(b"big", 7, value) + _set(b"next", 8)
    s = ServerSession(max_body_size=len(value) + 4096)
    t0 = time.perf_counter()
    events = []
    step = 1024
    for i in range(0, len(data), step):
        s.feed(data[i : i + step])
        assert s.buffered <= len(data)
        events += s.receive_data(b"") if not s.wants_data() else []
        assert time.perf_counter() - t0 < 5.0, f"still at byte {i} of {len(data)}"
    events += s.receive_data(b"")
    assert [(bytes(f.key), f.opaque) for f in events] == [(b"big", 7), (b"next", 8)]
    assert bytes(events[0].value) == value
    assert s.buffered == 0


def test_buffered_counts_an_incomplete_frame_while_it_arrives():
    data = _set(b"k", 1, b"x" * 10_000)
    s = ServerSession()
    fed = 0
    for i in range(0, len(data) - 100, 1000):
        s.feed(data[i : i + 1000])
        fed += len(data[i : i + 1000])
        assert s.next_event() is None
        assert s.buffered == fed and s.wants_data()
    s.feed(data[fed:])
    assert not s.wants_data()
    assert [bytes(f.key) for f in s.receive_data(b"")] == [b"k"] and s.buffered == 0


def test_a_request_fed_a_byte_at_a_time_comes_out_once_as_the_frame_reader_frame():
    data = codec.request(Opcode.GET, vbucket=5, opaque=9, key=b"doc")
    s = ServerSession()
    got = []
    for i in range(len(data)):
        got += s.receive_data(data[i : i + 1])
        assert s.buffered == (0 if got else i + 1)
    assert got == _frames(data) and s.frames_in == 1 and s.wants_data()


def test_several_requests_in_one_chunk_come_out_in_order_one_per_call():
    data = b"".join(codec.request(Opcode.NOOP, opaque=o) for o in (1, 2, 3))
    s = ServerSession()
    s.feed(data + data[:10])
    assert [s.next_event().opaque for _ in range(3)] == [1, 2, 3]  # type: ignore[union-attr]
    assert s.next_event() is None and s.buffered == 10 and s.frames_in == 3


def test_bad_magic_breaks_the_session_for_good():
    s = ServerSession()
    bad = bytearray(codec.request(Opcode.NOOP, opaque=1))
    bad[0] = 0x42
    with pytest.raises(RemoteProtocolError, match="bad magic 0x42"):
        s.receive_data(bytes(bad))
    with pytest.raises(RemoteProtocolError, match="already broken"):
        s.feed(codec.request(Opcode.NOOP, opaque=2))
    with pytest.raises(RemoteProtocolError, match="already broken"):
        s.next_event()


def test_an_oversize_body_is_refused_from_its_header_before_the_body_is_sent():
    s = ServerSession(max_body_size=1000)
    header = HEADER.pack(0x80, Opcode.SET, 3, 8, 0, 0, 1001, 7, 0)
    with pytest.raises(RemoteProtocolError, match="body of 1001 bytes exceeds the limit of 1000"):
        s.receive_data(header)


def test_lengths_that_do_not_fit_the_body_are_refused():
    s = ServerSession()
    with pytest.raises(RemoteProtocolError, match="extras 8 \\+ key 3 exceed body length 10"):
        s.receive_data(HEADER.pack(0x80, Opcode.SET, 3, 8, 0, 0, 10, 7, 0) + b"x" * 10)
    alt = ServerSession()
    with pytest.raises(RemoteProtocolError, match="framing extras 6 \\+ extras 0 \\+ key 0"):
        alt.receive_data(ALT_HEADER.pack(0x08, Opcode.GET, 6, 0, 0, 0, 0, 5, 1, 0) + b"x" * 5)


def test_alt_framing_gives_the_framing_extras_apart():
    fe = codec.durability_frame_info(1)
    data = codec.request(
        Opcode.SET,
        opaque=4,
        extras=codec.store_extras(0, 0),
        key=b"k",
        value=b"v",
        framing_extras=fe,
    )
    (f,) = ServerSession().receive_data(data)
    assert (f.magic, bytes(f.framing_extras), bytes(f.key), bytes(f.value)) == (
        0x08,
        fe,
        b"k",
        b"v",
    )


def test_a_server_magic_frame_from_a_client_comes_out_like_a_request():
    data = codec.response(Opcode.DCP_MUTATION, Status.EINVAL, opaque=3)
    data = bytes([0x83]) + data[1:]
    (f,) = ServerSession().receive_data(data)
    assert (f.magic, f.opcode) == (0x83, Opcode.DCP_MUTATION)


def test_only_the_incomplete_tail_is_kept_once_everything_complete_was_taken():
    s = ServerSession()
    big = codec.request(Opcode.NOOP, opaque=1) * 1000
    s.receive_data(big + b"\x80\x01")
    assert s.buffered == 2 and len(s._buf) == 2  # the 24 KB consumed are not retained


# --------------------------------------------------------------------------- SET fast path


def test_set_run_hands_out_the_buffer_at_a_set_and_consumed_moves_past_it():
    s = ServerSession()
    data = _set(b"a", 1) + _set(b"b", 2) + codec.request(Opcode.GET, opaque=3, key=b"a")
    s.feed(data)
    buf, pos, end = s.set_run()  # type: ignore[misc]
    assert (bytes(buf), pos, end) == (data, 0, len(data))
    first_two = len(_set(b"a", 1)) * 2
    s.consumed(first_two, 2)
    assert s.set_run() is None  # a GET is next
    (f,) = s.receive_data(b"")
    assert (f.opcode, f.opaque, s.frames_in) == (Opcode.GET, 3, 3)


def test_set_run_needs_a_whole_header_and_a_plain_request_magic():
    s = ServerSession()
    s.feed(_set(b"a", 1)[:23])
    assert s.set_run() is None
    alt = ServerSession()
    alt.feed(
        codec.request(
            Opcode.SET,
            opaque=1,
            extras=codec.store_extras(0, 0),
            key=b"k",
            framing_extras=codec.durability_frame_info(1),
        )
    )
    assert alt.set_run() is None


def test_the_fast_path_may_decline_and_the_set_is_framed_as_usual():
    s = ServerSession()
    s.feed(_set(b"a", 1))
    assert s.set_run() is not None
    (f,) = s.receive_data(b"")  # the shell's fast path took nothing
    assert (f.opcode, bytes(f.key)) == (Opcode.SET, b"a")


# --------------------------------------------------------------------------- noops


def test_noops_are_due_only_when_enabled_streaming_and_the_interval_has_passed():
    s = ServerSession(noop_interval=5.0, started=100.0)
    assert s.noop_due(200.0, True) == b""  # not enabled
    assert s.control("enable_noop", "TRUE") == ""
    assert s.noop_due(200.0, False) == b""  # no stream and no noop sent yet
    assert s.noop_due(104.0, True) == b""  # interval not over
    (f,) = _frames(s.noop_due(105.0, True))
    assert (f.magic, f.opcode, f.opaque) == (0x80, Opcode.DCP_NOOP, 1)
    assert s.noop_pending and s.noops_sent == 1
    assert s.noop_due(500.0, True) == b""  # the last one is unanswered


def test_a_noop_answer_is_matched_by_its_opaque_and_absorbed():
    s = ServerSession(noop_interval=1.0)
    s.control("enable_noop", "true")
    assert s.noop_due(1.0, True)
    assert s.receive_data(codec.response(Opcode.DCP_NOOP, opaque=77)) == []  # stale
    assert s.noop_pending
    assert s.receive_data(codec.response(Opcode.DCP_NOOP, opaque=1)) == []
    assert not s.noop_pending and s.frames_in == 2
    (f,) = _frames(s.noop_due(2.0, False))  # after a first noop, one is due without streams
    assert f.opaque == 2


def test_noop_controls_refuse_bad_values_and_keep_the_state():
    s = ServerSession(noop_interval=20.0)
    assert s.control("enable_noop", "yes") == "expected true or false"
    assert s.control("set_noop_interval", "soon") == "expected seconds"
    assert s.control("set_noop_interval", "0.01") == "interval must be 0.1..10800 seconds"
    assert s.control("set_noop_interval", "nan") == "interval must be 0.1..10800 seconds"
    assert (s.noop_enabled, s.noop_interval) == (False, 20.0)
    assert s.control("set_noop_interval", "2.5") == "" and s.noop_interval == 2.5
    with pytest.raises(KeyError):
        s.control("enable_expiry_opcode", "true")
    assert {"enable_noop", "set_noop_interval", "connection_buffer_size"} == SESSION_CONTROLS


# --------------------------------------------------------------------------- flow control


def test_the_window_comes_from_the_control_key_and_acks_free_it():
    s = ServerSession()
    assert s.flow.can_send() and s.flow.window == 0
    assert s.control("connection_buffer_size", "-5") == "expected a byte count (uint32)"
    assert s.control("connection_buffer_size", str(1 << 32)) == "expected a byte count (uint32)"
    assert s.control("connection_buffer_size", "1000") == "" and s.flow.window == 1000
    s.flow.record(1200)
    assert not s.flow.can_send()
    (ack,) = s.receive_data(codec.buffer_ack(300))
    assert s.buffer_ack(ack) == 300 and s.flow.outstanding == 900 and s.flow.can_send()
    (ack,) = s.receive_data(codec.buffer_ack(5000))
    s.buffer_ack(ack)
    assert s.flow.outstanding == 0 and s.flow.acked_total == 5300  # clamped, not negative


def test_a_malformed_buffer_ack_is_a_remote_protocol_error_for_that_request_only():
    s = ServerSession()
    (bad,) = s.receive_data(codec.request(Opcode.DCP_BUFFER_ACK, extras=b"\x00\x01"))
    with pytest.raises(RemoteProtocolError, match="DCP_BUFFER_ACK"):
        s.buffer_ack(bad)
    assert s.receive_data(codec.request(Opcode.NOOP, opaque=5))[0].opaque == 5


# --------------------------------------------------------------------------- answers


def test_an_error_answer_to_a_dcp_message_is_reported_and_others_are_absorbed():
    s = ServerSession()
    data = (
        codec.response(Opcode.DCP_MUTATION, opaque=8)
        + codec.response(Opcode.DCP_MUTATION, Status.ENOMEM, opaque=8)
        + codec.response(Opcode.DCP_SNAPSHOT_MARKER, Status.EINVAL, opaque=9)
        + codec.response(Opcode.GET, Status.KEY_ENOENT, opaque=10)
        + codec.response(Opcode.DCP_NOOP, Status.EINVAL, opaque=11)
    )
    assert s.receive_data(data) == [
        Rejected(8, Opcode.DCP_MUTATION, Status.ENOMEM),
        Rejected(9, Opcode.DCP_SNAPSHOT_MARKER, Status.EINVAL),
    ]
    assert s.frames_in == 5


def test_answers_to_dcp_set_vbucket_state_surface_as_acked_or_rejected():
    # A takeover stream waits for the consumer's SUCCESS to DCP_SET_VBUCKET_STATE, so that
    # answer is an event (other successes are absorbed); an error answer is a refusal.
    s = ServerSession()
    data = (
        codec.response(Opcode.DCP_SET_VBUCKET_STATE, opaque=21)
        + codec.response(Opcode.DCP_MUTATION, opaque=21)
        + codec.response(Opcode.DCP_SET_VBUCKET_STATE, Status.EINVAL, opaque=22)
    )
    assert s.receive_data(data) == [
        StateAcked(21),
        Rejected(22, Opcode.DCP_SET_VBUCKET_STATE, Status.EINVAL),
    ]
