"""DCP_SEQNO_ACKNOWLEDGED (0x61) from bad or confused peers, and where the majority and
stable seqnos are reported (seqno_ack.py, stats.py, metrics.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from dcp.producer import seqno_ack
from dcp.producer.metrics import render
from dcp.protocol import DurabilityLevel, Opcode, Status, VBucketState, codec

from .conftest import client_of, running_server
from .test_sync_writes import NVB, durable_set, read_mutation, replica_of
from .wire import keys_for_vb


def _ack_frame(vb: int, opaque: int, extras: bytes, value: bytes = b"", key: bytes = b"") -> bytes:
    op = Opcode.DCP_SEQNO_ACKNOWLEDGED
    return codec.request(op, vbucket=vb, opaque=opaque, extras=extras, key=key, value=value)


async def test_malformed_acks_are_einval_and_everyone_carries_on(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as other:
        server.durability.set_topology([("self", "B")] * NVB)
        replica, opaque = await replica_of(server, 0)
        try:
            bad = [
                _ack_frame(0, opaque, b"\x00" * 4),  # extras of 4 bytes
                _ack_frame(0, opaque, b"\x00" * 16),  # extras of 16 bytes
                _ack_frame(0, opaque, codec.U64.pack(1), value=b"\x01\x02"),  # value 2 bytes
                _ack_frame(0, opaque, codec.U64.pack(1), key=b"k"),  # a key
            ]
            for frame in bad:
                r = await replica.call(frame, opaque)
                assert (r.opcode, r.status) == (Opcode.DCP_SEQNO_ACKNOWLEDGED, Status.EINVAL)
            assert server.durability.majority_seqno(0) == 0
            # the connection still works: its stream delivers and a good ack counts
            (k,) = keys_for_vb(0, 1, NVB)
            await other.set(k, b"v")
            await read_mutation(replica, 1)
            await replica.send(codec.seqno_acknowledged(0, opaque, 1, 1))
            assert (await other.get(k)).status == Status.SUCCESS  # others never noticed
            op = next(replica.opaques)
            r = await replica.call(codec.request(Opcode.NOOP, opaque=op), op)
            assert r.status == Status.SUCCESS
            assert server.durability.majority_seqno(0) == 1
        finally:
            await replica.aclose()


async def test_an_ack_needs_dcp_open_and_a_consumer_name(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as c:
        server.durability.set_topology([("self", "B")] * NVB)
        ack = codec.seqno_acknowledged(0, 7, 1, 1)
        r = await c.call(ack, 7)
        assert r.status == Status.EINVAL  # not a DCP connection
        assert (await c.dcp_open("replication:B")).status == Status.SUCCESS
        r = await c.call(ack, 7)
        assert r.status == Status.EINVAL and b"consumer_name" in bytes(r.value)
        assert (await c.control("consumer_name", "B")).status == Status.SUCCESS
        await c.send(ack)  # no stream for vb 0 on this connection: dropped, not answered
        assert not await c.frames_for(0.3)
        assert (await c.control("consumer_name", "")).status == Status.EINVAL


async def test_a_hostile_ack_is_logged_but_not_every_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seqno_ack, "_ack_log", seqno_ack._AckLog())  # a fresh window
    async with running_server(tmp_path / "d") as server:
        server.durability.set_topology([("self", "B")] * NVB)
        replica, opaque = await replica_of(server, 1)
        try:
            with caplog.at_level(logging.WARNING, logger="dcp.producer"):
                for i in range(50):
                    await replica.send(codec.seqno_acknowledged(1, opaque, 10**9 + i, 0))
                op = next(replica.opaques)
                await replica.call(codec.request(Opcode.NOOP, opaque=op), op)  # all handled
            lines = [r for r in caplog.records if "seqno ack" in r.getMessage()]
            assert 1 <= len(lines) <= 10, len(lines)
            assert "clamped" in lines[0].getMessage()
            assert server.durability.majority_seqno(1) == 0  # nothing was sent to it
        finally:
            await replica.aclose()


async def test_stats_and_metrics_show_the_majority_and_stable_seqnos(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as w:
        server.durability.set_topology([("self", "B")] * NVB)
        replica, opaque = await replica_of(server, 2)
        try:
            k1, k2 = keys_for_vb(2, 2, NVB)
            await w.set(k1, b"1")
            await w.set(k2, b"2")
            await read_mutation(replica, 2)
            await replica.send(codec.seqno_acknowledged(2, opaque, 1, 1))
            op, frame = durable_set(w, k1, DurabilityLevel.MAJORITY, 200)
            await w.call(frame, op)  # seqno 3: ambiguous, counted
            server.vbucket_states.set(3, VBucketState.REPLICA, {})
            st = await w.stats("vbucket-seqno")
            assert st["vb_2:high_seqno"] == "3"
            assert st["vb_2:majority_seqno"] == "1"
            assert st["vb_2:majority_persisted_seqno"] == "1"
            assert st["vb_2:stable_seqno"] == "1"
            assert st["vb_0:stable_seqno"] == "0"
            assert "vb_3:stable_seqno" not in st and "vb_3:high_seqno" in st  # a replica
            text = render(server).decode()
            assert 'dcp_sync_writes_total{level="majority",outcome="ambiguous"} 1.0' in text
            assert "dcp_stable_seqno_lag_sum 2.0" in text  # vb 2: 3 - 1
            assert "dcp_stable_seqno_lag_max 2.0" in text
        finally:
            await replica.aclose()


async def test_a_single_nodes_stable_seqno_is_what_it_persisted(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as w:
        server.pause_persistence()
        (k,) = keys_for_vb(0, 1, NVB)
        await w.set(k, b"v")
        st = await w.stats("vbucket-seqno 0")
        assert (st["vb_0:majority_seqno"], st["vb_0:stable_seqno"]) == ("1", "0")
        server.resume_persistence()
        await server.flush_all()
        assert server.durability.stable_seqno(0) == 1


def test_the_ack_needs_the_replicate_privilege() -> None:
    """Not ``stream``, which every change consumer holds (tests/auth/test_replicate.py)."""
    from dcp.producer.gate import OPCODE_PRIVILEGES

    assert OPCODE_PRIVILEGES[Opcode.DCP_SEQNO_ACKNOWLEDGED] == "replicate"


async def test_wait_stable_is_called_back_on_the_ack_and_soon_when_already_stable(
    tmp_path: Path,
) -> None:
    """What a stable-only stream relies on: the server's monitor calls back on the trio
    thread once the stable seqno reaches the wanted one, never from inside the call."""
    async with running_server(tmp_path / "d") as server, client_of(server) as w:
        server.durability.set_topology([("self", "B")] * NVB)
        replica, opaque = await replica_of(server, 1)
        try:
            (k,) = keys_for_vb(1, 1, NVB)
            await w.set(k, b"v")
            stable = trio.Event()
            server.durability.wait_stable(1, 1, stable.set)
            await read_mutation(replica, 1)
            assert not stable.is_set()
            await replica.send(codec.seqno_acknowledged(1, opaque, 1))
            with trio.fail_after(5):
                await stable.wait()
            again = trio.Event()
            server.durability.wait_stable(1, 1, again.set)  # already stable
            assert not again.is_set()  # not from inside wait_stable
            with trio.fail_after(5):
                await again.wait()
        finally:
            await replica.aclose()
