"""KvClient against a cluster: bootstrap lists, routing by the map, following the map.

Rules of this module: fake nodes on loopback (``kv_cluster_fake.py``) whose map the test
writes; in-process ``DcpServer``s for the single-server behaviour.
"""

from __future__ import annotations

import json

import pytest
import trio

from dcp.consumer import KvClient, UsageError
from dcp.consumer.kv_connection import KvConnection
from dcp.producer import server as server_mod
from dcp.protocol.layout import vbucket_for_key
from dcp.protocol.opcodes import Opcode

from .kv_cluster_fake import HOST, FakeNode, config_json, fake_cluster, serve_map

NVB = 8
SPLIT = [vb % 2 for vb in range(NVB)]  # even vbuckets on n1, odd on n2


def key_in(vb: int, prefix: str = "k") -> bytes:
    i = 0
    while vbucket_for_key(f"{prefix}{i}".encode(), NVB) != vb:
        i += 1
    return f"{prefix}{i}".encode()


def sent_where(nodes: list[FakeNode], opcode: int) -> dict[str, set[int]]:
    return {n.name: {vb for op, vb, _ in n.received if op == opcode} for n in nodes}


@pytest.fixture
def roundtrips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every pipelined roundtrip of SETs (one ``send_all`` each) the client
    makes (HELLO and config requests left out)."""
    sizes: list[int] = []
    real = KvConnection.send_batch

    async def counted(self: KvConnection, ops: list) -> object:
        if ops[0].opcode == Opcode.SET:
            sizes.append(len(ops))
        return await real(self, ops)

    monkeypatch.setattr(KvConnection, "send_batch", counted)
    return sizes


async def test_a_batch_goes_to_each_vbuckets_active_in_one_roundtrip_per_node(
    nursery: trio.Nursery, roundtrips: list[int]
) -> None:
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 5, SPLIT)
    hosts = [(HOST, n.port) for n in nodes]
    async with KvClient(hosts, timeout=5) as kv:
        assert kv.num_vbuckets == NVB and kv.config is not None and kv.config.rev == 5
        items = {f"doc-{i}": f"v{i}" for i in range(200)}
        roundtrips.clear()
        results = await kv.set_many(items)
        assert sorted(roundtrips) == sorted(
            [sum(1 for k in items if vbucket_for_key(k.encode(), NVB) % 2 == p) for p in (0, 1)]
        )
        got = await kv.get_many(items)
    assert [r.key for r in results] == [k.encode() for k in items]
    assert {k: g.value for k, g in got.items()} == {
        k.encode(): v.encode() for k, v in items.items()
    }
    where = sent_where(nodes, Opcode.SET)
    assert where == {"n1": set(range(0, NVB, 2)), "n2": set(range(1, NVB, 2))}
    assert nodes[0].count(Opcode.GET) + nodes[1].count(Opcode.GET) == 200
    assert all(n.count(Opcode.GET_CLUSTER_CONFIG) <= 1 for n in nodes)


async def test_one_bootstrap_address_of_a_cluster_is_enough(nursery: trio.Nursery) -> None:
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 3, SPLIT)
    async with KvClient(f"{HOST}:{nodes[1].port}", timeout=5) as kv:
        for vb in range(NVB):
            await kv.set(key_in(vb), b"x")
    assert sent_where(nodes, Opcode.SET) == {"n1": {0, 2, 4, 6}, "n2": {1, 3, 5, 7}}
    assert nodes[0].count(Opcode.GET_CLUSTER_CONFIG) == 0  # the map came from n2


async def test_a_not_my_vbucket_carrying_a_newer_map_reroutes_without_asking(
    nursery: trio.Nursery,
) -> None:
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, [0] * NVB)  # everything on n1
    async with KvClient(f"{HOST}:{nodes[0].port}", timeout=5) as kv:
        await kv.set(key_in(3), b"before")
        fetches = sum(n.count(Opcode.GET_CLUSTER_CONFIG) for n in nodes)
        # vb 3 moves to n2; n1 says so in its NOT_MY_VBUCKET answer (rev 2)
        moved = [1 if vb == 3 else 0 for vb in range(NVB)]
        serve_map(nodes, 2, moved)
        r = await kv.set(key_in(3), b"after")
        assert kv.config is not None and kv.config.rev == 2
        assert r.vbucket == 3
    assert sum(n.count(Opcode.GET_CLUSTER_CONFIG) for n in nodes) == fetches
    assert nodes[0].keys(Opcode.SET) == [key_in(3), key_in(3)]  # before; refused after
    assert nodes[1].keys(Opcode.SET) == [key_in(3)]
    assert nodes[0].docs[key_in(3)] == b"after"


async def test_a_map_without_the_answer_is_fetched_when_nmvb_carries_none(
    nursery: trio.Nursery,
) -> None:
    """A node that answers NOT_MY_VBUCKET without a config: the client asks for one."""
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, [0] * NVB)
    async with KvClient(f"{HOST}:{nodes[0].port}", timeout=5) as kv:
        serve_map(nodes, 2, [1] * NVB)
        nodes[0].nmvb_body = b'{"error":{"context":"not my vbucket"}}'
        await kv.set(key_in(5), b"x")
        assert kv.config is not None and kv.config.rev == 2
    assert nodes[0].count(Opcode.GET_CLUSTER_CONFIG) >= 2  # bootstrap, then the refresh
    assert nodes[1].keys(Opcode.SET) == [key_in(5)]


async def test_a_single_server_is_used_at_the_address_given_with_its_vbucket_count(
    tmp_path, roundtrips: list[int]
) -> None:
    cfg = server_mod.ServerConfig(
        host="127.0.0.1", port=0, data_dir=str(tmp_path / "d"), num_vbuckets=16
    )
    async with server_mod.DcpServer(cfg) as server:
        async with KvClient("127.0.0.1", server.port) as kv:
            assert kv.num_vbuckets == 16 and kv.vbucket_for("a") == vbucket_for_key(b"a", 16)
            assert kv.config is not None and len(kv.config.servers) == 1
            roundtrips.clear()
            await kv.set_many({f"k{i}": b"v" for i in range(100)})
            assert roundtrips == [100]  # one node, one roundtrip
        with pytest.raises(UsageError, match="num_vbuckets=32 but the server's config has 16"):
            async with KvClient("127.0.0.1", server.port, num_vbuckets=32):
                pass


async def test_a_single_servers_advertised_address_is_not_used(nursery: trio.Nursery) -> None:
    """A one-node config naming itself at an address the client cannot use (0.0.0.0, a
    name): the client keeps using the address it connected to."""
    (node,) = await fake_cluster(nursery, 1)
    node.owned = set(range(NVB))
    doc = json.loads(config_json(1, [node], [0] * NVB, node))
    doc["vBucketServerMap"]["serverList"] = ["0.0.0.0:1"]
    node.config = json.dumps(doc).encode()
    async with KvClient(HOST, node.port, timeout=3) as kv:
        await kv.set("a", b"1")
        assert (await kv.get("a")).value == b"1"


async def test_a_server_without_cluster_maps_is_a_single_node(nursery: trio.Nursery) -> None:
    (node,) = await fake_cluster(nursery, 1)
    node.owned = set(range(1024))  # config b"": UNKNOWN_COMMAND
    async with KvClient(HOST, node.port, timeout=3) as kv:
        assert kv.num_vbuckets == 1024 and kv.config is not None and kv.config.rev == 0
        await kv.set("a", b"1")


def test_a_malformed_bootstrap_list_is_a_usage_error() -> None:
    for bad in ("h1:notaport", "", [("h", 0)], "h1:1,h2:70000"):
        with pytest.raises(UsageError):
            KvClient(bad)
