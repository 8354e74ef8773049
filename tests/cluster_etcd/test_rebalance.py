"""A fourth node joins a three-node cluster under write and stream load: the orchestrator
rebalances onto it by takeover moves while clients keep writing (routed by the map) and
DCP streams keep following their vbuckets; no acknowledged write is lost and no stream
sees a gap.

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``,
``traffic.py``), every load loop bounded by an event and every wait by a deadline.
"""

from __future__ import annotations

import pytest
import trio

from .harness import EtcdCluster, until
from .traffic import Follower, Router, Writer, keys_for, read_all

NAMES = ["n1", "n2", "n3"]
WRITERS = 4

pytestmark = pytest.mark.slow


async def test_a_fourth_node_is_rebalanced_in_under_load_without_losing_a_write(
    etcd_cluster: EtcdCluster,
) -> None:
    c = etcd_cluster
    await c.start(*NAMES)
    before, rev0 = await c.wait_settled(NAMES, timeout=60)
    router = Router(c)
    await router.refresh()
    keys = keys_for(800, "rb")
    stop_writes, stop_streams = trio.Event(), trio.Event()
    follower = Follower(c, router)
    async with Writer(c, router) as writer, trio.open_nursery() as nursery:
        nursery.start_soon(follower.run, stop_streams)
        for i in range(WRITERS):
            nursery.start_soon(writer.run, keys[i::WRITERS], stop_writes)
        await until(lambda: writer.acked >= 400, "the load to start", 30)

        await c.start("n4")
        acked_at_join = writer.acked
        after, rev1 = await c.wait_settled([*NAMES, "n4"], timeout=120)
        assert rev1 > rev0
        assert writer.acked > acked_at_join, "no write was acknowledged during the rebalance"
        moved = sum(1 for vb in range(c.num_vbuckets) if before.names(vb) != after.names(vb))
        assert moved >= 8  # n4 took its share: 8 actives and 8 replicas of 32
        acked_after = writer.acked
        await until(lambda: writer.acked >= acked_after + 200, "more writes", 30)
        stop_writes.set()
        # the streams reach every active's high seqno once the writes stopped
        await until(follower.caught_up, "the streams to catch up", 60)
        stop_streams.set()

    found = await read_all(c, keys)
    assert writer.lost(found) == []
    assert follower.problems() == []
    vbs = follower.vbs
    assert sum(st.rollbacks for st in vbs.values()) == 0  # takeovers lose nothing
    followed = [vb for vb, st in vbs.items() if len(set(st.nodes)) > 1]
    assert followed, "no stream had to follow its vbucket to another node"
    streamed = {k: v for st in vbs.values() for k, v in st.values.items()}
    differ = [k for k in keys if k in found and streamed.get(k) != found[k]]
    assert differ == [], f"streams ended with other values than the cluster: {differ[:5]}"
    assert await c.failed_over_count() == 0
    c.assert_no_crash()
