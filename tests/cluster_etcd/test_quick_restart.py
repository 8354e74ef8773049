"""kill -9 of an active node and an immediate restart (systemd), before anyone saw it down:
no MAJORITY write it answered is lost (cluster/rejoin.py).

The writes are held in memory by the victim and its two replicas, and the victim's flush
interval (20 s) keeps them off its disk. Restarted at once, its warm-up starts a new
branch at its last persisted point; had it rejoined at once, the map (unchanged) would
still name it active and its replicas would roll back to that point: every write lost
(40 of 40 before the fix). It must instead wait unregistered until it is failed over,
then come back through the rebalance. ~10 s.
"""

from __future__ import annotations

import re

import pytest
import trio

from dcp.consumer import KeyNotFound, KvClient
from dcp.protocol.layout import vbucket_for_key

from .conftest import etcd_cluster, etcd_factory  # noqa: F401
from .harness import EtcdCluster

pytestmark = pytest.mark.slow

NAMES = ["n1", "n2", "n3"]


async def test_a_quick_restart_waits_to_be_failed_over_and_keeps_majority_writes(
    etcd_cluster: EtcdCluster,  # noqa: F811
) -> None:
    c = etcd_cluster
    base = c.node_args
    victim = "n2"

    def args(name: str) -> list[str]:
        slow = ["--flush-interval", "20"] if name == victim else []
        return [*base(name), "--num-replicas", "2", *slow]

    c.node_args = args  # type: ignore[method-assign]
    await c.start(*NAMES)
    vbmap, _ = await c.wait_settled(NAMES, timeout=45)
    bootstrap = ",".join(c.address(n) for n in NAMES)
    candidates = (f"q-{i}".encode() for i in range(2000))
    keys = [k for k in candidates if vbmap.active(vbucket_for_key(k, c.num_vbuckets)) == victim]
    keys = keys[:40]
    assert len(keys) == 40
    async with KvClient(bootstrap, timeout=45) as kv:
        for k in keys:
            await kv.set(k, b"v-" + k, durability="majority")  # SUCCESS: a majority holds it
        c.kill(victim)
        await c.start(victim)  # at once: its lease has not even lapsed
        with trio.fail_after(40):  # registered again: failed over first (or not: the bug)
            while victim not in await c.live():
                await trio.sleep(0.1)
        await c.wait_settled(NAMES, timeout=45)
        lost = []
        for k in keys:
            try:
                got: bytes | None = (await kv.get(k)).value
            except KeyNotFound:
                got = None
            if got != b"v-" + k:
                lost.append((k, got))
    assert not lost, f"{len(lost)} of 40 MAJORITY writes lost: {lost[:3]}"
    # it did not register while the map named it active: its old key lapsed and the
    # orchestrator failed it over, promoting a replica holding the writes; the automatic
    # rebalance then took it back
    assert await c.failed_over_count() == 1
    text = c.nodes[victim].log_text()
    assert re.search(r"restarted after an unclean shutdown and the map still names it", text)
    assert "was failed over after" in text and "rejoining anyway" not in text
    c.assert_no_crash()
