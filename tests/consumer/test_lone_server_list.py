"""A lone server (no cluster) reached through a bootstrap list is read at the address that
answered, not at the HOST:PORT it advertises (which may be 0.0.0.0 or a name clients
cannot resolve): KvClient and DcpClient agree with the Spark connector and dcpctl
(``ClusterConfig.seen_from``)."""

from __future__ import annotations

import socket

import trio

from dcp.consumer import DcpClient, KvClient
from dcp.producer import server as server_mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_both_clients_use_the_answering_address_of_a_lone_server(tmp_path) -> None:
    cfg = server_mod.ServerConfig(
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "d"),
        num_vbuckets=16,
        log_level="WARNING",
        advertise="nowhere.invalid:1",  # what its config names: unusable on purpose
    )
    async with server_mod.DcpServer(cfg) as server:
        # the first entry has nothing listening: the list moves on to the server
        hosts = f"127.0.0.1:{_free_port()},127.0.0.1:{server.port}"
        with trio.fail_after(30):
            async with KvClient(hosts, timeout=10) as kv:
                assert kv.config is not None
                assert kv.config.servers == (("127.0.0.1", server.port),)
                await kv.set_many({f"k{i}": b"v%d" % i for i in range(40)})
            seen: set[bytes] = set()
            async with DcpClient(hosts, to_latest=True, retry_timeout=10) as client:
                async for batch in client:
                    seen.update(bytes(e.key) for e in batch)
                nodes = client.statistics()["nodes"]
    assert seen == {f"k{i}".encode() for i in range(40)}
    assert list(nodes) == [f"127.0.0.1:{server.port}"]


async def test_the_blocking_facades_take_a_bootstrap_list(tmp_path) -> None:
    from dcp.consumer import BlockingDcpClient, BlockingKvClient

    async def serve_and_use() -> set[bytes]:
        cfg = server_mod.ServerConfig(
            host="127.0.0.1", port=0, data_dir=str(tmp_path / "d"), num_vbuckets=16
        )
        async with server_mod.DcpServer(cfg) as server:
            hosts = [("127.0.0.1", _free_port()), ("127.0.0.1", server.port)]

            def use() -> set[bytes]:
                with BlockingKvClient(hosts, timeout=10) as kv:
                    kv.set_many({f"b{i}": b"x" for i in range(20)})
                    assert kv.get("b3").value == b"x"
                seen: set[bytes] = set()
                with BlockingDcpClient(hosts, to_latest=True, retry_timeout=10) as client:
                    for batch in client:
                        seen.update(bytes(e.key) for e in batch)
                return seen

            with trio.fail_after(60):
                return await trio.to_thread.run_sync(use)

    assert await serve_and_use() == {f"b{i}".encode() for i in range(20)}
