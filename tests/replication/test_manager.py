"""ReplicationManager: reconcile (states, streams moving between sources, streams
stopping) and the takeover hand-over, against scripted sources."""

from __future__ import annotations

import logging

import trio

from dcp.producer.replication import Assignment, ReplicationManager
from dcp.protocol import codec
from dcp.protocol.codec import StreamRequest
from dcp.protocol.opcodes import Opcode, StreamEndStatus, StreamRequestFlag, VBucketState

from .scripted_producer import ProducerConn, ScriptedProducer, mutations, stream_ok
from .support import FakeTarget, wait_until

ACTIVE, REPLICA, PENDING, DEAD = (
    VBucketState.ACTIVE,
    VBucketState.REPLICA,
    VBucketState.PENDING,
    VBucketState.DEAD,
)
LOG = [(0x77, 0)]


def manager(target: FakeTarget) -> ReplicationManager:
    return ReplicationManager(target, backoff_initial=0.02, backoff_max=0.1, noop_interval=None)


async def one_snapshot_each(conn: ProducerConn, req: StreamRequest, n: int) -> None:
    """Accept; send one snapshot of one item after the replica's start."""
    o, vb, s = req.opaque, req.vbucket, req.start_seqno + 1
    await conn.send(stream_ok(req, LOG), codec.snapshot_marker(vb, o, s, s, 1), mutations(vb, o, s))


async def test_reconcile_sets_states_moves_streams_and_stops_idle_sources():
    target = FakeTarget(4)
    async with (
        ScriptedProducer(one_snapshot_each).running() as a,
        ScriptedProducer(one_snapshot_each).running() as b,
    ):
        mgr = manager(target)
        # reconcile before run: remembered, started by run
        mgr.reconcile(
            {
                0: Assignment(REPLICA, a.address),
                1: Assignment(PENDING, a.address),
                2: Assignment(ACTIVE, a.address),  # active: never streamed
                3: Assignment(DEAD),
            }
        )
        assert [c[1:] for c in target.set_calls()] == [
            (0, REPLICA, False),
            (1, PENDING, False),
            (3, DEAD, False),
        ]
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            await wait_until(lambda: target.high[0] == 1 and target.high[1] == 1)
            assert sorted(r.vbucket for r in a.requests) == [0, 1]
            assert mgr.vbucket_info(2) is None and mgr.vbucket_info(3) is None
            info = mgr.vbucket_info(0)
            assert info is not None and info["source"] == a.address and info["connected"]
            # vb 0 moves to b; vb 1 stops being replicated: a closes both, then is idle
            mgr.reconcile(
                {
                    0: Assignment(REPLICA, b.address),
                    2: Assignment(ACTIVE, a.address),
                    3: Assignment(DEAD),
                }
            )
            await wait_until(lambda: sorted(a.closes) == [0, 1])
            await wait_until(lambda: a.eofs == 1)  # its connection was closed
            await wait_until(lambda: target.high[0] == 2)
            assert [(r.vbucket, r.start_seqno) for r in b.requests] == [(0, 1)]
            assert set(mgr.stats()["sources"]) == {b.address}
            assert len(target.set_calls()) == 3  # no state changed again
            pairs = dict(mgr.stat_pairs())
            assert pairs["vb_0:source"] == b.address and pairs["vb_0:lag"] == "0"
            assert pairs[f"source:{b.address}:connected"] == "true"
            assert pairs[f"source:{b.address}:items_applied"] == "1"
            assert "vb_1:source" not in pairs
            # nothing assigned any more: every connection goes
            mgr.reconcile({})
            await wait_until(lambda: b.eofs == 1)
            assert mgr.stats() == {"sources": {}, "vbuckets": {}}
            n.cancel_scope.cancel()


async def test_takeover_applies_the_sources_states_acks_them_and_finishes():
    seen_at_ack: list[VBucketState] = []
    target = FakeTarget(1)

    async def takeover(conn: ProducerConn, req: StreamRequest, n: int) -> None:
        o = req.opaque
        if not req.flags & StreamRequestFlag.TAKEOVER:
            await conn.send(stream_ok(req, LOG))  # a plain replica stream: just accept it
            return
        await conn.send(stream_ok(req, LOG), codec.snapshot_marker(0, o, 1, 2, 1))
        await conn.send(mutations(0, o, 1, 2))
        for state in (PENDING, ACTIVE):
            await conn.send(codec.dcp_set_vbucket_state(0, o, int(state)))
            ack = await conn.response(Opcode.DCP_SET_VBUCKET_STATE, o)
            assert ack.vbucket == 0  # status SUCCESS
            seen_at_ack.append(target.states[0])
        await conn.send(codec.stream_end(0, o, StreamEndStatus.OK))

    async with ScriptedProducer(takeover).running() as p:
        mgr = manager(target)
        assignment = {0: Assignment(REPLICA, p.address, takeover=True)}
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            mgr.reconcile(assignment)
            assert mgr.vbucket_info(0) is not None
            await wait_until(lambda: len(seen_at_ack) == 2)
            await wait_until(lambda: p.eofs == 1)  # nothing left: the connection closed
            # the same assignment again: the vbucket stays active, nothing is asked again
            mgr.reconcile(assignment)
            await trio.sleep(0.2)
            assert len(p.requests) == 1 and p.connections == 1
            assert mgr.vbucket_info(0) is None
            # a new assignment of the vbucket is followed again
            mgr.reconcile({0: Assignment(REPLICA, p.address)})
            await wait_until(lambda: len(p.requests) == 2)
            n.cancel_scope.cancel()
    assert [c[1:] for c in target.set_calls()] == [
        (0, REPLICA, False),
        (0, PENDING, True),
        (0, ACTIVE, True),
        (0, REPLICA, False),
    ]
    assert seen_at_ack == [PENDING, ACTIVE]  # each ack came after the state was set
    assert [i.seqno for i in target.items[0]] == [1, 2]
    assert p.requests[1].flags == 0 and p.requests[1].start_seqno == 2


async def test_a_bad_source_address_is_refused_before_anything_changes():
    target = FakeTarget(2)
    mgr = manager(target)
    for bad in ("nohost", "host:", "host:0", "host:99999", ":11210"):
        try:
            mgr.reconcile({0: Assignment(REPLICA), 1: Assignment(REPLICA, bad)})
        except ValueError as exc:
            assert "HOST:PORT" in str(exc)
        else:
            raise AssertionError(f"{bad!r} accepted")
    assert target.calls == [] and mgr.assignment() == {}


async def test_an_unreachable_source_is_retried_with_backoff_and_shown_disconnected():
    with trio.socket.socket() as s:  # a port nobody listens on
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        target = FakeTarget(1)
        mgr = manager(target)
        source = f"127.0.0.1:{port}"
        async with trio.open_nursery() as n:
            await n.start(mgr.run)
            mgr.reconcile({0: Assignment(REPLICA, source)})
            await wait_until(lambda: mgr.stats()["sources"][source]["reconnects"] >= 3)
            info = mgr.vbucket_info(0)
            assert info is not None and info["connected"] is False
            assert info["stream"] == "backoff"
            assert dict(mgr.stat_pairs())[f"source:{source}:connected"] == "false"
            n.cancel_scope.cancel()


async def test_a_takeover_that_skips_pending_is_refused(caplog):
    # ACTIVE straight away: the source may still be active itself; never two actives
    target = FakeTarget(1)
    acks: list[int] = []

    async def takeover(conn: ProducerConn, req: StreamRequest, n: int) -> None:
        o = req.opaque
        await conn.send(stream_ok(req, LOG), codec.snapshot_marker(0, o, 1, 2, 1))
        await conn.send(mutations(0, o, 1, 2))
        await conn.send(codec.dcp_set_vbucket_state(0, o, int(ACTIVE)))
        with trio.move_on_after(0.5):
            acks.append((await conn.response(Opcode.DCP_SET_VBUCKET_STATE, o)).vbucket)

    async with ScriptedProducer(takeover).running() as p:
        mgr = manager(target)
        with caplog.at_level(logging.ERROR, logger="dcp.replication"):
            async with trio.open_nursery() as n:
                await n.start(mgr.run)
                mgr.reconcile({0: Assignment(REPLICA, p.address, takeover=True)})
                await wait_until(lambda: len(p.requests) >= 2)  # closed, asked again
                n.cancel_scope.cancel()
    assert target.states[0] == REPLICA and acks == []
    assert any("active before pending" in r.getMessage() for r in caplog.records)
