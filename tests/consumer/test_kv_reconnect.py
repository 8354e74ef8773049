"""KvClient reopening connections: a slow connect or HELLO is waited for, never given up
and started over; a single server's NOT_MY_VBUCKET is retried without asking for maps.

Rules of this module: fake nodes on loopback (``kv_cluster_fake.py``) with a delay on
their HELLO answer (a loaded node, or TLS with SCRAM, may take more than the client's
``PATIENCE`` to let a connection in); real time with generous upper bounds.
"""

from __future__ import annotations

import trio

from dcp.consumer import KvClient
from dcp.consumer.kv_nodes import PATIENCE
from dcp.protocol.opcodes import Opcode

from .kv_cluster_fake import HOST, FakeNode, config_json, fake_cluster, serve_map
from .test_kv_cluster import NVB, SPLIT, key_in

SLOW = PATIENCE + 0.3  # longer than the client waits before it looks at the map


async def _drop_connections(node: FakeNode) -> None:
    for s in node._streams:
        await trio.aclose_forcefully(s)


async def test_a_single_server_slow_to_answer_hello_is_reconnected(
    nursery: trio.Nursery,
) -> None:
    node = FakeNode("n1", {})  # no GET_CLUSTER_CONFIG: a single server
    node.owned = set(range(1024))
    await node.start(nursery)
    async with KvClient(HOST, node.port, timeout=10) as kv:
        await kv.set(b"k", b"v")
        node.hello_delay = SLOW  # loaded now: a new connection's HELLO takes longer
        await _drop_connections(node)
        # cut off after PATIENCE and redone, the reconnect would never succeed
        assert (await kv.get(b"k")).value == b"v"
    # one connection at first and one reconnect: an attempt is never dropped and redone
    assert node.connections == 2 and node.count(Opcode.HELLO) == 2


async def test_a_cluster_node_slow_to_answer_hello_is_waited_for_while_the_map_keeps_it(
    nursery: trio.Nursery,
) -> None:
    nodes = await fake_cluster(nursery, 2)
    serve_map(nodes, 1, SPLIT)
    n1, n2 = nodes
    n2.hello_delay = SLOW  # before the client ever connects to it
    async with KvClient(f"{HOST}:{n1.port}", timeout=10) as kv:
        await kv.add(key_in(1), b"a")  # vb 1 is n2's, and the map says so throughout
        assert kv.config is not None and kv.config.rev == 1
    assert n2.connections == 1 and n2.keys(Opcode.ADD) == [key_in(1)]
    assert n1.keys(Opcode.ADD) == []


async def test_a_single_servers_not_my_vbucket_is_retried_without_config_fetches(
    nursery: trio.Nursery,
) -> None:
    """A single server's NOT_MY_VBUCKET carries an error context, not a map: asking it
    for its map again would tell nothing, so the request is only retried with backoff."""
    for config in (b"", None):  # a server without maps; one with a one-node map
        node = FakeNode("n1", {})
        await node.start(nursery)
        if config is None:
            node.config = config_json(1, [node], [0] * NVB, node)
        node.nmvb_body = b'{"error":{"context":"vbucket not active"}}'
        async with KvClient(HOST, node.port, timeout=10) as kv:
            fetches = node.count(Opcode.GET_CLUSTER_CONFIG)
            assert fetches == 1  # the bootstrap's
            async with trio.open_nursery() as inner:
                inner.start_soon(kv.set, b"k", b"v")
                await trio.sleep(0.8)  # refused for a while (a warm-up, say)
                node.owned = set(range(kv.num_vbuckets))
            assert node.docs[b"k"] == b"v"
            assert node.count(Opcode.SET) >= 2  # it was retried
            assert node.count(Opcode.GET_CLUSTER_CONFIG) == fetches
