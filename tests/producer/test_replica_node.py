"""A node whose vbuckets follow another node: STAT replication, metrics, the options of
SET_VBUCKET_STATE, remembered sources, a clean stop while replicating.

Two in-process servers on loopback: A active, B its replica (``replica_of``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import trio

from dcp.producer.engine.item import Item, ItemOp
from dcp.producer.metrics import render
from dcp.producer.server import DcpServer
from dcp.producer.vbucket_states import SOURCES_FILE
from dcp.protocol import Opcode, Status, codec
from dcp.protocol.errors import TemporaryFailure
from dcp.protocol.opcodes import VBucketState

from .conftest import client_of, running_server

NVB = 4


async def _caught_up(a: DcpServer, b: DcpServer, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while any(
            b.bucket.vbucket(v).high_seqno != a.bucket.vbucket(v).high_seqno for v in range(NVB)
        ):
            await trio.sleep(0.02)


async def _fill(a: DcpServer, n: int, prefix: bytes = b"k") -> None:
    async with client_of(a) as c:
        await c.set_many([(prefix + b"%d" % i, b"v%d" % i) for i in range(n)])


async def test_stat_replication_and_metrics_describe_the_replica(tmp_path: Path) -> None:
    async with running_server(tmp_path / "a") as a:
        await _fill(a, 200)
        src = f"127.0.0.1:{a.port}"
        async with running_server(tmp_path / "b", replica_of=src) as b:
            await _caught_up(a, b)
            async with client_of(b) as c:
                st = await c.stats("replication")
                dcp = await c.stats("dcp")
            for vb in range(NVB):
                high = a.bucket.vbucket(vb).high_seqno
                assert st[f"vb_{vb}:state"] == "replica"
                assert st[f"vb_{vb}:source"] == src
                assert st[f"vb_{vb}:high_seqno"] == st[f"vb_{vb}:source_seqno"] == str(high)
                assert st[f"vb_{vb}:lag"] == "0"
                assert st[f"vb_{vb}:stream"] == "streaming"
            assert st[f"source:{src}:connected"] == "true"
            assert st[f"source:{src}:items_applied"] == "200"
            assert int(st[f"source:{src}:bytes_received"]) > 200 * 24
            assert dcp["ep_dcp_replica_items_applied"] == "200"
            assert dcp["ep_dcp_replica_lag"] == "0"
            text = render(b).decode()
            assert f'dcp_replication_items_applied_total{{source="{src}"}} 200.0' in text
            assert f'dcp_replication_connected{{source="{src}"}} 1.0' in text
            assert 'dcp_vbuckets{state="replica"} 4.0' in text
            # the active node has no source: the keys are absent, not zero
            async with client_of(a) as c:
                st_a = await c.stats("replication")
            assert st_a["vb_0:state"] == "active" and "vb_0:source" not in st_a


@pytest.mark.parametrize(
    ("state", "options", "why"),
    [
        (VBucketState.REPLICA, {"source": "nohost"}, "HOST:PORT"),
        (VBucketState.REPLICA, {"source": 5}, "string"),
        (VBucketState.REPLICA, {"src": "127.0.0.1:1"}, "unknown options"),
        (VBucketState.REPLICA, {"takeover": True}, "needs a source"),
        (VBucketState.ACTIVE, {"source": "127.0.0.1:1"}, "has no source"),
        (VBucketState.REPLICA, {"source": "127.0.0.1:1", "takeover": "yes"}, "true or false"),
        (VBucketState.PENDING, {"source": "127.0.0.1:1", "takeover": True}, "from a replica"),
        (VBucketState.REPLICA, {"source": "SELF"}, "this node itself"),
        (VBucketState.REPLICA, {"source": "localhost:SELFPORT"}, "this node itself"),
    ],
)
async def test_bad_options_are_einval_and_change_nothing(
    server: DcpServer, state: VBucketState, options: dict, why: str
) -> None:
    options = {
        k: v.replace("SELFPORT", str(server.port)).replace("SELF", server.vbucket_states.node_name)
        if isinstance(v, str)
        else v
        for k, v in options.items()
    }
    async with client_of(server) as c:
        frame = codec.set_vbucket_state(1, state, opaque=7, options=options)
        answer = await c.call(frame, 7)
    assert answer.opcode == Opcode.SET_VBUCKET_STATE
    assert answer.status == Status.EINVAL, answer
    assert why in bytes(answer.value).decode()
    assert server.bucket.vbucket(1).state is VBucketState.ACTIVE
    assert server.vbucket_states.assignment(1) is None


async def test_sources_are_remembered_across_a_restart(tmp_path: Path) -> None:
    async with running_server(tmp_path / "a") as a:
        await _fill(a, 50)
        src = f"127.0.0.1:{a.port}"
        async with running_server(tmp_path / "b") as b:
            async with client_of(b) as c:
                for vb in (1, 2):
                    f = codec.set_vbucket_state(vb, VBucketState.REPLICA, 9, {"source": src})
                    assert (await c.call(f, 9)).status == Status.SUCCESS
            with trio.fail_after(10):
                while any(
                    b.bucket.vbucket(v).high_seqno != a.bucket.vbucket(v).high_seqno for v in (1, 2)
                ):
                    await trio.sleep(0.02)
            await trio.sleep(0.3)  # the sources file is written within 0.2 s
        saved = json.loads((tmp_path / "b" / SOURCES_FILE).read_text())
        assert saved == {"sources": {"1": src, "2": src}}
        await _fill(a, 80, b"more")  # written while B is down
        async with running_server(tmp_path / "b") as b:
            assert [b.bucket.vbucket(v).state for v in range(NVB)] == [
                VBucketState.ACTIVE,
                VBucketState.REPLICA,
                VBucketState.REPLICA,
                VBucketState.ACTIVE,
            ]
            with trio.fail_after(10):
                while any(
                    b.bucket.vbucket(v).high_seqno != a.bucket.vbucket(v).high_seqno for v in (1, 2)
                ):
                    await trio.sleep(0.02)
            assert b.replication_of(0) == {} and b.replication_of(1)["source"] == src


async def test_a_replica_stops_cleanly_while_its_source_writes(tmp_path: Path) -> None:
    async with running_server(tmp_path / "a") as a:
        src = f"127.0.0.1:{a.port}"
        async with running_server(tmp_path / "b", replica_of=src) as b:
            await _fill(a, 300)
            await trio.sleep(0.05)
        assert b.clean_shutdown
        async with running_server(tmp_path / "b", replica_of=src) as b:
            await _caught_up(a, b)
            for vb in range(NVB):
                assert b.bucket.vbucket(vb).failover_log.entries == (
                    a.bucket.vbucket(vb).failover_log.entries
                )


async def test_no_state_change_while_a_rollback_runs(tmp_path: Path) -> None:
    async with running_server(tmp_path / "b") as b:
        states = b.vbucket_states
        states.set(1, VBucketState.REPLICA, {})
        vb = b.bucket.vbucket(1)
        vb.apply_snapshot(1, 2, 1, [_item(1, 1, b"a"), _item(1, 2, b"b")])
        await b.flush_all()
        slow = b.bucket.rollback_disk
        started = trio.Event()

        def rollback_disk(*args: object) -> object:
            trio.from_thread.run_sync(started.set)
            time.sleep(0.3)
            return slow(*args)  # type: ignore[arg-type]

        b.bucket.rollback_disk = rollback_disk  # type: ignore[method-assign]
        reached: list[int] = []
        async with trio.open_nursery() as n:
            n.start_soon(lambda: _rollback(states, reached))
            await started.wait()
            with pytest.raises(TemporaryFailure, match="rolling back"):
                states.set(1, VBucketState.ACTIVE, {})
            async with client_of(b) as c:
                frame = codec.set_vbucket_state(1, VBucketState.ACTIVE, opaque=3)
                assert (await c.call(frame, 3)).status == Status.ETMPFAIL
        assert reached == [1] and vb.state is VBucketState.REPLICA and vb.high_seqno == 1
        states.set(1, VBucketState.ACTIVE, {})  # done: now it may
        assert vb.state is VBucketState.ACTIVE
        assert vb.failover_log.entries[0][1] == 1


async def _rollback(states: object, out: list[int]) -> None:
    out.append(await states.rollback(1, 1))  # type: ignore[attr-defined]


def _item(vb: int, seqno: int, key: bytes) -> Item:
    return Item(vb, seqno, 1, 100 + seqno, 0, 0, 0, key, b"v", ItemOp.MUTATION, 0, b"")


async def test_a_replica_whose_storage_fails_refuses_snapshots(server: DcpServer) -> None:
    server.vbucket_states.set(2, VBucketState.REPLICA, {})
    server.persistence.storage_error = "disk full (test)"
    with pytest.raises(TemporaryFailure, match="disk full"):
        server.vbucket_states.apply_snapshot(2, 1, 1, 1, [_item(2, 1, b"a")])
    assert server.bucket.vbucket(2).high_seqno == 0
    server.persistence.storage_error = None
    server.vbucket_states.apply_snapshot(2, 1, 1, 1, [_item(2, 1, b"a")])
    assert server.bucket.vbucket(2).high_seqno == 1
