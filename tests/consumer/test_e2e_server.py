"""End to end against the real server (``dcp.producer.server``)."""

from __future__ import annotations

import contextlib

import trio

from dcp.consumer import (
    DcpClient,
    Deletion,
    FileOffsetStore,
    KvClient,
    Mutation,
    RollbackEvent,
    SnapshotBatch,
)
from dcp.producer.server import DcpServer, ServerConfig
from dcp.protocol import codec

NUM_VB = 8


@contextlib.asynccontextmanager
async def running_server(data_dir, **kw):
    cfg = ServerConfig(
        host="127.0.0.1",
        port=0,
        data_dir=str(data_dir),
        num_vbuckets=NUM_VB,
        log_level="WARNING",
        **kw,
    )
    async with DcpServer(cfg) as server:
        yield server


def client(server, **kw) -> DcpClient:
    kw.setdefault("noop_interval", 1.0)
    return DcpClient("127.0.0.1", server.port, **kw)


def kv(server) -> KvClient:
    return KvClient("127.0.0.1", server.port, num_vbuckets=NUM_VB)


def _latest(items) -> dict[bytes, object]:
    state: dict[bytes, object] = {}
    for b in items:
        if isinstance(b, SnapshotBatch):
            for e in b:
                state[e.key] = e.value if isinstance(e, Mutation) else None
    return state


async def test_writes_are_streamed_as_whole_snapshots_to_latest(tmp_path):
    async with running_server(tmp_path / "d") as server:
        async with kv(server) as k:
            await k.set_many({f"k{i}": f"v{i}" for i in range(300)})
            await k.set("k5", b"new")
            await k.delete("k7")
        async with client(server, to_latest=True) as c:
            items = [b async for b in c]
            await c.commit()
            committed = c.committed()
    state = _latest(items)
    assert state[b"k5"] == b"new" and state[b"k7"] is None and state[b"k299"] == b"v299"
    assert any(isinstance(e, Deletion) for b in items for e in b)
    for b in items:
        assert [e.seqno for e in b] == sorted(e.seqno for e in b)
        assert all(b.start <= e.seqno <= b.end for e in b)
    assert sum(o.seqno for o in committed.values()) == 302


async def test_restart_from_a_file_store_neither_loses_nor_repeats(tmp_path):
    path = tmp_path / "offsets.json"
    async with running_server(tmp_path / "d") as server:
        async with kv(server) as k:
            await k.set_many({f"a{i}": b"1" for i in range(100)})
        async with client(server, to_latest=True, offset_store=FileOffsetStore(path)) as c:
            first = [e.key async for e in _events(c)]
            await c.commit()
        async with kv(server) as k:
            await k.set_many({f"b{i}": b"2" for i in range(50)})
        async with client(server, to_latest=True, offset_store=FileOffsetStore(path)) as c:
            second = [e.key async for e in _events(c)]
            await c.commit()
    assert sorted(first) == sorted(f"a{i}".encode() for i in range(100))
    assert sorted(second) == sorted(f"b{i}".encode() for i in range(50))


async def _events(c: DcpClient):
    async for b in c:
        for e in b:
            yield e


async def test_durable_write_reports_a_persisted_seqno(tmp_path):
    async with running_server(tmp_path / "d") as server:
        async with kv(server) as k:
            r = await k.set("durable-doc", b"x", durable=True)
        vb = codec.vbucket_for_key(b"durable-doc", NUM_VB)
        assert r.vbucket == vb and r.seqno == 1 and r.vb_uuid
        assert server.persistence.persisted_seqno(vb) >= 1


async def test_unclean_restart_is_reported_as_a_rollback(tmp_path):
    data = tmp_path / "d"
    path = tmp_path / "offsets.json"
    async with running_server(data) as server:
        async with kv(server) as k:
            await k.set_many({f"p{i}": b"persisted" for i in range(40)})
            await server.flush_all()
            server.pause_persistence()
            await k.set_many({f"m{i}": b"memory-only" for i in range(40)})
        async with client(server, to_latest=True, offset_store=FileOffsetStore(path)) as c:
            seen = [e.key async for e in _events(c)]
            await c.commit()
        assert len(seen) == 80
        server.request_shutdown(clean=False)
    async with running_server(data) as server:
        async with client(server, to_latest=True, offset_store=FileOffsetStore(path)) as c:
            with trio.fail_after(20):
                items = [x async for x in c]
            await c.commit()
    rollbacks = [x for x in items if isinstance(x, RollbackEvent)]
    assert rollbacks, "the client saw changes the server lost: it must be told"
    for r in rollbacks:
        assert r.rollback_seqno < r.seqno
    assert not any(
        isinstance(x, SnapshotBatch) and any(e.key.startswith(b"m") for e in x) for x in items
    ), "lost changes are not streamed again"


async def test_small_window_and_a_backfill_bigger_than_it_do_not_stall(tmp_path):
    async with running_server(tmp_path / "d") as server:
        async with kv(server) as k:
            await k.set_many({f"big{i}": b"x" * 300 for i in range(3000)})
            await server.flush_all()
        async with client(server, to_latest=True, buffer_size=16 * 1024) as c:
            with trio.fail_after(30):
                n = sum([len(b) async for b in c])
            assert c.statistics()["buffer_acks"] > 10
    assert n == 3000


async def test_server_noops_are_answered_and_keep_the_connection(tmp_path):
    async with running_server(tmp_path / "d") as server:
        async with kv(server) as k:
            await k.set("a", b"1")
        async with client(server, noop_interval=0.2) as c:
            await c.getone()
            await trio.sleep(1.2)
            stats = c.statistics()
    assert stats["noops"] >= 3 and stats["connects"] == 1 and stats["reconnects"] == 0


async def test_an_idle_vbucket_whose_last_tombstone_was_purged_is_delivered_at_once(tmp_path):
    """The disk snapshot's end seqno has no item (the tombstone was purged): the server
    says the snapshot is complete (SEQNO_ADVANCED) instead of leaving the SDK waiting for
    the vbucket's next change."""
    async with running_server(
        tmp_path / "d", tombstone_purge_age=0.0, checkpoint_retain_seconds=0
    ) as server:
        async with kv(server) as k:
            await k.set_many({f"k{i}": b"v" for i in range(40)})
            await k.delete("k3")
        vb = codec.vbucket_for_key(b"k3", NUM_VB)
        high = server.bucket.vbucket(vb).high_seqno
        await server.flush_all()
        server.bucket.vbucket(vb).checkpoints.create_checkpoint()
        await server.flush_all()
        await trio.sleep(0.01)
        assert await server.persistence.compact_now() == 1
        async with client(server, vbuckets=[vb]) as c:  # open-ended: no STREAM_END
            with trio.fail_after(5):
                batch = await c.__anext__()
        assert batch.end == high and batch.is_disk
        assert b"k3" not in {e.key for e in batch}
        assert len(batch.events) == high - 2  # every other write of the vbucket
