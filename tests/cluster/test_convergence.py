"""An active and its ``--replica-of`` replica converge under write load (1024 vbuckets),
and an SDK consumer of the replica sees what a consumer of the active sees.

Rules of this module: real processes on loopback (``nodes.py``); the load is seeded and
bounded; every comparison is exact (``nodes.assert_same``).
"""

from __future__ import annotations

import random

import pytest
import trio

from dcp.consumer import DcpClient, MemoryOffsetStore, RollbackEvent

from .conftest import Cluster
from .nodes import HOST, Load, VbDump, assert_same, compare_dumps, row, until, wait_caught_up

SEED = 14


async def test_1024_vbuckets_converge_under_write_load_items_and_failover_logs(
    cluster: Cluster,
) -> None:
    a = await cluster.node("a", 1024).start()
    b = await cluster.node("b", 1024, ["--replica-of", a.address]).start()
    load = Load(random.Random(SEED), keys=3000)
    # the replica follows while the writer runs: two writers, so the load is not one
    # pipelined stream the replica could take in a few snapshots
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load.run, a.port, 15_000, 1024)
        nursery.start_soon(Load(random.Random(SEED + 1), 2000, "j").run, a.port, 15_000, 1024)
    high = await wait_caught_up(a, b)
    assert sum(high.values()) == 30_000  # every acknowledged write is one seqno
    st = await b.stats("replication")
    assert st[f"source:{a.address}:connected"] == "true"
    assert {st[f"vb_{vb}:state"] for vb in range(1024)} == {"replica"}
    assert all(st[f"vb_{vb}:lag"] == "0" for vb in range(1024))
    assert await assert_same(a, b) > 4000
    cluster.assert_no_crash()


async def _consume(port: int, vbuckets: list[int], **kw: object) -> tuple[dict[int, VbDump], dict]:
    """Stream ``vbuckets`` to their high seqnos; what arrived, and the committed offsets."""
    out: dict[int, VbDump] = {}
    store = MemoryOffsetStore()
    with trio.fail_after(60):
        async with DcpClient(
            HOST,
            port,
            vbuckets=vbuckets,
            to_latest=True,
            offset_store=store,
            include_delete_times=True,
            **kw,  # type: ignore[arg-type]
        ) as client:
            async for batch in client:
                assert not isinstance(batch, RollbackEvent), batch
                d = out.setdefault(batch.vbucket, VbDump())
                d.snapshots.append((batch.start, batch.end))
                d.items.extend(row(e) for e in batch)
                await batch.commit()
    return out, store.offsets


async def test_sdk_consumer_of_the_replica_sees_the_snapshots_and_items_of_the_active(
    cluster: Cluster,
) -> None:
    # Checkpoints are not retained past their use, so a stream from 0 is a disk backfill on
    # both nodes: what each has persisted, snapshot for snapshot. No history window: with
    # one, each disk also keeps superseded versions, and the replica keeps more of them
    # than the active (it persists every snapshot it was sent, where the active's open
    # checkpoint had already deduplicated some), so only the newest versions would match.
    args = ["--checkpoint-retain-seconds", "0", "--history-seconds", "0", "--history-bytes", "0"]
    a = await cluster.node("a", 16, args).start()
    b = await cluster.node("b", 16, [*args, "--replica-of", a.address]).start()
    rng = random.Random(SEED)
    await Load(rng, keys=400).run(a.port, 4000, 16, batch=50)
    await wait_caught_up(a, b)
    await until(b.persisted, "the replica to persist")
    vbs = list(range(16))
    from_a, offsets_a = await _consume(a.port, vbs)
    from_b, offsets_b = await _consume(b.port, vbs)
    assert sorted(from_a) == vbs
    for vb in vbs:
        assert from_b[vb].snapshots == from_a[vb].snapshots, vb
        assert from_b[vb].items == from_a[vb].items, vb
    assert offsets_b == offsets_a  # same positions, same uuids and failover logs

    # A consumer that followed the active resumes on the replica with its committed
    # offsets (a client failing over to the standby): no rollback, and from there the
    # same snapshots and items as from the active.
    await Load(rng, keys=400, prefix="later").run(a.port, 1000, 16, batch=50)
    await wait_caught_up(a, b)
    await until(b.persisted, "the replica to persist")
    next_a, _ = await _consume(a.port, vbs, offsets=offsets_a)
    next_b, _ = await _consume(b.port, vbs, offsets=offsets_a)
    assert next_b.keys() == next_a.keys() and next_a
    for vb in next_a:
        assert next_b[vb].snapshots == next_a[vb].snapshots, vb
        assert next_b[vb].items == next_a[vb].items, vb
        assert all(r[2] > offsets_a[vb].seqno for r in next_b[vb].items)
    cluster.assert_no_crash()


def test_the_item_check_tells_any_field_or_a_missing_version_apart() -> None:
    """The convergence check is not vacuous: one changed field, a missing key, a missing
    tombstone or a stream that stops short each fail it."""
    m = ("mutation", b"k", 3, 2, 0x1234, 7, 0, 1, b'{"a":1}', None)
    d = ("deletion", b"j", 4, 5, 0x1240, None, None, 0, b"", 99)
    old = ("mutation", b"k", 1, 1, 0x1200, 0, 0, 0, b"x", None)

    def dumps(*rows):
        return {0: VbDump([(1, 4)], list(rows))}

    assert compare_dumps(dumps(old, m, d), dumps(m, d), {0: 4}, [0]) == 2
    for i in range(2, 10):  # every field but kind and key
        changed = (*m[:i], (m[i] or 0) + 1 if isinstance(m[i], int) else b"y", *m[i + 1 :])
        with pytest.raises(AssertionError, match="newest items differ"):
            compare_dumps(dumps(m, d), dumps(changed, d), {0: 4}, [0])
    with pytest.raises(AssertionError, match=r"only on the first node \[b'j'\]"):
        compare_dumps(dumps(m, d), dumps(m), {0: 4}, [0])
    with pytest.raises(AssertionError, match="streamed up to 3, high seqno 4"):
        compare_dumps(dumps(m), dumps(m), {0: 4}, [0])
