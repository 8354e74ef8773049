"""``ClientSession(item_frames=True)``: runs of items as ``ItemFrames``, driven with bytes.

The property tests of test_session_decoder.py hold this mode to the Items mode on random
input; these pin down the event itself on known buffers.
"""

from __future__ import annotations

import re

import pytest

from dcp.protocol import codec
from dcp.protocol.errors import RemoteProtocolError
from dcp.protocol.events import (
    Deletion,
    Expiration,
    ItemFrames,
    Items,
    Marker,
    Mutation,
    SnapshotDone,
)
from dcp.protocol.layout import HDR_ITEM_CHECK, HDR_MUTATION, MUTATION_EXTRAS
from dcp.protocol.opcodes import Opcode
from dcp.protocol.session import ClientSession

VB = 3


def _streaming(s: ClientSession, vb: int = VB, end: int = 2**64 - 1) -> int:
    o, _ = s.stream_request(vb, end=end)
    s.receive_data(codec.response(Opcode.DCP_STREAM_REQ, opaque=o))
    return o


def _session(**kw) -> tuple[ClientSession, int]:
    s = ClientSession(item_frames=True, **kw)
    return s, _streaming(s)


def _items(e: ItemFrames) -> list:
    return e.items(Mutation, Deletion, Expiration)


def test_a_run_is_the_offsets_of_its_frames_in_the_received_bytes():
    s, o = _session()
    marker = codec.snapshot_marker(VB, o, 1, 10, 1)
    muts = [
        codec.mutation(VB, o, i, 1, b"k%d" % i, b"v" * (10 * i), cas=100 + i) for i in (1, 2, 3)
    ]
    data = marker + b"".join(muts)
    m, run = s.receive_data(data)
    assert m == Marker(o, VB, 1, 10, 1, None)
    assert type(run) is ItemFrames and (run.opaque, run.vbucket) == (o, VB)
    assert run.buf == data and type(run.buf) is bytes
    p1 = len(marker)
    assert run.starts == [p1, p1 + len(muts[0]), p1 + len(muts[0]) + len(muts[1])]
    assert run.last == 3 and run.nbytes == sum(map(len, muts)) == len(data) - p1
    # the consumer reads each frame at its offset with the layouts of layout.py
    assert [HDR_ITEM_CHECK.unpack_from(run.buf, p)[6] for p in run.starts] == [1, 2, 3]
    assert [HDR_MUTATION.unpack_from(run.buf, p)[8] for p in run.starts] == [101, 102, 103]
    items = _items(run)
    assert [(i.seqno, i.key, i.value, i.cas) for i in items] == [
        (1, b"k1", b"v" * 10, 101),
        (2, b"k2", b"v" * 20, 102),
        (3, b"k3", b"v" * 30, 103),
    ]


def test_the_run_owns_immutable_bytes_even_when_fed_a_bytearray():
    s, o = _session()
    data = bytearray(
        codec.snapshot_marker(VB, o, 1, 10, 1) + codec.mutation(VB, o, 1, 1, b"k", b"v")
    )
    _m, run = s.receive_data(data)
    kept = bytes(data)
    data[:] = bytes(len(data))  # the shell reuses its receive buffer
    assert type(run.buf) is bytes and run.buf == kept and _items(run)[0].key == b"k"


def test_deletions_v1_v2_and_expirations_stay_in_the_run_of_mutations():
    s, o = _session()
    frames = [
        codec.mutation(VB, o, 1, 1, b"a", b"x", flags=9, expiry=11, lock_time=13, datatype=1),
        codec.deletion(VB, o, 2, 4, b"b", cas=5),  # V1: 18 bytes of extras
        codec.deletion(VB, o, 3, 4, b"c", value=b"xattrs", cas=6, delete_time=17),  # V2: 21
        codec.expiration(VB, o, 4, 4, b"d", cas=7, delete_time=19),  # 20
        codec.mutation(VB, o, 5, 1, b"e", b"y"),
    ]
    events = s.receive_data(codec.snapshot_marker(VB, o, 1, 100, 1) + b"".join(frames))
    assert [type(e) for e in events] == [Marker, ItemFrames]
    run = events[1]
    assert len(run.starts) == 5 and run.last == 5 and run.nbytes == sum(map(len, frames))
    m1, d1, d2, x, m2 = _items(run)
    assert (type(m1), m1.flags, m1.expiry, m1.lock_time, m1.datatype) == (Mutation, 9, 11, 13, 1)
    assert (type(d1), d1.seqno, d1.rev_seqno, d1.key, d1.cas, d1.delete_time) == (
        Deletion,
        2,
        4,
        b"b",
        5,
        None,
    )
    assert (type(d2), d2.key, d2.value, d2.delete_time) == (Deletion, b"c", b"xattrs", 17)
    assert (type(x), x.seqno, x.key, x.cas, x.delete_time) == (Expiration, 4, b"d", 7, 19)
    assert (type(m2), m2.seqno, m2.key, m2.value) == (Mutation, 5, b"e", b"y")


def test_a_run_cut_at_the_snapshot_end_is_followed_by_snapshot_done():
    s, o = _session(window=10_000)
    m1 = codec.snapshot_marker(VB, o, 1, 2, 1)
    a, b, c = (codec.mutation(VB, o, i, 1, b"k", b"v") for i in (1, 2, 3))
    m2 = codec.snapshot_marker(VB, o, 3, 4, 1)
    events = s.receive_data(m1 + a + b)  # the item at the end, not the next marker, cuts
    assert [type(e) for e in events] == [Marker, ItemFrames, SnapshotDone]
    first, done = events[1], events[2]
    assert first.starts == [len(m1), len(m1 + a)] and first.last == 2
    assert done == SnapshotDone(o, VB, len(m1 + a + b))
    events = s.receive_data(m2 + c)
    assert [type(e) for e in events] == [Marker, ItemFrames]
    assert events[1].starts == [len(m2)] and events[1].last == 3
    # the snapshot still open holds its bytes; the completed one is queued
    assert s.flow.held == len(m2 + c) and s.flow.queued == len(m1 + a + b)
    s, o = _session(window=10_000)  # both snapshots in one call: two runs
    events = s.receive_data(m1 + a + b + m2 + c)
    assert [type(e) for e in events] == [Marker, ItemFrames, SnapshotDone, Marker, ItemFrames]
    assert events[1].starts == [len(m1), len(m1 + a)] and events[1].last == 2
    assert events[2] == SnapshotDone(o, VB, len(m1 + a + b))
    assert events[4].starts == [len(m1 + a + b + m2)] and events[4].last == 3


def test_a_run_is_cut_by_another_stream_and_by_a_noop_between_its_items():
    s, o = _session()
    o2 = _streaming(s, vb=VB + 1)
    start = codec.snapshot_marker(VB, o, 1, 9, 1) + codec.snapshot_marker(VB + 1, o2, 1, 9, 1)
    s.receive_data(start)
    a1, a2, a3 = (codec.mutation(VB, o, i, 1, b"a", b"") for i in (1, 2, 3))
    b1 = codec.deletion(VB + 1, o2, 1, 1, b"b")
    noop = codec.request(Opcode.DCP_NOOP, opaque=99)
    events = s.receive_data(a1 + a2 + b1 + a3 + noop + codec.mutation(VB, o, 4, 1, b"a", b""))
    runs = [(e.opaque, e.vbucket, len(e.starts), e.last) for e in events]
    assert runs == [(o, VB, 2, 2), (o2, VB + 1, 1, 1), (o, VB, 1, 3), (o, VB, 1, 4)]
    assert s.noops == 1


def test_items_that_reach_on_frame_still_come_as_items():
    s, o = _session()
    s.receive_data(codec.snapshot_marker(VB, o, 1, 9, 1))
    # alt framing (framing extras) is not the decoder's item path
    alt = codec.request(
        Opcode.DCP_MUTATION,
        vbucket=VB,
        opaque=o,
        extras=MUTATION_EXTRAS.pack(1, 1, 0, 0, 0, 0, 0),
        key=b"k",
        value=b"v",
        framing_extras=b"\x00",
    )
    (e,) = s.receive_data(alt)
    assert type(e) is Items and e.nbytes == len(alt)
    assert (e.items[0].seqno, e.items[0].key, e.items[0].value) == (1, b"k", b"v")


def test_flow_control_counts_are_those_of_the_items_mode():
    def run(item_frames: bool, queue_per_chunk: bool) -> list:
        s = ClientSession(
            window=600, ack_ratio=0.25, queue_per_chunk=queue_per_chunk, item_frames=item_frames
        )
        o = _streaming(s)
        data = codec.snapshot_marker(VB, o, 1, 6, 1)
        for i in range(1, 7):
            data += codec.mutation(VB, o, i, 1, b"k%d" % i, b"v" * 40)
            if i == 3:
                data += codec.request(Opcode.DCP_NOOP, opaque=5) + codec.stream_end(VB, o + 9, 0)
        seen = []
        for at in range(0, len(data), 97):
            events = s.receive_data(data[at : at + 97])
            nbytes = [
                (type(e).__name__.replace("ItemFrames", "Items"), getattr(e, "nbytes", 0))
                for e in events
            ]
            fc = s.flow
            seen.append((nbytes, s.counted, s.data_to_send(), fc.held, fc.queued, fc.ackable))
            if events and type(events[-1]) is SnapshotDone:
                seen.append(s.handed(events[-1].nbytes))
        return seen

    for queue_per_chunk in (False, True):
        items = run(False, queue_per_chunk)
        assert run(True, queue_per_chunk) == items
        acks = [x for call in items for x in (call if type(call) is tuple else (call,))]
        assert any(type(x) is bytes and x for x in acks)  # the window made acks due


@pytest.mark.parametrize(
    ("offset", "field", "error"),
    [
        (8, (200).to_bytes(4, "big"), "body of 200 bytes exceeds the limit of 100"),
        (2, (60).to_bytes(2, "big"), "framing extras 0 + extras 31 + key 60 exceed body length"),
    ],
)
def test_a_frame_inside_a_run_that_breaks_the_framing_rules_is_refused(offset, field, error):
    s, o = _session(max_body_size=100)
    good = codec.mutation(VB, o, 1, 1, b"k", b"v")
    bad = bytearray(codec.mutation(VB, o, 2, 1, b"k", b"v" * 40))  # 72 bytes of body
    bad[offset : offset + len(field)] = field
    data = codec.snapshot_marker(VB, o, 1, 9, 1) + good + bytes(bad) + bytes(200)
    with pytest.raises(RemoteProtocolError, match=re.escape(error)):
        s.receive_data(data)


def test_a_bad_item_inside_a_run_is_the_items_mode_error():
    s, o = _session()
    good = codec.mutation(VB, o, 1, 1, b"k", b"v")
    bad = bytearray(codec.deletion(VB, o, 2, 1, b"k", value=b"xy"))
    bad[4] = 20  # a deletion with an expiration's extras length
    data = codec.snapshot_marker(VB, o, 1, 9, 1) + good + bytes(bad)
    with pytest.raises(RemoteProtocolError, match=r"^opcode 0x58 with 20 bytes of extras$"):
        s.receive_data(data)
