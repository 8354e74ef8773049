"""A ``KvClient`` bootstrapped with one node's address writes through a rebalance: a third
node joins, the orchestrator moves vbuckets onto it, and the client follows the map by
itself (NOT_MY_VBUCKET carrying the new config, ETMPFAIL during takeovers). No write may
fail and every acknowledged write must be read back.

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``);
the load loop is bounded by an event and a count, every wait by a deadline.
"""

from __future__ import annotations

import pytest
import trio

from dcp.consumer import BatchWriteError, KvClient, MutationResult

from .harness import EtcdCluster, until
from .traffic import HOST, keys_for, value_of

pytestmark = pytest.mark.slow

BATCH = 16


class Load:
    """Pipelined batches over ``keys``, each key's versions written in order; per key the
    last acknowledged version and those sent after it without an answer."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.acked: dict[bytes, int] = {}
        self.unacked: dict[bytes, set[int]] = {k: set() for k in keys}
        self.batches = 0
        self.failures: list[str] = []

    async def run(self, kv: KvClient, stop: trio.Event, max_batches: int = 100_000) -> None:
        version = 0
        while not stop.is_set() and self.batches < max_batches:
            for i in range(0, len(self.keys), BATCH):
                chunk = self.keys[i : i + BATCH]
                for k in chunk:
                    self.unacked[k].add(version)
                try:
                    results: list[MutationResult | BaseException] = list(
                        await kv.set_many({k: value_of(k, version) for k in chunk})
                    )
                except BatchWriteError as exc:
                    results = exc.results
                for k, r in zip(chunk, results, strict=True):
                    if isinstance(r, BaseException):
                        self.failures.append(f"{k!r} v{version}: {r!r}")
                    else:
                        self.acked[k] = version
                        self.unacked[k] = set()
                self.batches += 1
            version += 1

    def lost(self, found: dict[bytes, bytes]) -> list[str]:
        out = []
        for k, v in self.acked.items():
            allowed = {value_of(k, x) for x in {v, *self.unacked[k]}}
            if found.get(k) not in allowed:
                out.append(f"{k!r}: acked v{v}, read {found.get(k)!r}")
        return out


async def test_a_client_bootstrapped_with_one_node_writes_through_a_rebalance(
    etcd_cluster: EtcdCluster,
) -> None:
    c = etcd_cluster
    await c.start("n1", "n2")
    before, _ = await c.wait_settled(["n1", "n2"], timeout=60)
    load = Load(keys_for(96, "kvrb"))
    stop = trio.Event()
    async with KvClient(HOST, c.port_of("n1"), timeout=10) as kv:
        assert kv.num_vbuckets == c.num_vbuckets  # from the node's config
        assert kv.config is not None and len(kv.config.servers) == 2
        rev_seen = kv.config.rev
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run, kv, stop)
            await until(lambda: load.batches >= 30, "the load to start", 20)
            await c.start("n3")
            at_join = load.batches
            after, _ = await c.wait_settled(["n1", "n2", "n3"], timeout=60)
            during = load.batches - at_join
            settled_at = load.batches
            await until(lambda: load.batches >= settled_at + 30, "writes after the moves", 20)
            stop.set()
        assert kv.config.rev > rev_seen and len(kv.config.servers) == 3  # it followed
    moved = [vb for vb in range(c.num_vbuckets) if before.active(vb) != after.active(vb)]
    assert moved, "the rebalance moved no active vbucket (the test's premise)"
    assert during > 0, "no batch was acknowledged while the vbuckets moved"
    assert load.failures == [], load.failures[:5]

    async with KvClient(f"{HOST}:{c.port_of('n3')}", timeout=10) as reader:
        got = await reader.get_many(load.keys, missing_ok=False)
    found = {k: g.value for k, g in got.items()}
    assert len(load.acked) == len(load.keys)
    assert load.lost(found) == []
    c.assert_no_crash()
