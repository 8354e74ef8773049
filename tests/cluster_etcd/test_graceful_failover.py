"""A graceful failover on a real etcd: a live node's active vbuckets are handed over to
their replicas by takeover streams, then it leaves every chain; nothing is lost.

The takeover stream for a vbucket is requested on the replication connection that
already carries that vbucket's replica stream (the new active was replicating it from
the old one): the replica stream must be closed at the source before the takeover
stream is asked for, or the source refuses it (KEY_EEXISTS) and the hand-over stalls.

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``,
``traffic.py``); every wait bounded.
"""

from __future__ import annotations

import json
import uuid

import pytest
import trio

from .harness import EtcdCluster, until
from .traffic import Router, Writer, keys_for, read_all

NAMES = ["n1", "n2", "n3"]

pytestmark = pytest.mark.slow


async def test_a_graceful_failover_hands_every_active_over_and_empties_the_node(
    etcd_cluster: EtcdCluster,
) -> None:
    c = etcd_cluster
    c.num_vbuckets = 64
    await c.start(*NAMES)
    await c.wait_settled(NAMES, timeout=60)
    victim = "n1"
    router = Router(c)
    await router.refresh()
    keys = keys_for(400, "gf")
    stop = trio.Event()
    async with Writer(c, router) as writer, trio.open_nursery() as nursery:
        nursery.start_soon(writer.run, keys, stop)
        await until(lambda: writer.acked >= 200, "the load to start", 30)

        rid = uuid.uuid4().hex
        request = json.dumps({"id": rid, "node": victim, "graceful": True}).encode()
        assert await c.store.compare_and_put(c.key("requests/failover"), request, mod_revision=0)

        async def outcome() -> dict | None:
            st = await c.status()
            fo = st["failover"] if st else None
            return fo if fo and fo["id"] == rid and fo["state"] != "running" else None

        took = trio.current_time()
        result = await until(outcome, "the graceful failover's outcome", 60)
        took = trio.current_time() - took
        assert result["state"] == "done", result
        assert took < 30, f"a graceful failover of 64 vbuckets took {took:.1f} s"
        vbmap, _ = await c.read_map()
        assert vbmap is not None and vbmap.forward is None
        assert victim not in vbmap.servers
        for vb in range(c.num_vbuckets):
            assert victim not in vbmap.names(vb), vb
            assert vbmap.active(vb) is not None, vb
        rest = [n for n in NAMES if n != victim]
        # every vbucket has exactly one active copy, where the map says
        states = {n: await c.replication(n) for n in NAMES}
        for vb in range(c.num_vbuckets):
            actives = [n for n in NAMES if states[n].get(vb, {}).get("state") == "active"]
            assert actives == [vbmap.active(vb)], (vb, actives)
        assert all(s.get("state") != "active" for s in states[victim].values())
        await router.refresh()
        acked = writer.acked
        await until(lambda: writer.acked >= acked + 100, "writes to go on after it", 30)
        stop.set()
    assert writer.lost(await read_all(c, list(writer.log))) == []
    logs = [line for n in rest for line in c.nodes[n].log_text().splitlines()]
    refused = [line for line in logs if "KEY_EEXISTS" in line]
    assert refused == [], refused[:3]
    c.assert_no_crash()
