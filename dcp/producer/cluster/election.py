"""Election: one orchestrator at a time, and only the orchestrator writes the map.

Rules of this module:
- The orchestrator holds ``/dcp/<cluster>/orchestrator`` = {node, uuid}, created only if
  absent and bound to the candidate's lease (its membership lease: a node that loses its
  lease loses the office with it). The key's create revision is the *term*: a new holder
  always has a higher one, even the same node elected again.
- A candidate that finds the key held follows it (cluster/store.py ``follow``) and tries
  again when it is gone. Campaigning needs etcd: while etcd is away, nobody is elected
  and a holder keeps its term only as long as its lease.
- The map (``/dcp/<cluster>/map``) is written only by ``Leadership.write_map``: one etcd
  transaction that puts it only if the map's mod revision is the one the orchestrator
  read (no lost update between two of its own decisions, or with anyone's) and the
  orchestrator key still has this term's create revision. A deposed orchestrator that
  has not noticed yet therefore cannot write: the two conditions make concurrent
  decisions impossible by construction, not by timing.
- The map's mod revision after a write is its epoch (the ``rev`` clients are given).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from .membership import cluster_prefix
from .store import Entry, Guard, Snapshot, StoreUnavailable
from .vbmap import VBucketMap

__all__ = ["Election", "ElectionStore", "Leadership", "map_key", "read_map"]

log = logging.getLogger(__name__)


class ElectionStore(Protocol):
    async def get(self, key: str) -> Entry | None: ...
    async def compare_and_put(
        self,
        key: str,
        value: bytes,
        *,
        mod_revision: int,
        lease: int = 0,
        guard: Guard | None = None,
        guards: Sequence[Guard] = (),
    ) -> int | None: ...
    async def delete(self, key: str, *, mod_revision: int | None = None) -> bool: ...
    def follow(self, prefix: str, *, interval: float = 0.25) -> AsyncIterator[Snapshot]: ...


def map_key(cluster: str) -> str:
    return cluster_prefix(cluster) + "map"


async def read_map(store: ElectionStore, cluster: str) -> tuple[VBucketMap | None, int]:
    """The stored map and its mod revision (None and 0 when there is none yet)."""
    got = await store.get(map_key(cluster))
    if got is None:
        return None, 0
    return VBucketMap.from_json(got.value), got.mod_revision


@dataclass(frozen=True)
class Leadership:
    """This node's term as orchestrator (``term``: the office key's create revision)."""

    store: ElectionStore
    cluster: str
    node: str
    term: int

    @property
    def key(self) -> str:
        return cluster_prefix(self.cluster) + "orchestrator"

    def guard(self) -> Guard:
        return Guard(self.key, self.term)

    async def write_map(
        self, vbmap: VBucketMap, expect_revision: int, guards: Sequence[Guard] = ()
    ) -> int | None:
        """Store ``vbmap`` if the stored map is still at ``expect_revision`` (0: none),
        this term still holds and every one of ``guards`` holds too (a failover guards
        on the failed node's key being absent: it fails if the node came back). Returns
        the map's new revision (its epoch) or None."""
        return await self.store.compare_and_put(
            map_key(self.cluster),
            vbmap.to_json(),
            mod_revision=expect_revision,
            guards=[self.guard(), *guards],
        )

    async def holds(self) -> bool:
        got = await self.store.get(self.key)
        return got is not None and got.create_revision == self.term

    async def wait_lost(self, interval: float = 0.25) -> None:
        """Return once this term has ended (the key is gone or belongs to another term).
        etcd being away is not the end of a term: the lease decides that."""
        while True:
            try:
                async for snap in self.store.follow(self.key, interval=interval):
                    held = snap.entries.get(self.key)
                    if held is None or held.create_revision != self.term:
                        return
            except StoreUnavailable:
                await trio.sleep(interval)

    async def resign(self) -> None:
        """Give the office up now (only this term's key is deleted)."""
        got = await self.store.get(self.key)
        if got is not None and got.create_revision == self.term:
            await self.store.delete(self.key, mod_revision=got.mod_revision)


class Election:
    def __init__(self, store: ElectionStore, cluster: str, node: str, node_uuid: str) -> None:
        self.store = store
        self.cluster = cluster
        self.node = node
        self.node_uuid = node_uuid
        self.key = cluster_prefix(cluster) + "orchestrator"

    async def leader(self) -> str | None:
        got = await self.store.get(self.key)
        return str(json.loads(got.value)["node"]) if got is not None else None

    async def campaign(self, lease: int, *, interval: float = 0.25) -> Leadership:
        """Wait until this node holds the office under ``lease``; its ``Leadership``.
        Raises ``LeaseExpired`` when the lease is gone (register again first)."""
        value = json.dumps({"node": self.node, "uuid": self.node_uuid}).encode()
        while True:
            try:
                term = await self.store.compare_and_put(
                    self.key, value, mod_revision=0, lease=lease
                )
                if term is not None:
                    log.info("node %s is the orchestrator (term %d)", self.node, term)
                    return Leadership(self.store, self.cluster, self.node, term)
                async for snap in self.store.follow(self.key, interval=interval):
                    if self.key not in snap.entries:
                        break
            except StoreUnavailable as exc:
                log.warning("campaign for orchestrator: %s", exc)
                await trio.sleep(interval)
