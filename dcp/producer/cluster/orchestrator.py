"""The orchestrator: the one node that decides the map (first map, rebalance, failover)
while it holds the office (cluster/election.py).

Rules of this module:
- It acts on what etcd says now: each decision starts from a fresh read of the cluster
  prefix (``ClusterView``), does one thing, and starts over; a follower task keeps the
  view current meanwhile (moves check liveness with it) and wakes the loop on changes.
- Every map write is ``Leadership.write_map`` (CAS on the map revision, guarded by the
  term, plus the decision's own guards). A failed CAS means "decide again"; a failed
  CAS with the term gone ends ``run`` (so does ``Leadership.wait_lost``).
- One decision at a time, in this order: the first map; moves a previous orchestrator
  left half done (forward chains: cluster/rebalance.py settles them); a failover
  request; a rebalance request; an automatic failover; an automatic rebalance (a live
  member that holds nothing, and no map node down).
- Automatic failover follows cluster/failover.py's rules. "Down for the timeout" is
  counted from when the node stopped renewing its lease, as Couchbase counts from the
  node becoming unresponsive: its key vanishes one lease TTL (from its record) after its
  last keepalive, so the node is dated down at the moment this orchestrator's ``clock``
  first saw the key gone, minus that TTL. Never earlier than the last keepalive: the
  key is seen gone TTL after it at the soonest (a new orchestrator first sees it at its
  election, later still), and etcd never grants less than the TTL asked for. The
  write is guarded on the node's key being absent: a node back in time is not failed
  over. Each automatic failover adds one to ``autofailover`` (an operator
  deletes or zeroes it to allow more).
- Requests (``requests/rebalance``, ``requests/failover``) are deleted when taken (by
  their revision: a request replaced meanwhile is not lost) and answered in ``status``
  with their id, which is written at most every ``status_interval`` while it changes.
- Blocking work (``compute_map``) runs in ``trio.to_thread``; nodes are reached only
  through ``NodeControl`` (cluster/control.py).
- The map is decoded only when its entry changed (``_map_of``: same mod revision and
  same bytes give the same frozen ``VBucketMap``): the loop and the follower read the
  prefix every poll, and decoding a 1024-vbucket map costs milliseconds of the event
  loop each time. Every read is still fresh; only the decoding is saved.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from ...protocol.opcodes import VBucketState
from .control import ControlUnavailable, NodeControl
from .election import Leadership
from .failover_ops import auto_failover, failover_request
from .membership import cluster_prefix
from .placement import compute_map
from .rebalance import MoveAborted, Mover
from .store import Entry, EtcdStore, Guard, Snapshot, StoreUnavailable
from .vbmap import VBucketMap
from .view import ClusterView, StatusBoard

__all__ = ["Orchestrator", "OrchestratorSettings", "TermLost"]

log = logging.getLogger("dcp.cluster")


@dataclass(frozen=True)
class OrchestratorSettings:
    cluster: str
    num_vbuckets: int
    num_replicas: int = 1
    auto_failover_timeout: float = 10.0
    auto_failover_max_count: int = 1
    rebalance_moves: int = 32
    move_timeout: float = 120.0


class TermLost(Exception):
    """This orchestrator's term ended (a map write was refused and the office is gone)."""


class Orchestrator:
    def __init__(
        self,
        store: EtcdStore,
        leadership: Leadership,
        control: NodeControl,
        settings: OrchestratorSettings,
        *,
        clock: Callable[[], float] = trio.current_time,
        poll_interval: float = 0.25,
        status_interval: float = 0.5,
    ) -> None:
        self.store = store
        self.leadership = leadership
        self.control = control
        self.settings = settings
        self.clock = clock
        self.poll = poll_interval
        self.status_interval = status_interval
        self.prefix = cluster_prefix(settings.cluster)
        self.board = StatusBoard(leadership.node, leadership.term, settings.auto_failover_max_count)
        self._view: ClusterView | None = None
        self._changed = trio.Event()
        self._down_since: dict[str, float] = {}
        self._settled: tuple[int, frozenset[str]] | None = None
        self._said: set[str] = set()
        self._parsed_map: tuple[int, bytes, VBucketMap] | None = None

    # -- running ------------------------------------------------------------------------

    async def run(self) -> None:
        """Orchestrate until cancelled; returns when the term is lost."""
        log.info("orchestrator %s: term %d", self.leadership.node, self.leadership.term)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_term, nursery.cancel_scope)
                await nursery.start(self._follow)
                nursery.start_soon(self._publish)
                await self._decide()
        except* TermLost:
            log.warning("orchestrator %s: term %d lost", self.leadership.node, self.leadership.term)
        finally:
            aclose = getattr(self.control, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await aclose()

    async def _watch_term(self, scope: trio.CancelScope) -> None:
        await self.leadership.wait_lost(self.poll)
        log.warning("orchestrator %s: term %d ended", self.leadership.node, self.leadership.term)
        scope.cancel()

    def down_for(self, node: str) -> float:
        """Seconds (by ``clock``) since ``node`` stopped renewing its lease, as far as
        this orchestrator knows (module rules)."""
        now = self.clock()
        return now - self._down_since.get(node, now)

    def view(self) -> ClusterView:
        assert self._view is not None, "no view before the first read"
        return self._view

    def say(self, message: str, level: int = logging.WARNING) -> None:
        """Log ``message`` once per orchestrator term (conditions re-checked every poll)."""
        if message not in self._said:
            self._said.add(message)
            log.log(level, "%s", message)

    def _observe(self, snap_view: ClusterView) -> None:
        now = self.clock()
        down = snap_view.down()
        self._down_since = {n: self._down_since.get(n, now - snap_view.lease_ttl(n)) for n in down}
        for problem in snap_view.problems:
            self.say(problem)
        self._view = snap_view
        self._changed.set()

    def _map_of(self, entry: Entry) -> VBucketMap:
        """The map ``entry`` holds, decoded once per change (module rules). A malformed
        one raises ``ValueError`` every time and is not kept."""
        kept = self._parsed_map
        if kept is not None and kept[0] == entry.mod_revision and kept[1] == entry.value:
            return kept[2]
        vbmap = VBucketMap.from_json(entry.value)
        self._parsed_map = (entry.mod_revision, entry.value, vbmap)
        return vbmap

    def parse(self, snap: Snapshot) -> ClusterView:
        return ClusterView.parse(
            self.settings.cluster,
            snap,
            max_count=self.settings.auto_failover_max_count,
            map_of=self._map_of,
        )

    async def refresh(self) -> ClusterView:
        view = self.parse(await self.store.get_prefix(self.prefix))
        self._observe(view)
        return view

    async def _follow(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            try:
                async for snap in self.store.follow(self.prefix, interval=self.poll):
                    try:
                        view = self.parse(snap)
                    except ValueError as exc:
                        self.say(f"orchestrator: cannot act on etcd's state: {exc}", logging.ERROR)
                        continue
                    self._observe(view)
                    if not started:
                        started = True
                        task_status.started()
            except StoreUnavailable as exc:
                self.say(f"orchestrator: etcd unavailable ({exc}); waiting", logging.INFO)
                await trio.sleep(self.poll)

    async def _publish(self) -> None:
        key = self.prefix + "status"
        while True:
            view = self.view()
            down = {n: self.down_for(n) for n in view.down()}
            unavailable = view.vbmap.unavailable() if view.vbmap is not None else []
            self.board.observe(down, unavailable, view.auto_count)
            if self.board.dirty:
                # cleared before the write: a change made while it is under way is
                # written next time, not lost
                self.board.dirty = False
                doc = self.board.document(time.time())
                try:
                    await self.store.put(key, json.dumps(doc, sort_keys=True).encode())
                except StoreUnavailable:
                    self.board.dirty = True  # written once etcd is back
            await trio.sleep(self.status_interval)

    async def write_map(
        self, vbmap: VBucketMap, revision: int, guards: Sequence[Guard] = ()
    ) -> int | None:
        """The guarded CAS; None when a condition failed (decide again); ``TermLost``
        when the term is what failed."""
        written = await self.leadership.write_map(vbmap, revision, guards)
        if written is None and not await self.leadership.holds():
            raise TermLost()
        if written is not None:
            log.info("map written at revision %d (%d servers)", written, len(vbmap.servers))
        return written

    async def _decide(self) -> None:
        while True:
            acted = False
            try:
                view = await self.refresh()
                acted = await self._step(view)
            except StoreUnavailable as exc:
                self.say(f"orchestrator: etcd unavailable ({exc}); waiting", logging.INFO)
            except ValueError as exc:  # a malformed map: nothing is decided on it
                self.say(f"orchestrator: cannot act on etcd's state: {exc}", logging.ERROR)
            if not acted:
                self._changed = trio.Event()
                with trio.move_on_after(self.poll):
                    await self._changed.wait()

    async def _step(self, view: ClusterView) -> bool:
        """Make the first decision that applies (module rules); True if it did anything."""
        s = self.settings
        vbmap = view.vbmap
        if vbmap is None:
            live = sorted(view.live_members)
            if not live:
                return False
            first = await trio.to_thread.run_sync(
                compute_map, live, s.num_vbuckets, s.num_replicas, None
            )
            await self.write_map(first, 0)
            return True
        if vbmap.num_vbuckets != s.num_vbuckets:
            self.say(f"the map has {vbmap.num_vbuckets} vbuckets, not {s.num_vbuckets}")
            return False
        if vbmap.forward is not None:
            await self._resume(view, vbmap)
            return True
        if "failover" in view.requests:
            await failover_request(self, view, view.requests["failover"])
            return True
        if "rebalance" in view.requests:
            await self._rebalance_request(view, view.requests["rebalance"])
            return True
        if await auto_failover(self, view, vbmap):
            return True
        return await self._auto_rebalance(view, vbmap)

    def mover(self, progress: Callable[[int, int], None]) -> Mover:
        return Mover(
            self,
            batch=self.settings.rebalance_moves,
            move_timeout=self.settings.move_timeout,
            poll_interval=min(self.poll, 0.2),
            progress=progress,
        )

    # -- moves ----------------------------------------------------------------------------

    async def _resume(self, view: ClusterView, vbmap: VBucketMap) -> None:
        started = time.time()
        self.board.set_rebalance(
            id=None,
            state="running",
            total=len(vbmap.moving()),
            done=0,
            started=started,
            finished=None,
            message="settling the moves a previous orchestrator left",
        )
        try:
            await self.mover(lambda d, t: None).resume(vbmap, view.map_revision)
        except MoveAborted as exc:
            self.board.set_rebalance(state="failed", message=str(exc), finished=time.time())
            return
        self.board.set_rebalance(
            state="done",
            done=len(vbmap.moving()),
            finished=time.time(),
            message="moves left by a previous orchestrator settled",
        )

    async def take_request(self, entry: Entry) -> dict[str, Any] | None:
        """Delete a request (by its revision) and return it; None when it changed or
        was taken, or is malformed (then reported)."""
        if not await self.store.delete(entry.key, mod_revision=entry.mod_revision):
            return None
        try:
            req = json.loads(entry.value)
            if not isinstance(req, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            message = f"malformed request {entry.key}: {exc}"
            log.warning("%s", message)
            if entry.key.endswith("rebalance"):
                self.board.set_rebalance(id=None, state="failed", message=message)
            else:
                self.board.set_failover(state="failed", message=message)
            return None
        return req

    async def _rebalance_request(self, view: ClusterView, entry: Entry) -> None:
        req = await self.take_request(entry)
        if req is None:
            return
        eject = req.get("eject", [])
        rid = req.get("id")
        if not isinstance(eject, list) or not all(isinstance(n, str) for n in eject):
            self.board.set_rebalance(id=rid, state="failed", message="eject must list node names")
            return
        await self._rebalance(view, rid if isinstance(rid, str) else None, eject)

    async def _rebalance(self, view: ClusterView, rid: str | None, eject: list[str]) -> None:
        s = self.settings
        vbmap = view.vbmap
        assert vbmap is not None
        now = time.time()
        self.board.set_rebalance(
            id=rid, state="running", total=0, done=0, message="", started=now, finished=None
        )

        def fail(message: str) -> None:
            log.warning("rebalance %s failed: %s", rid or "(automatic)", message)
            self.board.set_rebalance(state="failed", message=message, finished=time.time())

        unknown = sorted(set(eject) - view.members.keys())
        if unknown:
            return fail(f"cannot eject {', '.join(unknown)}: not a member")
        down = view.down()
        if down:
            return fail(f"{', '.join(down)} down: fail it over first")
        in_service = sorted(view.live_members - set(eject))
        if not in_service:
            return fail("no node would be left in service")
        prefer = await self._former_copies(view, vbmap, in_service)
        target = await trio.to_thread.run_sync(
            functools.partial(
                compute_map, in_service, s.num_vbuckets, s.num_replicas, vbmap, prefer=prefer
            )
        )

        def progress(done: int, total: int) -> None:
            self.board.set_rebalance(done=done, total=total)

        try:
            final, _, rolled = await self.mover(progress).run(vbmap, view.map_revision, target)
        except MoveAborted as exc:
            return fail(str(exc))
        for name in eject:
            if name not in final.servers:
                await self.store.delete(self.prefix + "members/" + name)
        if rolled:
            return fail(f"{rolled} moves did not finish and were rolled back")
        self.board.set_rebalance(state="done", message="balanced", finished=time.time())

    async def _former_copies(
        self, view: ClusterView, vbmap: VBucketMap, nodes: Iterable[str]
    ) -> dict[str, set[int]]:
        """What each node the map does not name still holds data for (its dead vbuckets
        with a high seqno above 0: a failed-over node come back). The placement gives it
        those as replicas first, so it rolls back its unreplicated tail rather than
        leaving it on disk, and builds fewer copies from nothing. A node that does not
        answer is placed without a preference."""
        out: dict[str, set[int]] = {}
        for node in sorted(set(nodes) - set(vbmap.servers)):
            addr = view.address(node)
            if addr is None:
                continue
            try:
                held = await self.control.seqnos(addr, VBucketState.DEAD)
            except ControlUnavailable as exc:
                log.info("copies %s still holds: %s", node, exc)
                continue
            out[node] = {vb for vb, seqno in held.items() if seqno > 0}
        return out

    async def _auto_rebalance(self, view: ClusterView, vbmap: VBucketMap) -> bool:
        if view.down():
            return False
        counts = vbmap.counts()
        live = view.live_members
        idle = [n for n in live if counts.get(n, (0, 0)) == (0, 0)]
        key = (view.map_revision, frozenset(live))
        if not idle or key == self._settled:
            return False
        s = self.settings
        prefer = await self._former_copies(view, vbmap, live)
        target = await trio.to_thread.run_sync(
            functools.partial(
                compute_map, sorted(live), s.num_vbuckets, s.num_replicas, vbmap, prefer=prefer
            )
        )
        same = target.servers == vbmap.servers and all(
            target.names(vb) == vbmap.names(vb) for vb in range(vbmap.num_vbuckets)
        )
        if same:
            self._settled = key
            return False
        log.info("automatic rebalance: %s hold no copy", ", ".join(sorted(idle)))
        await self._rebalance(view, None, [])
        return True
