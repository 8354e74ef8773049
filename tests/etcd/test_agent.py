"""ClusterAgent against a real etcd: in-process nodes join one cluster, follow a map the
test writes (no orchestrator runs), replicate, answer with the config, and refuse a
clashing name.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from dcp.producer.cluster.election import map_key
from dcp.producer.cluster.membership import JoinRefused, NodeRecord
from dcp.producer.cluster.store import EtcdStore
from dcp.producer.replication.target import Assignment
from dcp.producer.server import DcpServer
from dcp.protocol import Opcode, Status, codec
from dcp.protocol.opcodes import VBucketState
from tests.producer.conftest import client_of
from tests.producer.wire import keys_for_vb

from .agent_support import NVB, address, node, states, until, write_map
from .conftest import EtcdProcess, free_port

A, R, D = VBucketState.ACTIVE, VBucketState.REPLICA, VBucketState.DEAD


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def _fill(server: DcpServer, vb: int, n: int, prefix: str = "k") -> None:
    async with client_of(server) as c:
        await c.set_many([(k, b"v-" + k) for k in keys_for_vb(vb, n, NVB, prefix)])


async def test_three_nodes_follow_the_map_replicate_and_answer_with_it(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    async with (
        node(tmp_path, ep, cluster_name, "n1") as n1,
        node(tmp_path, ep, cluster_name, "n2") as n2,
        node(tmp_path, ep, cluster_name, "n3") as n3,
    ):
        # no map yet: nothing changes, and no node takes a write
        assert states(n1) == [A] * NVB
        async with client_of(n1) as c:
            r = await c.store(Opcode.SET, b"early", b"v")
            assert r.status == Status.ETMPFAIL
            r = await c.call(codec.request(Opcode.GET_CLUSTER_CONFIG, opaque=3), 3)
            assert r.status == Status.ETMPFAIL  # no map to give yet
        chains = [["n1", "n2"], ["n2", "n3"], ["n3", "n1"], ["n1", "n3"]]
        rev = await write_map(ep, cluster_name, chains)
        want = {n1: [A, D, R, A], n2: [R, A, D, D], n3: [D, R, A, R]}
        await until(lambda: all(states(n) == s for n, s in want.items()), "states")
        assert n2.vbucket_states.assignment(0) == Assignment(R, address(n1))
        assert n1.vbucket_states.assignment(2) == Assignment(R, address(n3))
        assert n3.vbucket_states.assignment(3) == Assignment(R, address(n1))
        for server, vb in ((n1, 0), (n2, 1), (n3, 2), (n1, 3)):
            await _fill(server, vb, 20)
        replicas = {0: n2, 1: n3, 2: n1, 3: n3}
        await until(
            lambda: all(replicas[vb].bucket.vbucket(vb).high_seqno == 20 for vb in range(NVB)),
            "replicated",
        )
        # GET_ALL_VB_SEQNOS of n3's replicas (state filter 2): vb 1 and vb 3 at 20
        async with client_of(n3) as c:
            req = codec.request(Opcode.GET_ALL_VB_SEQNOS, opaque=5, extras=struct.pack(">I", 2))
            r = await c.call(req, 5)
            assert bytes(r.value) == struct.pack(">HQHQ", 1, 20, 3, 20)
            # a key of vb 0 asked of n3 (which holds no copy): NOT_MY_VBUCKET + the config
            key = keys_for_vb(0, 1, NVB)[0]
            r = await c.get(key)
            assert r.status == Status.NOT_MY_VBUCKET and r.datatype == 1
            doc = json.loads(bytes(r.value))
            r = await c.call(codec.request(Opcode.GET_CLUSTER_CONFIG, opaque=6), 6)
            assert r.status == Status.SUCCESS and json.loads(bytes(r.value)) == doc
            stats = await c.stats("cluster")
        servers = [address(n1), address(n2), address(n3)]
        assert doc["rev"] == rev
        assert doc["vBucketServerMap"]["serverList"] == servers
        assert doc["vBucketServerMap"]["vBucketMap"] == [[0, 1], [1, 2], [2, 0], [0, 2]]
        assert [e.get("thisNode", False) for e in doc["nodesExt"]] == [False, False, True]
        assert (stats["node_name"], stats["map_rev"], stats["fenced"]) == ("n3", str(rev), "false")
        assert (stats["writes_allowed"], stats["map_active"], stats["map_replica"]) == (
            "true",
            "1",
            "2",
        )
        assert stats["orchestrator"] == "false" and stats["live_nodes"] == "3"


async def test_forward_chain_feeds_the_new_node_and_a_handed_over_active_stays_dead(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    async with (
        node(tmp_path, ep, cluster_name, "n1") as n1,
        node(tmp_path, ep, cluster_name, "n2") as n2,
        node(tmp_path, ep, cluster_name, "n3") as n3,
    ):
        chains = [["n1", "n2"], ["n2", "n1"], ["n1", "n2"], ["n2", "n1"]]
        await write_map(ep, cluster_name, chains)
        await until(lambda: states(n3) == [D] * NVB and states(n1) == [A, R, A, R], "first map")
        async with client_of(n3) as c:  # n3 is not in the map: it takes no write
            assert (await c.store(Opcode.ADD, b"x", b"v")).status == Status.ETMPFAIL
        await _fill(n1, 0, 10)
        # vb 0 moves from [n1, n2] to [n3, n2]: n3 builds a copy from the active, n1
        forward = [["n3", "n2"], *chains[1:]]
        await write_map(ep, cluster_name, chains, forward=forward, servers=["n1", "n2", "n3"])
        await until(lambda: n3.vbucket_states.assignment(0) == Assignment(R, address(n1)), "fed")
        await until(lambda: n3.bucket.vbucket(0).high_seqno == 10, "n3 caught up")
        assert states(n1)[0] == A and n2.vbucket_states.assignment(0) == Assignment(R, address(n1))
        # the orchestrator's takeover: n3 streams vb 0 from n1 with TAKEOVER
        n3.vbucket_states.set(0, R, {"source": address(n1), "takeover": True})
        await until(lambda: states(n3)[0] == A and states(n1)[0] == D, "taken over")
        # the same forward map again (a new revision): n1 keeps its handed-over copy dead
        rev = await write_map(ep, cluster_name, chains, forward=forward, servers=["n1", "n2", "n3"])
        await until(lambda: n1.cluster.agent.revision == rev, "n1 read it")
        await until(lambda: n3.cluster.agent.revision == rev, "n3 read it")
        assert states(n1)[0] == D and states(n3)[0] == A
        # the move is finished: chain = forward
        rev = await write_map(ep, cluster_name, forward, servers=["n1", "n2", "n3"])
        await until(lambda: n2.vbucket_states.assignment(0) == Assignment(R, address(n3)), "n2")
        assert states(n1)[0] == D and states(n3)[0] == A
        await _fill(n3, 0, 5, prefix="after")
        await until(lambda: n2.bucket.vbucket(0).high_seqno == 15, "n2 follows n3")
        await until(lambda: n1.cluster.agent.revision == rev, "n1 read the final map")
        async with client_of(n1) as c:  # the old active points clients at the new map
            r = await c.store(Opcode.SET, keys_for_vb(0, 1, NVB)[0], b"late")
            assert r.status == Status.NOT_MY_VBUCKET
            doc = json.loads(bytes(r.value))
        assert doc["rev"] == rev
        assert doc["vBucketServerMap"]["vBucketMap"][0] == [2, 1]


async def test_a_clashing_node_name_refuses_to_start(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    async with node(tmp_path, ep, cluster_name, "n1") as n1:
        with pytest.raises(BaseException) as caught:
            async with node(tmp_path / "other", ep, cluster_name, "n1"):
                pass
        leaf = _leaf(caught.value)
        assert isinstance(leaf, JoinRefused), leaf
        assert "held by a live node" in str(leaf) and address(n1) in str(leaf)
        # the same through dcp-server: one line, exit 2
        args = ["--port", "0", "--data-dir", str(tmp_path / "cli"), "--num-vbuckets", str(NVB)]
        args += ["--cluster", ep, "--cluster-name", cluster_name, "--node-name", "n1"]
        r = await trio.to_thread.run_sync(_run_server, args)
        assert r.returncode == 2, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.startswith("dcp-server:")]
        assert len(lines) == 1 and "refusing to join cluster" in lines[0], r.stderr
        assert "held by a live node" in lines[0] and "Traceback" not in r.stderr
        assert states(n1) == [A] * NVB  # the running node noticed nothing


async def test_etcd_not_answering_at_start_is_one_line_exit_2(tmp_path: Path) -> None:
    args = ["--port", "0", "--data-dir", str(tmp_path), "--node-name", "n1"]
    args += ["--cluster", f"http://127.0.0.1:{free_port()}"]
    r = await trio.to_thread.run_sync(_run_server, args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("dcp-server:")]
    assert len(lines) == 1 and "refusing to join cluster" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def _run_server(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dcp.producer", *args], capture_output=True, text=True, timeout=60
    )


async def test_malformed_records_and_maps_in_etcd_are_ignored_not_fatal(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    prefix = f"/dcp/{cluster_name}/"
    async with node(tmp_path, ep, cluster_name, "n1") as n1:
        agent = n1.cluster.agent
        assert agent is not None
        store = EtcdStore(ep)
        try:
            await store.put(prefix + "members/junk", b"not json")
            evil = NodeRecord("evil", "nohost", "u", NVB, "c")  # an address that is no address
            await store.put(prefix + "members/evil", evil.to_json())
            rev = await write_map(ep, cluster_name, [["n1", "evil"]] * NVB)
            await until(lambda: agent.revision == rev, "map read")
            assert states(n1) == [A] * NVB and "evil" not in agent.addresses
            await store.put(map_key(cluster_name), b'{"numVBuckets": 4}')  # not a map
            await store.put(prefix + "map", b"]")
            await trio.sleep(0.3)
        finally:
            await store.aclose()
        assert agent.revision == rev  # the last good map stays in force
        async with client_of(n1) as c:  # the node still serves
            await c.set(keys_for_vb(1, 1, NVB)[0], b"v")
