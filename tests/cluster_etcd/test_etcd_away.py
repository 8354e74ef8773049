"""etcd killed and restarted under load: the data path does not depend on it.

A short outage (well inside the lease) is invisible to clients: writes keep being
acknowledged and streams keep delivering throughout. A long one (past the lease) makes
every node fence itself, as it must when it can no longer prove it holds its lease: no
write is acknowledged then, and no failover follows either, since no orchestrator can act
without etcd. When etcd is back the same leases are renewed, the nodes take writes again
and the map is the one from before (no failover, no rebalance), with nothing lost.

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``,
``traffic.py``); lease TTL 10 s here (fence margin 2 s, keepalive every 3.3 s) so the
short outage fits well inside it; every wait bounded.
"""

from __future__ import annotations

import pytest
import trio

from .harness import EtcdCluster, until
from .traffic import Follower, Router, Writer, keys_for, read_all

NAMES = ["n1", "n2", "n3"]
WRITERS = 3
TTL = 10

pytestmark = pytest.mark.slow


async def test_writes_and_streams_ride_out_etcd_restarts_without_failover(
    etcd_cluster: EtcdCluster,
) -> None:
    c = etcd_cluster
    c.lease_ttl = TTL
    c.failover_timeout = TTL + 4  # it must exceed the lease TTL (config.py)
    await c.start(*NAMES)
    vbmap, rev = await c.wait_settled(NAMES, timeout=60)
    router = Router(c)
    await router.refresh()
    keys = keys_for(600, "ea")
    stop_writes, stop_streams = trio.Event(), trio.Event()
    follower = Follower(c, router)
    async with Writer(c, router, give_up=60) as writer, trio.open_nursery() as nursery:
        nursery.start_soon(follower.run, stop_streams)
        for i in range(WRITERS):
            nursery.start_soon(writer.run, keys[i::WRITERS], stop_writes)
        await until(lambda: writer.acked >= 300, "the load to start", 30)

        # a short outage: nothing a client can see
        c.etcd_down()
        acked, slowest = writer.acked, writer.slowest
        received = sum(st.high for st in follower.vbs.values())
        await trio.sleep(1.5)
        assert writer.acked > acked + 100, "writes stalled while etcd was away"
        assert sum(st.high for st in follower.vbs.values()) > received, "streams stalled"
        await c.etcd_up()
        acked = writer.acked
        await until(lambda: writer.acked >= acked + 100, "writes after etcd returned", 10)
        assert writer.slowest < max(slowest, 1.0) + 1.0, f"a write took {writer.slowest:.1f} s"

        # a long outage: every node fences itself (no acknowledged write past its lease)
        c.etcd_down()
        await trio.sleep(TTL + 0.5)
        acked = writer.acked
        await trio.sleep(2)
        assert writer.acked == acked, "a write was acknowledged after every lease had lapsed"
        await c.etcd_up()
        await until(lambda: writer.acked >= acked + 200, "writes after etcd returned", 30)
        stop_writes.set()
        await until(follower.caught_up, "the streams to catch up", 60)
        stop_streams.set()

    after, rev_after = await c.wait_settled(NAMES, timeout=30)
    assert (after, rev_after) == (vbmap, rev)  # the same map: no failover, no rebalance
    assert await c.failed_over_count() == 0
    assert await c.live() == set(NAMES)
    found = await read_all(c, keys)
    assert writer.lost(found) == []
    assert follower.problems() == []
    streamed = {k: v for st in follower.vbs.values() for k, v in st.values.items()}
    differ = [k for k in keys if k in found and streamed.get(k) != found[k]]
    assert differ == [], f"streams ended with other values than the cluster: {differ[:5]}"
    c.assert_no_crash()
