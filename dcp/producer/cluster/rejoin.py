"""Rejoining after an unclean shutdown: a node that crashed while active for vbuckets
with other copies waits to be failed over before it registers again.

Rules of this module:
- Why. After an unclean shutdown, warm-up starts a new history branch at the last
  persisted point of every active vbucket (engine/warmup.py). A node restarted at once
  (kill -9, then systemd) was never seen down, so nobody changed the map: had it taken
  its name back at once, the map would still name it active and its replicas would be
  told to roll back to that point — every MAJORITY write it had answered but not
  persisted (held in memory by a majority of the chain) lost. Letting its old lease
  lapse instead makes it an ordinary failed node: the orchestrator promotes the replica
  holding the most of the old branch (cluster/failover.py), which holds every MAJORITY
  write; the node comes back through the automatic rebalance and its unreplicated tail
  rolls back as a replica's would.
- Who waits (``UncleanRejoin.hold``, called by ``Membership.join`` after its checks and
  before registering): the previous shutdown was unclean, or a wait of an earlier run
  did not finish (the marker file ``rejoin-pending`` in the data directory: a restart
  while waiting, even a clean one, waits again, since its vbuckets still carry the new
  branch); and the map, read from etcd before registering, names the node active for a
  vbucket whose chain holds another copy (``held_actives``). A vbucket with no other
  copy does not count: its failover would be refused, the node must come back for it.
  A clean shutdown (final flush) and ``limit`` 0 rejoin at once.
- While it waits the node neither registers (``nodes/<name>`` goes once its old lease
  lapses: the orchestrator sees it down) nor serves: the server accepts connections only
  once the join returns (cluster/serving.py), because its active vbuckets already carry
  the new branch, and a replica streaming from one would be told to roll back — the
  very loss this prevents. Its peers see a node that does not answer, as a frozen one.
  It reads the cluster prefix every ``interval``; an INFO line every ``INFO_EVERY`` s.
- The wait ends when the map no longer names the node active for such a vbucket (it was
  failed over): ``hold`` returns that read, and the agent reconciles with it before
  serving (its stale actives become dead). Or after ``limit`` seconds: it joins anyway
  with a WARNING (the writes it had not persisted may be rolled back). etcd away while
  waiting: it keeps reading, and the time counts.
- Time is ``trio.current_time()``; the marker file is written and removed in
  ``trio.to_thread``; etcd is read through the store's ``get_prefix``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

import trio

from .election import map_key
from .membership import cluster_prefix
from .store import Snapshot, StoreUnavailable
from .vbmap import VBucketMap

__all__ = ["MARKER", "UncleanRejoin", "held_actives"]

log = logging.getLogger("dcp.cluster")

#: in the data directory while a wait is under way (module rules)
MARKER = "rejoin-pending"
#: seconds between the INFO lines of a wait
INFO_EVERY = 30.0


class PrefixReader(Protocol):
    async def get_prefix(self, prefix: str) -> Snapshot: ...


def held_actives(vbmap: VBucketMap | None, me: str) -> list[int]:
    """The vbuckets ``vbmap`` names ``me`` active for whose chain holds another copy."""
    if vbmap is None:
        return []
    out = []
    for vb in range(vbmap.num_vbuckets):
        chain = vbmap.names(vb)
        if chain[0] == me and any(n is not None and n != me for n in chain[1:]):
            out.append(vb)
    return out


def _ranges(vbs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (a log line names every vbucket, briefly)."""
    parts: list[str] = []
    start = prev = -2
    for vb in [*vbs, -2]:
        if vb == prev + 1:
            prev = vb
            continue
        if start >= 0:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = vb
    return ",".join(parts)


class UncleanRejoin:
    """See the module rules. ``read``: the last read of the cluster prefix when ``hold``
    waited (the agent reconciles with it before serving), else None."""

    def __init__(
        self,
        store: PrefixReader,
        *,
        cluster: str,
        node_name: str,
        data_dir: str | os.PathLike[str],
        unclean: bool,
        limit: float,
        interval: float = 0.25,
    ) -> None:
        self.store = store
        self.prefix = cluster_prefix(cluster)
        self.map_key = map_key(cluster)
        self.node_name = node_name
        self.marker = Path(data_dir) / MARKER
        self.unclean = unclean
        self.limit = limit
        self.interval = interval
        self.read: Snapshot | None = None
        #: how the wait ended: "" (no wait), "failed over" or "timed out"
        self.outcome = ""

    def _held(self, snap: Snapshot, before: list[int] | None) -> list[int]:
        entry = snap.entries.get(self.map_key)
        if entry is None:
            return []
        try:
            vbmap = VBucketMap.from_json(entry.value)
        except ValueError:  # the agent logs it; meanwhile what was held stays held
            return before or []
        return held_actives(vbmap, self.node_name)

    async def hold(self) -> None:
        """Return once this node may register (module rules). ``StoreUnavailable`` from
        the first read propagates, as the join's own reads do."""
        pending = await trio.to_thread.run_sync(self.marker.exists)
        if not (self.unclean or pending) or self.limit <= 0:
            if pending:
                await trio.to_thread.run_sync(self._clear)
            return
        snap = await self.store.get_prefix(self.prefix)
        held = self._held(snap, None)
        if not held:
            if pending:
                await trio.to_thread.run_sync(self._clear)
            return
        await trio.to_thread.run_sync(self._mark)
        why = "an unclean shutdown" if self.unclean else "a restart during such a wait"
        log.warning(
            "cluster: %s restarted after %s and the map still names it active for %d "
            "vbuckets with other copies (%s): not rejoining until it is failed over (at most "
            "%g s): their replicas may hold writes it answered but had not persisted",
            self.node_name,
            why,
            len(held),
            _ranges(held),
            self.limit,
        )
        start = trio.current_time()
        deadline = start + self.limit
        next_info = start + INFO_EVERY
        failures = 0
        while True:
            await trio.sleep(self.interval)
            try:
                snap = await self.store.get_prefix(self.prefix)
            except StoreUnavailable as exc:
                failures += 1
                if failures == 1:
                    log.warning("cluster: etcd unreachable while waiting to rejoin: %s", exc)
            else:
                failures = 0
                held = self._held(snap, held)
                if not held:
                    self.outcome = "failed over"
                    log.info(
                        "cluster: %s was failed over after %.1f s: rejoining",
                        self.node_name,
                        trio.current_time() - start,
                    )
                    break
            now = trio.current_time()
            if now >= deadline:
                self.outcome = "timed out"
                log.warning(
                    "cluster: %s not failed over within %g s: rejoining anyway, still active "
                    "for vbuckets %s; MAJORITY writes it had not persisted before its unclean "
                    "shutdown may be rolled back",
                    self.node_name,
                    self.limit,
                    _ranges(held),
                )
                break
            if now >= next_info:
                next_info += INFO_EVERY
                log.info(
                    "cluster: %s still waiting to be failed over (%.0f s of %g s), named "
                    "active for vbuckets %s",
                    self.node_name,
                    now - start,
                    self.limit,
                    _ranges(held),
                )
        self.read = snap
        await trio.to_thread.run_sync(self._clear)

    def _mark(self) -> None:
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        with open(self.marker, "w", encoding="utf-8") as f:
            f.write("waiting to be failed over before rejoining (cluster/rejoin.py)\n")
            f.flush()
            os.fsync(f.fileno())

    def _clear(self) -> None:
        self.marker.unlink(missing_ok=True)
