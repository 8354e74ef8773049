"""In-process cluster nodes for the agent tests: real ``DcpServer``s on loopback that join
a real etcd (tests/etcd/conftest.py), with maps written by hand.

Rules of this module: no orchestrator runs unless a test passes one (``run_orchestrator``
in ``node``: a fake, or "real" for cluster/orchestrator.py): the tests decide the map.
Every node is stopped when its ``async with`` ends, pass or fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from dcp.producer.cluster.election import map_key
from dcp.producer.cluster.store import EtcdStore
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.producer.server import DcpServer, ServerConfig
from dcp.protocol.opcodes import VBucketState

NVB = 4


@contextlib.asynccontextmanager
async def node(
    root: Path,
    endpoint: str,
    cluster: str,
    name: str,
    *,
    run_orchestrator: Any = None,
    **settings: Any,
) -> AsyncIterator[DcpServer]:
    cfg = ServerConfig(
        port=0,
        data_dir=str(root / name),
        num_vbuckets=settings.pop("num_vbuckets", NVB),
        cluster=endpoint,
        node_name=name,
        cluster_name=cluster,
        **settings,
    )
    options: dict[str, Any] = {"interval": 0.05}
    if run_orchestrator != "real":  # "real": the default, cluster/orchestrator.py
        options["run_orchestrator"] = run_orchestrator
    async with DcpServer(cfg, cluster_options=options) as server:
        yield server


async def write_map(
    endpoint: str,
    cluster: str,
    chains: Sequence[Sequence[str | None]],
    *,
    num_replicas: int = 1,
    forward: Sequence[Sequence[str | None]] | None = None,
    servers: Sequence[str] | None = None,
) -> int:
    """Put a map as the orchestrator would (unconditionally: no orchestrator runs here);
    returns its revision."""
    vbmap = VBucketMap.from_names(num_replicas, chains, servers=servers, forward=forward)
    store = EtcdStore(endpoint)
    try:
        return await store.put(map_key(cluster), vbmap.to_json())
    finally:
        await store.aclose()


def states(server: DcpServer) -> list[VBucketState]:
    return [server.bucket.vbucket(vb).state for vb in range(server.bucket.num_vbuckets)]


async def until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.02)
    assert check(), what


def address(server: DcpServer) -> str:
    return f"127.0.0.1:{server.port}"
