"""Three ``dcp-server --cluster`` nodes on a real etcd: the map the orchestrator writes is
balanced, the nodes hold what it says, and clients learn it from any node
(GET_CLUSTER_CONFIG, and the config carried by NOT_MY_VBUCKET), byte for byte the map in
etcd.

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``),
every wait bounded.
"""

from __future__ import annotations

import json

import pytest

from dcp.protocol import codec
from dcp.protocol.layout import vbucket_for_key
from dcp.protocol.opcodes import Opcode, Status
from tools.chaos.procs import RawClient

from .harness import EtcdCluster, expected_states, until

NAMES = ["n1", "n2", "n3"]

pytestmark = pytest.mark.slow


def key_in(vb: int, nvb: int) -> bytes:
    return next(k for i in range(100_000) if vbucket_for_key(k := f"p{i}".encode(), nvb) == vb)


async def test_three_nodes_settle_on_a_balanced_map_that_every_node_serves(
    etcd_cluster: EtcdCluster,
) -> None:
    c = etcd_cluster
    await c.start(*NAMES)
    vbmap, rev = await c.wait_settled(NAMES, timeout=60)
    assert sorted(vbmap.servers) == NAMES and vbmap.num_replicas == 1
    counts = vbmap.counts()
    assert sorted(a for a, _ in counts.values()) == [10, 11, 11]  # 32 actives on 3 nodes
    assert sorted(r for _, r in counts.values()) == [10, 11, 11]
    assert await c.live() == set(NAMES)
    status = await until(c.status, "the orchestrator's status", 10)
    assert status["orchestrator"] in NAMES and status["unavailable"] == []
    assert status["autofailover"]["count"] == 0

    addresses = [c.address(n) for n in vbmap.servers]
    for name in NAMES:

        async def current(name: str = name) -> dict | None:
            doc = await c.get_cluster_config(name)
            return doc if doc["rev"] == rev else None

        doc = await until(current, f"{name}'s config at revision {rev}", 15)
        smap = doc["vBucketServerMap"]
        assert smap["serverList"] == addresses
        assert smap["vBucketMap"] == [list(ch) for ch in vbmap.chains]
        assert smap["numReplicas"] == 1 and doc["numVBuckets"] == c.num_vbuckets
        assert "vBucketMapForward" not in smap
        me = [e for e in doc["nodesExt"] if e.get("thisNode")]
        assert [(e["nodeName"], e["services"]["kv"]) for e in me] == [(name, c.port_of(name))]

    # a GET sent to a node that is not the vbucket's active: NOT_MY_VBUCKET with the config
    name = "n1"
    states = expected_states(vbmap, name)
    for want in ("replica", "dead"):
        vb = next(vb for vb, s in states.items() if s == want)
        raw = await RawClient.connect(c.port_of(name))
        try:
            f = await raw.call(
                codec.request(Opcode.GET, vbucket=vb, opaque=9, key=key_in(vb, c.num_vbuckets)), 9
            )
        finally:
            await raw.aclose()
        assert f.status == Status.NOT_MY_VBUCKET, f"{want} vb {vb}: 0x{f.status:02x}"
        body = json.loads(bytes(f.value))
        assert body["rev"] == rev
        assert body["vBucketServerMap"]["vBucketMap"] == [list(ch) for ch in vbmap.chains]
    c.assert_no_crash()
