"""A node restarted after an unclean shutdown (cluster/rejoin.py) against a real etcd, in
process, with maps written by hand (no orchestrator): it neither registers nor serves
while the map names it active for vbuckets with other copies, and once the map has
failed it over it holds that map's states (its stale actives dead) before its first
answer. A clean restart joins at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from dcp.producer.cluster.rejoin import MARKER
from dcp.producer.cluster.store import EtcdStore
from dcp.producer.server import DcpServer, ServerConfig
from dcp.protocol import Opcode, codec
from dcp.protocol.opcodes import VBucketState

from .agent_support import NVB, states, until, write_map
from .conftest import EtcdProcess, free_port

A, D = VBucketState.ACTIVE, VBucketState.DEAD
NAMED = [["n1", "n2"]] * NVB  # n1 active everywhere, a copy on n2
FAILED_OVER: list[list[str | None]] = [["n2", None]] * NVB


def config(root: Path, endpoint: str, cluster: str, port: int) -> ServerConfig:
    return ServerConfig(
        port=port,
        data_dir=str(root / "n1"),
        num_vbuckets=NVB,
        cluster=endpoint,
        node_name="n1",
        cluster_name=cluster,
        unclean_rejoin_wait=60,
    )


@contextlib.asynccontextmanager
async def running(cfg: ServerConfig) -> AsyncIterator[dict[str, Any]]:
    """The node runs in the background; ``box["server"]`` is set once it has started
    (joined and serving). Stopped (cancelled) when the block ends."""
    box: dict[str, Any] = {"started": trio.Event()}
    server = DcpServer(cfg, cluster_options={"interval": 0.05, "run_orchestrator": None})

    async def run() -> None:
        await nursery.start(server.run)
        box["server"] = server
        box["started"].set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        try:
            yield box
        finally:
            if box["started"].is_set():
                await server.aclose()
            nursery.cancel_scope.cancel()


async def noop_answered(port: int, within: float) -> bool:
    """Does a NOOP sent on a new connection get its answer within ``within`` s?"""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(codec.request(Opcode.NOOP, opaque=9))
        with trio.move_on_after(within):
            return len(await stream.receive_some(24)) > 0
    return False


async def test_unclean_restart_waits_unserved_then_holds_the_new_map_before_answering(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    cfg = config(tmp_path, ep, cluster_name, free_port())
    store = EtcdStore(ep, timeout=2.0)
    key = f"/dcp/{cluster_name}/nodes/n1"
    try:
        await write_map(ep, cluster_name, NAMED)
        async with running(cfg) as box:
            await box["started"].wait()
            n1: DcpServer = box["server"]
            await until(lambda: states(n1) == [A] * NVB and n1.write_gate(), "n1 active")
            n1.request_shutdown(clean=False)  # the next start is unclean (as after kill -9)
        async with running(cfg) as box:
            await until(lambda: (tmp_path / "n1" / MARKER).exists(), "waiting")
            await trio.sleep(0.5)
            assert not box["started"].is_set() and await store.get(key) is None
            assert not await noop_answered(cfg.port, within=0.5)  # listening, not serving
            await write_map(ep, cluster_name, FAILED_OVER, servers=["n2"])
            with trio.fail_after(10):
                await box["started"].wait()
            n1 = box["server"]
            assert states(n1) == [D] * NVB  # reconciled before the first answer
            assert await noop_answered(cfg.port, within=5)
            assert not n1.write_gate() and await store.get(key) is not None
            assert not (tmp_path / "n1" / MARKER).exists()
            assert n1.cluster.agent is not None and n1.cluster.agent.rejoin.outcome == "failed over"
    finally:
        await store.aclose()


async def test_a_clean_restart_joins_at_once(
    etcd_server: EtcdProcess, cluster_name: str, tmp_path: Path
) -> None:
    ep = etcd_server.endpoint
    cfg = config(tmp_path, ep, cluster_name, free_port())
    await write_map(ep, cluster_name, NAMED)
    async with running(cfg) as box:
        await box["started"].wait()
        await until(lambda: states(box["server"]) == [A] * NVB, "n1 active")
    async with running(cfg) as box:  # stopped cleanly: everything it answered is on disk
        with trio.fail_after(5):
            await box["started"].wait()
        n1 = box["server"]
        assert n1.cluster.agent.rejoin.outcome == "" and not n1.bucket.warmup_unclean
        await until(lambda: states(n1) == [A] * NVB and n1.write_gate(), "n1 active again")
