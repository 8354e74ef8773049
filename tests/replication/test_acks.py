"""A replica acknowledges what it holds: DCP_SEQNO_ACKNOWLEDGED frames (bytes) on the
stream's opaque, at most one per vbucket per received chunk, after whole snapshots only,
again when a flush moves its persisted seqno; none on takeover streams, none when the
source refused ``consumer_name``, and none after the source refused one (logged once)."""

from __future__ import annotations

import logging

import pytest
import trio

from dcp.producer.replication import Assignment, ReplicationManager
from dcp.producer.replication.link import Link, SourceSettings
from dcp.producer.replication.make_items import make_session
from dcp.producer.replication.source import SourceConnection
from dcp.protocol import codec
from dcp.protocol.codec import StreamRequest
from dcp.protocol.frames import Frame, FrameReader
from dcp.protocol.opcodes import Opcode, Status, VBucketState

from .scripted_producer import ProducerConn, ScriptedProducer, mutations, stream_ok
from .support import FakeTarget, wait_until

REPLICA = VBucketState.REPLICA
LOG = [(0xABCDEF, 0)]


# --------------------------------------------------------------------------- no sockets


class Wire:
    """A ``SourceConnection`` fed bytes chunk by chunk (its reader's ``handle``), with
    what it sends read back as frames."""

    def __init__(self, target: FakeTarget, nursery: trio.Nursery, *, acks: bool = True) -> None:
        settings = SourceSettings(open_stream=_no_connect, window=0, consumer_name="n2")
        self.conn = SourceConnection(
            "127.0.0.1:1", target, settings, on_state=lambda vb, s: None, on_idle=lambda: None
        )
        self.link = Link(None, make_session(0))  # type: ignore[arg-type]  # never written
        self.link.acks = acks
        self.nursery = nursery
        self.opaques: dict[int, int] = {}  # vb -> its stream request's opaque

    def start(self, *vbs_takeover: tuple[int, bool]) -> None:
        for vb, takeover in vbs_takeover:
            self.conn.want(vb, takeover)
        self.conn.connected = True
        self.conn.table.connected(self.link, self.nursery)
        for f in self.sent():
            if f.opcode == Opcode.DCP_STREAM_REQ:
                self.opaques[f.vbucket] = f.opaque

    def feed(self, *frames: bytes) -> list[tuple[int, int, int, int | None]]:
        """One chunk in; the acks it made the replica send: (vb, opaque, held, persisted)."""
        self.conn.handle(self.link, b"".join(frames))
        return self.acks()

    def acks(self) -> list[tuple[int, int, int, int | None]]:
        return [
            (f.vbucket, f.opaque, *codec.parse_seqno_acknowledged(f))
            for f in self.sent()
            if f.opcode == Opcode.DCP_SEQNO_ACKNOWLEDGED
        ]

    def sent(self) -> list[Frame]:
        out, self.link._out = bytes(self.link._out), bytearray()
        reader = FrameReader()
        reader.feed(out)
        return list(reader.read_frames())

    def accept(self, vb: int) -> bytes:
        return codec.response(
            Opcode.DCP_STREAM_REQ,
            opaque=self.opaques[vb],
            value=codec.failover_log_value(LOG),
        )

    def snapshot(self, vb: int, start: int, end: int, *seqnos: int) -> bytes:
        o = self.opaques[vb]
        return codec.snapshot_marker(vb, o, start, end, 1) + mutations(vb, o, *seqnos)


async def _no_connect(host: str, port: int) -> trio.abc.Stream:
    raise AssertionError("the wire tests never connect")


def _replica_target(n: int) -> FakeTarget:
    target = FakeTarget(n)
    for vb in range(n):
        target.states[vb] = REPLICA
    return target


async def test_acks_carry_the_stream_opaque_and_coalesce_per_chunk() -> None:
    target = _replica_target(2)
    async with trio.open_nursery() as n:
        w = Wire(target, n)
        w.start((0, False), (1, False))
        o0, o1 = w.opaques[0], w.opaques[1]
        assert o0 != o1
        # accepted: each tells the source where it stands at once
        assert w.feed(w.accept(0), w.accept(1)) == [(0, o0, 0, 0), (1, o1, 0, 0)]
        # two whole snapshots in one chunk: ONE ack, with the second's end
        assert w.feed(w.snapshot(0, 1, 2, 1, 2), w.snapshot(0, 3, 4, 3, 4)) == [(0, o0, 4, 0)]
        # half a snapshot is not held: no ack until it is whole
        assert w.feed(w.snapshot(0, 5, 6, 5)) == []
        assert w.feed(mutations(0, o0, 6)) == [(0, o0, 6, 0)]
        # a chunk of both vbuckets: one ack each
        target.persisted[0] = 2
        assert w.feed(w.snapshot(1, 1, 1, 1), w.snapshot(0, 7, 7, 7)) == [
            (0, o0, 7, 2),
            (1, o1, 1, 0),
        ]
        # nothing new: no ack (a noop chunk)
        assert w.feed(codec.request(Opcode.DCP_NOOP, opaque=99)) == []
        n.cancel_scope.cancel()


async def test_the_exact_ack_bytes() -> None:
    target = _replica_target(1)
    async with trio.open_nursery() as n:
        w = Wire(target, n)
        w.start((0, False))
        w.feed(w.accept(0))
        target.persisted[0] = 1
        w.conn.handle(w.link, w.snapshot(0, 1, 2, 1, 2))
        o = w.opaques[0].to_bytes(4, "big")
        want = (
            bytes([0x80, 0x61, 0, 0, 8, 0, 0, 0])  # magic, opcode, key 0, extras 8, vb 0
            + (16).to_bytes(4, "big")  # body: 8 extras + 8 value
            + o
            + bytes(8)  # cas
            + (2).to_bytes(8, "big")  # held
            + (1).to_bytes(8, "big")  # persisted
        )
        assert bytes(w.link._out) == want  # no flow control here: the ack is all it sent
        n.cancel_scope.cancel()


async def test_a_flush_acks_only_the_vbuckets_whose_persisted_seqno_moved() -> None:
    target = _replica_target(3)
    async with trio.open_nursery() as n:
        w = Wire(target, n)
        w.start((0, False), (1, False), (2, False))
        w.feed(w.accept(0), w.accept(1), w.accept(2))
        w.feed(w.snapshot(0, 1, 3, 1, 2, 3), w.snapshot(1, 1, 2, 1, 2))
        w.conn.flushed()
        assert w.acks() == []  # nothing persisted yet
        target.persisted[0] = 3
        target.persisted[1] = 1
        w.conn.flushed()
        o0, o1 = w.opaques[0], w.opaques[1]
        assert w.acks() == [(0, o0, 3, 3), (1, o1, 2, 1)]
        w.conn.flushed()  # no move since
        assert w.acks() == []
        target.persisted[1] = 2
        w.conn.flushed()
        assert w.acks() == [(1, o1, 2, 2)]
        n.cancel_scope.cancel()


async def test_no_acks_on_takeover_streams_nor_when_consumer_name_was_refused() -> None:
    target = _replica_target(2)
    async with trio.open_nursery() as n:
        w = Wire(target, n)
        w.start((0, True), (1, False))
        assert w.feed(w.accept(0), w.accept(1)) == [(1, w.opaques[1], 0, 0)]
        assert w.feed(w.snapshot(0, 1, 1, 1)) == []
        target.persisted[0] = 1
        w.conn.flushed()
        assert w.acks() == []

        off = Wire(_replica_target(1), n, acks=False)
        off.start((0, False))
        assert off.feed(off.accept(0), off.snapshot(0, 1, 1, 1)) == []
        n.cancel_scope.cancel()


async def test_a_refused_ack_stops_acks_on_the_connection_logged_once(caplog) -> None:
    target = _replica_target(2)
    caplog.set_level(logging.WARNING, logger="dcp.replication")
    async with trio.open_nursery() as n:
        w = Wire(target, n)
        w.start((0, False), (1, False))
        o0 = w.opaques[0]
        assert len(w.feed(w.accept(0), w.accept(1))) == 2
        refusal = codec.response(
            Opcode.DCP_SEQNO_ACKNOWLEDGED, Status.EINVAL, opaque=o0, value=b"no consumer_name"
        )
        assert w.feed(refusal, w.snapshot(0, 1, 1, 1), w.snapshot(1, 1, 1, 1)) == []
        assert w.feed(refusal, w.snapshot(0, 2, 2, 2)) == []
        target.persisted[0] = 2
        w.conn.flushed()
        assert w.acks() == []
        assert target.high[0] == 2  # replication itself goes on
        n.cancel_scope.cancel()
    logged = [r.getMessage() for r in caplog.records if "SEQNO_ACKNOWLEDGED" in r.getMessage()]
    assert len(logged) == 1 and "0x04" in logged[0] and "no consumer_name" in logged[0]


# --------------------------------------------------------------------------- over TCP


def _two_snapshots():
    async def script(conn: ProducerConn, req: StreamRequest, n: int) -> None:
        o, vb = req.opaque, req.vbucket
        await conn.send(stream_ok(req, LOG))
        await conn.send(codec.snapshot_marker(vb, o, 1, 2, 1), mutations(vb, o, 1, 2))
        await conn.send(codec.snapshot_marker(vb, o, 3, 4, 1), mutations(vb, o, 3, 4))

    return script


def _manager(target: FakeTarget) -> ReplicationManager:
    return ReplicationManager(
        target,  # type: ignore[arg-type]
        backoff_initial=0.02,
        backoff_max=0.1,
        noop_interval=None,
        consumer_name="node-b",
    )


async def test_over_tcp_the_handshake_names_the_node_and_acks_reach_the_source() -> None:
    target = FakeTarget(2)
    async with ScriptedProducer(_two_snapshots()).running() as p:
        mgr = _manager(target)
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            mgr.reconcile({0: Assignment(REPLICA, p.address), 1: Assignment(REPLICA, p.address)})
            await wait_until(lambda: target.high[0] == target.high[1] == 4)
            await wait_until(lambda: _acked(p) == {0: 4, 1: 4})
            target.persisted[1] = 4
            mgr.flushed()
            await wait_until(lambda: (1, 4, 4) in _triples(p))
            n.cancel_scope.cancel()
    assert ("consumer_name", "node-b") in p.controls
    opaques = {r.vbucket: r.opaque for r in p.requests}
    assert all(f.opaque == opaques[f.vbucket] for f in p.seqno_acks)
    assert (0, 4, 4) not in _triples(p)  # vb 0 persisted nothing: no flush ack


@pytest.mark.parametrize("how", ["control refused", "ack refused"])
async def test_over_tcp_an_older_source_gets_no_more_acks(how: str, caplog) -> None:
    target = FakeTarget(1)
    caplog.set_level(logging.WARNING, logger="dcp.replication")
    async with ScriptedProducer(_two_snapshots()).running() as p:
        if how == "control refused":
            p.refuse_controls.add("consumer_name")
        else:
            p.ack_status = Status.UNKNOWN_COMMAND
        mgr = _manager(target)
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            mgr.reconcile({0: Assignment(REPLICA, p.address)})
            await wait_until(lambda: target.high[0] == 4)
            await trio.sleep(0.2)  # late acks would have arrived by now
            target.persisted[0] = 4
            mgr.flushed()
            await trio.sleep(0.2)
            n.cancel_scope.cancel()
    if how == "control refused":
        assert p.seqno_acks == []
        assert any("refused control consumer_name" in r.getMessage() for r in caplog.records)
    else:
        # the first acks were refused: the flush sent none
        assert p.seqno_acks and (0, 4, 4) not in _triples(p)
        logged = [r for r in caplog.records if "refused DCP_SEQNO_ACKNOWLEDGED" in r.getMessage()]
        assert len(logged) == 1


def _triples(p: ScriptedProducer) -> list[tuple[int, int, int | None]]:
    return [(f.vbucket, *codec.parse_seqno_acknowledged(f)) for f in p.seqno_acks]


def _acked(p: ScriptedProducer) -> dict[int, int]:
    out: dict[int, int] = {}
    for vb, held, _ in _triples(p):
        out[vb] = max(out.get(vb, 0), held)
    return out
