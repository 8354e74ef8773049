"""``ClientSession``'s index of STREAMING streams by vbucket (session_stream.py
``StreamingIndex``): ``seqno_acknowledged`` finds the stream without a scan, and the
index follows every transition, driven with bytes."""

from __future__ import annotations

import pytest

from dcp.protocol import codec
from dcp.protocol.events import StreamEnded, StreamOpened, StreamRefused, StreamRollback
from dcp.protocol.opcodes import Opcode, Status, StreamEndStatus
from dcp.protocol.session import ClientSession
from dcp.protocol.session_stream import STREAMING


def _scan(s: ClientSession, vb: int) -> int | None:
    """The opaque a full scan finds: the first STREAMING stream of ``vb`` in order."""
    for st in s.streams.values():
        if st.vbucket == vb and st.state == STREAMING:
            return st.opaque
    return None


def _acks_under(s: ClientSession, vb: int) -> int | None:
    """The opaque of the ack the session builds for ``vb`` (None: no ack), checked
    against a full scan of its streams."""
    ack = s.seqno_acknowledged(vb, 9)
    got = None if ack is None else codec.U32.unpack_from(ack, 12)[0]
    assert got == _scan(s, vb)
    if ack is not None:
        assert ack == codec.seqno_acknowledged(vb, got, 9)
    return got


def _answer(s: ClientSession, o: int, status: int = Status.SUCCESS, value: bytes | None = None):
    if value is None:
        value = codec.failover_log_value([(7, 0)]) if status == Status.SUCCESS else b""
    return s.receive_data(codec.response(Opcode.DCP_STREAM_REQ, status, opaque=o, value=value))


def test_the_index_follows_accept_end_forget_refusal_rollback_and_a_new_stream():
    s = ClientSession()
    o1, _ = s.stream_request(5)
    assert _acks_under(s, 5) is None  # requested, not accepted
    assert _answer(s, o1) == [StreamOpened(o1, 5, ((7, 0),))]
    assert _acks_under(s, 5) == o1
    # the stream ends: no ack; a new stream of the same vbucket is acked under its opaque
    ended = s.receive_data(codec.stream_end(5, o1, StreamEndStatus.OK))
    assert ended == [StreamEnded(o1, 5, StreamEndStatus.OK)]
    assert _acks_under(s, 5) is None
    o2, _ = s.stream_request(5)
    assert _acks_under(s, 5) is None
    _answer(s, o2)
    assert _acks_under(s, 5) == o2
    # close + forget (the shell stops tracking it before its STREAM_END arrives)
    _, close = s.close_stream(5)
    assert close[1] == Opcode.DCP_CLOSE_STREAM
    s.forget(o2)
    assert _acks_under(s, 5) is None
    # its late STREAM_END changes nothing
    assert s.receive_data(codec.stream_end(5, o2, StreamEndStatus.CLOSED)) == []
    assert _acks_under(s, 5) is None
    # a refusal and a rollback leave nothing indexed
    o3, _ = s.stream_request(5)
    assert _answer(s, o3, Status.KEY_EEXISTS) == [StreamRefused(o3, 5, Status.KEY_EEXISTS, b"")]
    assert _acks_under(s, 5) is None
    o4, _ = s.stream_request(5, start=20)
    rolled = _answer(s, o4, Status.ROLLBACK, codec.U64.pack(10))
    assert rolled == [StreamRollback(o4, 5, 10)]
    assert _acks_under(s, 5) is None
    o5, _ = s.stream_request(5, start=10)
    _answer(s, o5)
    assert _acks_under(s, 5) == o5
    assert _acks_under(s, 6) is None


def test_a_refused_second_request_leaves_the_streaming_one_indexed():
    s = ClientSession()
    o1, _ = s.stream_request(3)
    _answer(s, o1)
    o2, _ = s.stream_request(3)  # a second request of a streamed vbucket
    _answer(s, o2, Status.KEY_EEXISTS)
    assert _acks_under(s, 3) == o1
    s.forget(o2)  # forgetting an unknown opaque is harmless
    assert _acks_under(s, 3) == o1


@pytest.mark.parametrize("first_ends", ["stream_end", "forget"])
def test_two_streams_of_one_vbucket_ack_under_the_first_then_the_other(first_ends):
    """A server that accepts a second stream of one vbucket (ours refuses it): the ack
    goes under the first one requested, as a scan finds, and under the other once the
    first is gone."""
    s = ClientSession()
    o1, _ = s.stream_request(2)
    o2, _ = s.stream_request(2)
    _answer(s, o2)  # the later request is accepted first
    assert _acks_under(s, 2) == o2
    _answer(s, o1)
    assert _acks_under(s, 2) == o1
    if first_ends == "stream_end":
        s.receive_data(codec.stream_end(2, o1, StreamEndStatus.STATE_CHANGED))
    else:
        s.forget(o1)
    assert _acks_under(s, 2) == o2
    s.receive_data(codec.stream_end(2, o2, StreamEndStatus.OK))
    assert _acks_under(s, 2) is None


def test_many_vbuckets_each_acked_under_its_own_stream():
    s = ClientSession()
    opaques = {vb: s.stream_request(vb)[0] for vb in range(64)}
    for vb in range(0, 64, 2):
        _answer(s, opaques[vb])
    for vb in range(64):
        assert _acks_under(s, vb) == (opaques[vb] if vb % 2 == 0 else None)
    for vb in range(0, 64, 4):
        s.receive_data(codec.stream_end(vb, opaques[vb], StreamEndStatus.OK))
    for vb in range(64):
        assert _acks_under(s, vb) == (opaques[vb] if vb % 4 == 2 else None)


class _NoScan(dict):
    """``streams`` that fails the test when anything walks it."""

    def values(self):
        raise AssertionError("the ack scanned the session's streams")

    def __iter__(self):
        raise AssertionError("the ack scanned the session's streams")

    def items(self):
        raise AssertionError("the ack scanned the session's streams")


def test_an_ack_does_not_scan_the_streams_of_the_connection():
    """The cost the index removes: a replication connection holds hundreds of streams
    and a replica acks every snapshot it applies."""
    s = ClientSession()
    opaques = [s.stream_request(vb)[0] for vb in range(340)]
    for o in opaques:
        _answer(s, o)
    s.streams = _NoScan(s.streams)
    assert s.seqno_acknowledged(339, 4) == codec.seqno_acknowledged(339, opaques[-1], 4)
    assert s.seqno_acknowledged(1000, 4) is None


def test_an_opaque_that_wraps_onto_a_streaming_stream_unindexes_it():
    """After 2**32 requests the opaque counter comes back to 1: the new request
    replaces the stream still tracked there, which is no longer acked."""
    s = ClientSession()
    o1, _ = s.stream_request(5)
    _answer(s, o1)
    s._opaque = 0xFFFFFFFF  # 4 billion requests later
    o2, _ = s.stream_request(7)
    assert o2 == o1
    assert _acks_under(s, 5) is None
    _answer(s, o2)
    assert _acks_under(s, 7) == o2
