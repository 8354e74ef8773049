"""Replication from a scripted source that misbehaves: the stream is closed, the error
logged, the stream asked again, and nothing of the bad snapshot is applied."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import pytest
import trio

from dcp.producer.replication import Assignment, ReplicationManager
from dcp.protocol import codec
from dcp.protocol.codec import StreamRequest
from dcp.protocol.opcodes import DcpOpenFlag, Opcode, Status, VBucketState

from .scripted_producer import ProducerConn, ScriptedProducer, mutations, stream_ok
from .support import FakeTarget, wait_until

REPLICA = VBucketState.REPLICA
UUID = 0xABCDEF
LOG = [(UUID, 0)]


def manager(target: FakeTarget, **kw: object) -> ReplicationManager:
    kw.setdefault("backoff_initial", 0.02)
    kw.setdefault("backoff_max", 0.1)
    kw.setdefault("noop_interval", None)
    return ReplicationManager(target, **kw)  # type: ignore[arg-type]


def good_then(bad: bytes) -> Callable[[ProducerConn, StreamRequest, int], Awaitable[None]]:
    """First request of vb 0: snapshot [1, 2] (good), then ``bad`` (with OPAQUE and VB
    patched in); later requests: one good snapshot after the replica's start."""

    async def script(conn: ProducerConn, req: StreamRequest, n: int) -> None:
        o, vb = req.opaque, req.vbucket
        await conn.send(stream_ok(req, LOG))
        if n == 0:
            good = codec.snapshot_marker(vb, o, 1, 2, 1) + mutations(vb, o, 1, 2)
            await conn.send(good, bad.replace(b"OPAQ", o.to_bytes(4, "big")))
        else:
            s = req.start_seqno + 1
            await conn.send(codec.snapshot_marker(vb, o, s, s + 1, 1), mutations(vb, o, s, s + 1))

    return script


def _opq(frame: bytes) -> bytes:
    """``frame`` with its opaque replaced by the placeholder b"OPAQ"."""
    return frame[:12] + b"OPAQ" + frame[16:]


BAD_INPUTS = {
    "out-of-order": (
        _opq(codec.snapshot_marker(0, 0, 3, 5, 1))
        + b"".join(_opq(m) for m in (mutations(0, 0, 4), mutations(0, 0, 3), mutations(0, 0, 5))),
        "not above 4",
    ),
    "wrong-vbucket": (
        _opq(codec.snapshot_marker(0, 0, 3, 4, 1))
        + _opq(mutations(0, 0, 3))
        + _opq(mutations(1, 0, 4)),
        "item of vb 1",
    ),
    "repeated-seqno": (
        _opq(codec.snapshot_marker(0, 0, 3, 5, 1))
        + _opq(mutations(0, 0, 3))
        + _opq(mutations(0, 0, 3)),
        "not above 3",
    ),
    "outside-the-marker": (
        _opq(codec.snapshot_marker(0, 0, 3, 4, 1))
        + _opq(mutations(0, 0, 3))
        + _opq(mutations(0, 0, 9)),
        "outside the snapshot [3, 4]",
    ),
    "marker-does-not-advance": (
        _opq(codec.snapshot_marker(0, 0, 1, 2, 1))
        + _opq(mutations(0, 0, 1))
        + _opq(mutations(0, 0, 2)),
        "does not advance past 2",
    ),
    "below-the-replica": (
        _opq(codec.snapshot_marker(0, 0, 1, 4, 1))
        + b"".join(_opq(mutations(0, 0, s)) for s in (2, 3, 4)),
        "not above 2",
    ),
    "next-marker-before-the-end": (
        _opq(codec.snapshot_marker(0, 0, 3, 5, 1))
        + _opq(mutations(0, 0, 3))
        + _opq(codec.snapshot_marker(0, 0, 6, 7, 1))
        + _opq(mutations(0, 0, 6))
        + _opq(mutations(0, 0, 7)),
        "[3, 5] ended at seqno 3, before its end",
    ),
    "stream-end-ok-mid-snapshot": (
        _opq(codec.snapshot_marker(0, 0, 3, 5, 1))
        + _opq(mutations(0, 0, 3))
        + _opq(codec.stream_end(0, 0, 0)),
        "[3, 5] ended at seqno 3, before its end",
    ),
    "state-outside-takeover": (
        _opq(codec.dcp_set_vbucket_state(0, 0, int(VBucketState.ACTIVE))),
        "no takeover",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
async def test_bad_input_closes_that_stream_logs_and_asks_again(case, caplog):
    bad, why = BAD_INPUTS[case]
    target = FakeTarget(2)
    async with ScriptedProducer(good_then(bad)).running() as p:
        mgr = manager(target)
        with caplog.at_level(logging.INFO, logger="dcp.replication"):
            async with trio.open_nursery() as n:
                await n.start(mgr.run)
                mgr.reconcile({0: Assignment(REPLICA, p.address)})
                await wait_until(lambda: target.high[0] == 4)
                n.cancel_scope.cancel()
    # the good snapshot [1, 2] was applied, nothing of the bad one; the stream was
    # closed and asked again from 2, then [3, 4] came whole
    assert [(s, e, [i.seqno for i in it]) for s, e, _f, it in target.snapshots[0]] == [
        (1, 2, [1, 2]),
        (3, 4, [3, 4]),
    ]
    assert p.closes == [0]
    assert [r.start_seqno for r in p.requests] == [0, 2]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and why in errors[0].getMessage(), errors
    assert target.states[0] == REPLICA and not target.refused


async def test_a_snapshot_the_target_refuses_counts_as_bad_input(caplog):
    target = FakeTarget(1)
    refusals = []

    def refuse_once(vb: int, start: int, end: int, items: list) -> None:
        if not refusals:
            refusals.append(start)
            raise ValueError("replication error: not today")

    target.before_apply = refuse_once
    async with ScriptedProducer(good_then(b"")).running() as p:
        mgr = manager(target)
        with caplog.at_level(logging.ERROR, logger="dcp.replication"):
            async with trio.open_nursery() as n:
                await n.start(mgr.run)
                mgr.reconcile({0: Assignment(REPLICA, p.address)})
                await wait_until(lambda: target.high[0] == 2)
                n.cancel_scope.cancel()
    assert refusals == [1] and p.closes == [0]
    assert [r.start_seqno for r in p.requests] == [0, 0]
    assert "not today" in caplog.records[0].getMessage()


async def test_a_protocol_error_drops_the_connection_and_reconnects(caplog):
    async def script(conn: ProducerConn, req: StreamRequest, n: int) -> None:
        o = req.opaque
        await conn.send(stream_ok(req, LOG))
        if conn.producer.connections == 1:  # half a snapshot, then garbage
            await conn.send(codec.snapshot_marker(0, o, 1, 3, 1), mutations(0, o, 1, 2))
            await conn.send(b"\x42" * 24)
        else:
            await conn.send(codec.snapshot_marker(0, o, 1, 3, 1), mutations(0, o, 1, 2, 3))

    target = FakeTarget(1)
    async with ScriptedProducer(script).running() as p:
        mgr = manager(target)
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            mgr.reconcile({0: Assignment(REPLICA, p.address)})
            await wait_until(lambda: target.high[0] == 3)
            stats = mgr.stats()["sources"][p.address]
            n.cancel_scope.cancel()
    assert p.connections == 2 and stats["reconnects"] == 1
    assert [r.start_seqno for r in p.requests] == [0, 0]  # the half snapshot was dropped
    assert [[i.seqno for i in s[3]] for s in target.snapshots[0]] == [[1, 2, 3]]
    assert any("bad magic" in r.getMessage() for r in caplog.records)


async def test_handshake_flow_control_acks_and_refusals_logged_once(caplog):
    async def script(conn: ProducerConn, req: StreamRequest, n: int) -> None:
        if n < 3:
            await conn.send(
                codec.response(Opcode.DCP_STREAM_REQ, Status.NOT_MY_VBUCKET, opaque=req.opaque)
            )
            return
        o = req.opaque
        await conn.send(stream_ok(req, LOG))
        value = b"x" * 300
        for s in range(1, 21):
            await conn.send(
                codec.snapshot_marker(0, o, s, s, 1),
                codec.mutation(0, o, s, 1, b"k%d" % s, value),
            )

    target = FakeTarget(1, node_name="10.0.0.2:11210")
    async with ScriptedProducer(script).running() as p:
        mgr = manager(target, window=2000, noop_interval=2.0)
        with caplog.at_level(logging.INFO, logger="dcp.replication"):
            async with trio.open_nursery() as n:
                await n.start(mgr.run)
                mgr.reconcile({0: Assignment(REPLICA, p.address)})
                await wait_until(lambda: target.high[0] == 20)
                await wait_until(lambda: p.buffer_acked > 4000)
                n.cancel_scope.cancel()
    name = f"replication:{p.address}->10.0.0.2:11210:default"
    flags = int(DcpOpenFlag.PRODUCER | DcpOpenFlag.INCLUDE_DELETE_TIMES)
    assert p.opens == [(name, flags)] and p.hellos == [name]
    assert dict(p.controls) == {
        "enable_noop": "true",
        "set_noop_interval": "2",
        "connection_buffer_size": "2000",
        "enable_expiry_opcode": "true",
        "send_seqno_advanced": "true",
        "send_stream_end_on_client_close_stream": "true",
        "set_priority": "high",
    }
    assert all(r.end_seqno == 2**64 - 1 and r.flags == 0 for r in p.requests)
    assert len(p.requests) == 4
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "NOT_MY_VBUCKET" in refused[0].getMessage()


async def test_a_silent_source_is_dropped_after_two_noop_intervals_and_reconnected():
    target = FakeTarget(1)
    async with ScriptedProducer(good_then(b"")).running() as p:
        mgr = manager(target, noop_interval=0.2)
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            mgr.reconcile({0: Assignment(REPLICA, p.address)})
            await wait_until(lambda: target.high[0] == 2)
            p.conns[0].silent = True  # hangs: no noops, no answer to the probe
            t0 = trio.current_time()
            await wait_until(lambda: p.connections == 2)
            assert trio.current_time() - t0 >= 0.4  # 2 x noop interval of silence
            await wait_until(lambda: target.high[0] == 4)  # resumed from 2 on the new one
            n.cancel_scope.cancel()
    assert [r.start_seqno for r in p.requests] == [0, 2]
