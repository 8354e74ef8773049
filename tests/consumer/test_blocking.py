"""Blocking facades: the same model from plain threads (the server runs in the test's trio)."""

from __future__ import annotations

import pytest
import trio

from dcp.consumer import (
    BlockingDcpClient,
    BlockingKvClient,
    ClientClosedError,
    MemoryOffsetStore,
    Mutation,
    RetryTimeoutError,
    RollbackEvent,
    SnapshotBatch,
)


async def test_blocking_client_iterates_and_commits(producer):
    for vb in range(3):
        producer.vb(vb).add_mutations(6, per_snapshot=3)
    store = MemoryOffsetStore()

    def app() -> list:
        got = []
        with BlockingDcpClient(
            "127.0.0.1", producer.port, to_latest=True, offset_store=store, noop_interval=None
        ) as client:
            for batch in client:
                assert isinstance(batch, SnapshotBatch)
                got.append((batch.vbucket, batch.end, len(batch)))
                assert batch.commit() is True
            assert client.commit() is False  # nothing new
        return got

    got = await trio.to_thread.run_sync(app)
    assert sorted(got) == [(vb, e, 3) for vb in range(3) for e in (3, 6)]
    assert {vb: o.seqno for vb, o in store.offsets.items()} == {0: 6, 1: 6, 2: 6}


async def test_blocking_client_raw_mode_and_rollbacks(producer):
    producer.vb(0).add_mutations(2, per_snapshot=2)
    producer.script(0, ("rollback", 0))

    def app() -> list:
        with BlockingDcpClient(
            "127.0.0.1", producer.port, vbuckets=[0], raw=True, to_latest=True, noop_interval=None
        ) as client:
            return [type(e).__name__ for e in client]

    got = await trio.to_thread.run_sync(app)
    assert got == ["RollbackEvent", "SnapshotMarker", "Mutation", "Mutation", "StreamEnd"]
    assert RollbackEvent and Mutation  # names above are these classes


async def test_blocking_client_errors_reach_the_calling_thread():
    def app() -> None:
        async def refuse() -> trio.abc.Stream:
            raise OSError("refused")

        with BlockingDcpClient(connector=refuse, vbuckets=[0], retry_timeout=0.3) as client:
            with pytest.raises(RetryTimeoutError):
                client.getone()
        with pytest.raises(ClientClosedError):
            client.getone()

    await trio.to_thread.run_sync(app)


async def test_blocking_kv_client(producer):
    for vb in range(1024):
        producer.vb(vb)

    def app() -> tuple:
        with BlockingKvClient("127.0.0.1", producer.port) as kv:
            r = kv.set("hello", b"world")
            rs = kv.set_many([("a", b"1"), ("b", b"2")])
            return r, rs, kv.get("hello").value

    r, rs, value = await trio.to_thread.run_sync(app)
    assert r.vbucket == 528 and value == b"world" and len(rs) == 2
