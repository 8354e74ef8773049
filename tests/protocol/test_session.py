"""ClientSession: what a client gets right on the wire, driven with bytes only."""

from __future__ import annotations

import pytest

from dcp.protocol import codec
from dcp.protocol.errors import RemoteProtocolError
from dcp.protocol.events import (
    Answer,
    Items,
    Marker,
    SeqnoAdvanced,
    SnapshotDone,
    StreamEnded,
    StreamOpened,
    StreamRefused,
    StreamRollback,
)
from dcp.protocol.frames import FrameReader
from dcp.protocol.layout import HEADER
from dcp.protocol.opcodes import Opcode, Status, StreamEndStatus
from dcp.protocol.session import ClientSession


def _frames(data: bytes) -> list:
    r = FrameReader()
    r.feed(data)
    return r.read_frames()


def _streaming(s: ClientSession, vb: int = 3, end: int = 2**64 - 1) -> int:
    o, req = s.stream_request(vb, start=0, end=end)
    (f,) = _frames(req)
    assert (f.opcode, f.opaque, f.vbucket) == (Opcode.DCP_STREAM_REQ, o, vb)
    (ev,) = s.receive_data(
        codec.response(Opcode.DCP_STREAM_REQ, opaque=o, value=codec.failover_log_value([(99, 0)]))
    )
    assert ev == StreamOpened(o, vb, ((99, 0),))
    return o


def test_a_dcp_noop_is_answered_by_the_session_and_not_counted():
    s = ClientSession(window=1000, queue_per_chunk=True)
    assert s.receive_data(codec.request(Opcode.DCP_NOOP, opaque=77)) == []
    (reply,) = _frames(s.data_to_send())
    assert (reply.magic, reply.opcode, reply.opaque, reply.status) == (
        0x81,
        Opcode.DCP_NOOP,
        77,
        Status.SUCCESS,
    )
    assert s.counted == 0 and s.noops == 1 and s.data_to_send() == b""


def test_buffer_ack_is_produced_when_ackable_bytes_reach_the_threshold():
    s = ClientSession(window=1000, ack_ratio=0.5)  # threshold 500
    o = _streaming(s)
    stray = codec.stream_end(3, o + 1000, 0)  # a late message: counted, ackable at once
    for _ in range(500 // len(stray)):
        s.receive_data(stray)
    assert s.data_to_send() == b"" and s.flow.ackable < 500
    s.receive_data(stray)
    (ack,) = _frames(s.data_to_send())
    assert ack.opcode == Opcode.DCP_BUFFER_ACK
    assert codec.parse_buffer_ack(ack) == (500 // len(stray) + 1) * len(stray) >= 500
    assert s.flow.ackable == 0 and s.acks == 1


def test_snapshot_bytes_are_held_until_complete_then_queued_until_handed():
    s = ClientSession(window=1000, ack_ratio=0.5)  # threshold 500: nothing released early
    o = _streaming(s)
    marker = codec.snapshot_marker(3, o, 1, 2, 1)
    m1 = codec.mutation(3, o, 1, 1, b"a", b"x" * 100)
    m2 = codec.mutation(3, o, 2, 1, b"b", b"x" * 100)
    s.receive_data(marker + m1)
    assert s.flow.held == len(marker + m1) and s.flow.queued == 0
    events = s.receive_data(m2)
    assert [type(e) for e in events] == [Items, SnapshotDone]
    assert events[1].nbytes == len(marker + m1 + m2) == s.flow.queued
    assert s.data_to_send() == b""  # nothing is ackable before the application has it
    assert s.handed(events[1].nbytes) == b""  # 244 bytes: under the threshold
    s.receive_data(
        codec.snapshot_marker(3, o, 3, 3, 1) + codec.mutation(3, o, 3, 1, b"c", b"x" * 300)
    )
    (ack,) = _frames(s.handed(s.flow.queued))
    assert codec.parse_buffer_ack(ack) == s.flow.acked_total >= 500


def test_a_run_of_items_is_one_event_and_the_item_at_the_end_completes_the_snapshot():
    s = ClientSession()
    o = _streaming(s, vb=3)
    data = codec.snapshot_marker(3, o, 1, 4, 1)
    data += b"".join(codec.mutation(3, o, i, 1, b"k%d" % i, b"v") for i in (1, 2, 3))
    data += codec.deletion(3, o, 4, 1, b"k4", delete_time=5)
    events = s.receive_data(data)
    assert [type(e) for e in events] == [Marker, Items, SnapshotDone]
    assert events[0] == Marker(o, 3, 1, 4, 1, None)
    assert [(i.kind, i.seqno, i.key, i.vbucket) for i in events[1].items] == [
        ("mutation", 1, b"k1", 3),
        ("mutation", 2, b"k2", 3),
        ("mutation", 3, b"k3", 3),
        ("deletion", 4, b"k4", 3),
    ]
    assert events[1].items[3].delete_time == 5


def test_a_marker_end_is_clamped_to_the_end_seqno_asked_for():
    s = ClientSession()
    o = _streaming(s, end=10)
    events = s.receive_data(
        codec.snapshot_marker(3, o, 5, 50, 2) + codec.mutation(3, o, 10, 1, b"k", b"v")
    )
    assert events[0].end == 10 and type(events[-1]) is SnapshotDone


def test_seqno_advanced_reaching_the_end_completes_the_snapshot():
    s = ClientSession()
    o = _streaming(s)
    s.receive_data(codec.snapshot_marker(3, o, 1, 9, 2))
    events = s.receive_data(codec.seqno_advanced(3, o, 9))
    assert events == [SeqnoAdvanced(o, 3, 9), SnapshotDone(o, 3, 0 + events[1].nbytes)]


def test_stream_request_answers_ok_rollback_and_refusal():
    s = ClientSession()
    _streaming(s)
    o2, _ = s.stream_request(4, start=50)
    (rb,) = s.receive_data(
        codec.response(Opcode.DCP_STREAM_REQ, Status.ROLLBACK, opaque=o2, value=codec.U64.pack(17))
    )
    assert rb == StreamRollback(o2, 4, 17) and o2 not in s.streams
    o3, _ = s.stream_request(5)
    (ref,) = s.receive_data(
        codec.response(Opcode.DCP_STREAM_REQ, Status.NOT_MY_VBUCKET, opaque=o3, value=b"nope")
    )
    assert ref == StreamRefused(o3, 5, Status.NOT_MY_VBUCKET, b"nope")


def test_rollback_without_its_seqno_is_a_protocol_error():
    s = ClientSession()
    o, _ = s.stream_request(4)
    with pytest.raises(RemoteProtocolError):
        s.receive_data(codec.response(Opcode.DCP_STREAM_REQ, Status.ROLLBACK, opaque=o))


def test_stream_end_ok_completes_the_open_snapshot_other_reasons_discard_it():
    s = ClientSession(window=10_000)
    o = _streaming(s, vb=3)
    s.receive_data(codec.snapshot_marker(3, o, 1, 9, 1) + codec.mutation(3, o, 1, 1, b"k", b"v"))
    events = s.receive_data(codec.stream_end(3, o, StreamEndStatus.OK))
    assert [type(e) for e in events] == [SnapshotDone, StreamEnded] and o not in s.streams
    o2 = _streaming(s, vb=4)
    s.receive_data(codec.snapshot_marker(4, o2, 1, 9, 1) + codec.mutation(4, o2, 1, 1, b"k", b"v"))
    held = s.flow.held
    events = s.receive_data(codec.stream_end(4, o2, StreamEndStatus.SLOW))
    assert events == [StreamEnded(o2, 4, StreamEndStatus.SLOW)]
    assert s.flow.held == 0 and s.flow.ackable >= held  # discarded bytes are ackable
    # a late message of the ended stream: counted, nothing else
    assert s.receive_data(codec.mutation(4, o2, 2, 1, b"k", b"v")) == []


def test_an_item_outside_any_snapshot_is_a_protocol_error_unless_past_the_end():
    s = ClientSession()
    o = _streaming(s, end=5)
    assert s.receive_data(codec.mutation(3, o, 6, 1, b"k", b"v")) == []
    with pytest.raises(RemoteProtocolError):
        s.receive_data(codec.mutation(3, o, 5, 1, b"k", b"v"))


def test_answers_are_matched_by_opaque_and_stat_runs_until_the_empty_key():
    s = ClientSession()
    o1, req = s.request(Opcode.GET_ALL_VB_SEQNOS)
    o2, _ = s.request(Opcode.STAT, stat=True, key=b"")
    assert o1 != o2 and _frames(req)[0].opaque == o1
    data = (
        codec.response(Opcode.STAT, opaque=o2, key=b"a", value=b"1")
        + codec.response(Opcode.GET_ALL_VB_SEQNOS, opaque=12345)  # nobody asked
        + codec.response(Opcode.GET_ALL_VB_SEQNOS, opaque=o1)
        + codec.response(Opcode.STAT, opaque=o2)
        + codec.response(Opcode.STAT, opaque=o2, key=b"late")
    )
    got = [(e.opaque, bytes(e.result.key)) for e in s.receive_data(data)]
    assert got == [(o2, b"a"), (o1, b""), (o2, b"")]


def test_pipelined_writes_get_fresh_opaques_and_successes_come_back_as_tuples():
    s = ClientSession()
    reqs = [
        codec.request(Opcode.SET, key=b"k%d" % i, extras=codec.store_extras()) for i in range(3)
    ]
    opaques, buf = s.pipeline(reqs)
    assert [f.opaque for f in _frames(bytes(buf))] == opaques and len(set(opaques)) == 3
    data = (
        codec.response(
            Opcode.SET, opaque=opaques[2], cas=7, extras=codec.mutation_seqno_extras(5, 6)
        )
        + codec.response(Opcode.SET, opaque=opaques[0], cas=8)
        + codec.response(Opcode.SET, Status.KEY_EEXISTS, opaque=opaques[1])
    )
    events = s.receive_data(data)
    assert [(e.opaque, e.result) for e in events[:2]] == [
        (opaques[2], (7, 5, 6)),
        (opaques[0], (8, None, None)),
    ]
    assert type(events[2]) is Answer and events[2].result.status == Status.KEY_EEXISTS


@pytest.mark.parametrize(
    "bad",
    [
        HEADER.pack(0x42, 0, 0, 0, 0, 0, 0, 0, 0),  # unknown magic
        HEADER.pack(0x80, 0x57, 10, 31, 0, 0, 40, 999, 0) + b"\0" * 40,  # lengths overrun by 1
        HEADER.pack(0x80, 0x57, 0, 0, 0, 0, 1 << 30, 1, 0),  # body over the limit
    ],
)
def test_bad_frames_raise_remote_protocol_error_and_break_the_session(bad):
    s = ClientSession()
    _streaming(s)
    with pytest.raises(RemoteProtocolError):
        s.receive_data(bad)
    with pytest.raises(RemoteProtocolError):
        s.receive_data(codec.request(Opcode.DCP_NOOP))


def test_bad_extras_of_an_item_of_an_open_snapshot_raise():
    s = ClientSession()
    o = _streaming(s)
    s.receive_data(codec.snapshot_marker(3, o, 1, 9, 1))
    with pytest.raises(RemoteProtocolError):
        s.receive_data(codec.request(Opcode.DCP_MUTATION, opaque=o, extras=b"\0" * 30, key=b"k"))


def test_need_more_data_is_an_empty_list():
    s = ClientSession()
    o = _streaming(s)
    data = codec.snapshot_marker(3, o, 1, 1, 1) + codec.mutation(3, o, 1, 1, b"k", b"v")
    got = []
    for i in range(len(data)):
        got += s.receive_data(data[i : i + 1])
    assert [type(e) for e in got] == [Marker, Items, SnapshotDone]
