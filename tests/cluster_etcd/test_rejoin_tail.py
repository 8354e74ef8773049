"""A failed-over node comes back as a replica of its old vbuckets and rolls back the tail
it acknowledged but never replicated.

How the tail is made, deterministically: the vbucket's only replica R is frozen
(SIGSTOP) while its active V takes 40 writes of 1 MB. V's replication stream to R stops
at R's flow-control window (16 MB, dcp/producer/replication/link.py) plus the socket
buffers, so most of those writes exist on V alone. V is then frozen too and R woken: V's
lease lapses, it is failed over, R is promoted without the tail. When V wakes it has
fenced itself, registers again, finds itself out of the map, and the rebalance gives it
copies again, preferring the vbuckets it held: as a replica of R it must roll the tail
back (its copy ends identical to R's: same high seqno, same failover log).

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``);
lease TTL 2 s, auto-failover after 4 s; R is frozen for well under its lease, so only V
is ever down; every wait bounded.
"""

from __future__ import annotations

import pytest

from dcp.consumer import KvClient
from dcp.protocol.layout import vbucket_for_key

from .harness import EtcdCluster, until
from .traffic import HOST, keys_for, read_all

NAMES = ["n1", "n2", "n3"]
VALUE = b"t" * (1024 * 1024)
TAIL = 40  # x 1 MB: well past the 16 MB flow-control window

pytestmark = pytest.mark.slow


async def test_a_failed_over_node_rolls_back_its_unreplicated_tail_when_it_rejoins(
    etcd_cluster: EtcdCluster,
) -> None:
    c = etcd_cluster
    await c.start(*NAMES)
    vbmap, _ = await c.wait_settled(NAMES, timeout=60)
    status = await until(c.status, "the orchestrator's status", 10)
    victim = next(n for n in NAMES if n != status["orchestrator"])
    vb = next(v for v in range(c.num_vbuckets) if vbmap.active(v) == victim)
    (replica,) = vbmap.replicas(vb)
    keys = [
        k
        for k in keys_for(20 * c.num_vbuckets * TAIL, "tail")
        if vbucket_for_key(k, c.num_vbuckets) == vb
    ][:TAIL]
    assert len(keys) == TAIL

    async with KvClient(HOST, c.port_of(victim), num_vbuckets=c.num_vbuckets, timeout=10) as kv:
        c.pause(replica)
        try:
            await kv.set_many({k: VALUE for k in keys})  # acknowledged by the victim alone
        finally:
            c.pause(victim)
            c.resume(replica)

    async def failed_over() -> bool:
        m, _ = await c.read_map()
        return m is not None and victim not in m.names(vb) and m.active(vb) == replica

    await until(failed_over, f"{victim} failed over", c.failover_timeout + 15)
    kept = await read_all(c, keys)
    tail = [k for k in keys if kept[k] is None]
    assert tail, "every write reached the replica: no tail was made (the test's premise)"

    c.resume(victim)
    vbmap, _ = await c.wait_settled(NAMES, timeout=90)
    assert victim in vbmap.names(vb), f"{victim} was not given its old vb {vb} back"

    async def converged() -> bool:
        m, _ = await c.read_map()
        return m is not None and not await c.copies_differ(m)

    await until(converged, "every copy identical to its active", 60)
    # the victim's copy is the promoted one's: the tail is gone from the cluster for good
    after = await read_all(c, keys)
    assert [k for k in keys if after[k] is None] == tail
    c.assert_no_crash()
