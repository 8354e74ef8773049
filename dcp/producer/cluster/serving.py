"""ClusterSide: what the server and its handlers ask about the cluster, single node or not.

Rules of this module:
- ``DcpServer`` holds one ``ClusterSide`` (``server.cluster``) whatever its mode, so a
  handler never asks which mode it is in: ``config_json`` is the bucket config clients
  route with (GET_CLUSTER_CONFIG), ``nmvb_body`` what a NOT_MY_VBUCKET answer carries
  (b"" on a single node: the error context as before), ``stat_pairs`` the STAT group
  ``cluster``.
- Single node (``cluster`` unset): the config says this node holds every vbucket
  active, no replicas, rev 1; no etcd is contacted, no write gate is installed
  (``server.write_gate`` stays None: the write path's cost is one None check).
- Cluster mode: ``start`` builds the etcd store and the ``ClusterAgent`` (agent.py),
  installs its gate and runs it in a cancel scope of its own in the server's background
  nursery; a refused join raises out of ``start`` (the server refuses to start).
  ``stop`` leaves the cluster (the lease is revoked) and cancels the agent; ``aclose``
  releases the store's HTTP sessions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from .agent import ClusterAgent
from .store import EtcdStore
from .vbmap import VBucketMap, bucket_config

if TYPE_CHECKING:
    from ..server import DcpServer

__all__ = ["ClusterSide"]


class ClusterSide:
    def __init__(self, server: DcpServer, options: Mapping[str, Any] | None = None) -> None:
        self._server = server
        #: keyword arguments for ``ClusterAgent`` (tests: ``run_orchestrator``, ``interval``)
        self._options = dict(options or {})
        self.agent: ClusterAgent | None = None
        self.store: EtcdStore | None = None
        self._scope = trio.CancelScope()
        self._single = b""

    @property
    def address(self) -> str:
        cfg = self._server.config
        return cfg.advertise or f"{cfg.host}:{self._server.port}"

    async def start(self, bg: trio.Nursery) -> None:
        """Cluster mode: join and run the agent (returns once joined). Single node: no-op."""
        cfg = self._server.config
        if not cfg.cluster:
            return
        store = self.store = EtcdStore(cfg.cluster)
        agent = self.agent = ClusterAgent(self._server, store, **self._options)
        self._server.write_gate = agent.writes_allowed  # closed until a map names the node
        await bg.start(self._run, agent)

    async def _run(
        self, agent: ClusterAgent, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        with self._scope:
            await agent.run(task_status=task_status)

    async def stop(self) -> None:
        """Leave the cluster (a graceful stop) and stop the agent."""
        if self.agent is not None:
            await self.agent.leave()
        self._scope.cancel()

    async def aclose(self) -> None:
        if self.store is not None:
            await self.store.aclose()

    # ------------------------------------------------------------------ what clients get

    def config_json(self) -> bytes:
        """The bucket config (b"" in cluster mode before the first map)."""
        if self.agent is not None:
            return self.agent.config_json()
        if not self._single:
            self._single = self._single_node_config()
        return self._single

    def nmvb_body(self) -> bytes:
        return self.agent.config_json() if self.agent is not None else b""

    def _single_node_config(self) -> bytes:
        server = self._server
        name = server.config.node_name or self.address
        n = server.bucket.num_vbuckets
        vbmap = VBucketMap(n, 0, (name,), tuple((0,) for _ in range(n)))
        doc = bucket_config(vbmap, {name: self.address}, 1, name)
        return json.dumps(doc, separators=(",", ":")).encode()

    def stat_pairs(self) -> list[tuple[str, Any]]:
        if self.agent is not None:
            return self.agent.stat_pairs()
        return [("node_name", self._server.config.node_name), ("cluster", ""), ("map_rev", 1)]
