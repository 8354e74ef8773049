"""A ``DcpClient`` over a cluster: one connection per node, each vbucket streamed from the
node the map names, following the map through rebalances and failovers.

Rules of this module:
- One ``ClusterRunner`` per client, run by the supervisor (``supervisor.py``) once the
  first config says the client talks to a cluster. It owns the current ``ClusterConfig``
  and one ``NodeLink`` (``node_link.py``) per node that streams vbuckets. The positions
  (``positions.Session``), the delivery queue and the per-vbucket retry clocks are the
  client's, shared by every link: positions are per vbucket, not per node, so the offset
  store is the same as against one node.
- A vbucket is either routed (given to one link) or waiting (due at a time). It waits
  after its node said NOT_MY_VBUCKET (the reader's backoff), after its stream ended other
  than OK (STATE_CHANGED: the vbucket moved), when its node's connection was lost, or
  while the map names no active for it; each wait asks for a config refresh. Routing it
  again is a new stream request with the session's own resume fields, so the new node
  answers ROLLBACK exactly when its branch diverged from what the client has seen.
- Retries of one vbucket back off (``routing.backoff``) and end with ``RetryTimeoutError``
  after ``retry_timeout`` s without its stream opening (opening resets its clock).
  Anything that is not transient (``RollbackError`` under the fail policy, a
  ``StreamError``...) ends the client, through the delivery queue.
- Config refreshes (``_refresher``): on demand and every ``config_poll_interval`` s, one
  at a time and at most one per 100 ms (``routing.RefreshGate``). A fetch asks nodes in
  turn (``_candidates``: linked nodes first, the least busy first, then the map's and the
  bootstrap list; those that just failed to answer last), each for at most
  ``ASK_TIMEOUT`` s, until one has a *newer* config: the first answer may be a stale
  node's, and a frozen node must not cost ``connect_timeout`` per refresh. A fetched
  config is used only when it parses and is newer; a NOT_MY_VBUCKET answer's own config
  counts the same. When no node answers, the warning is logged at most once per
  ``WARN_EVERY`` s (and again at once after a refresh worked). After each refresh every
  routed vbucket is checked against the map (and, with ``prefer_replica``, the copies'
  seqnos) and moved when it should stream elsewhere.
- Start positions and the small requests asked of nodes are ``cluster_start.py``'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from dcp.protocol.cluster_config import Address, ClusterConfig, format_address

from .cluster_start import (
    NoActiveError,
    active_and_replica_seqnos,
    cluster_config,
    resolve_positions,
)
from .connection import DcpConnection
from .errors import NoNodeAnsweredError, RetryTimeoutError
from .node_link import NodeLink, control_call
from .routing import RefreshGate, backoff, newer_config, pick

if TYPE_CHECKING:
    from .supervisor import Supervisor

__all__ = ["ASK_TIMEOUT", "WARN_EVERY", "ClusterRunner", "NoActiveError"]

log = logging.getLogger(__name__)
T = TypeVar("T")
#: seconds one node may take to answer a refresh's request before the next is asked
ASK_TIMEOUT = 1.0
#: seconds between two "refresh failed" warnings while no node answers
WARN_EVERY = 10.0


class ClusterRunner:
    """Links to the nodes of one cluster for one client (see the module rules)."""

    def __init__(self, sup: Supervisor, config: ClusterConfig) -> None:
        self.sup = sup
        self.config = config
        self.links: dict[Address, NodeLink] = {}
        self.route: dict[int, Address] = {}  #: vb -> the node it streams from
        self.waiting: dict[int, float] = {}  #: vb -> when to route it (trio time)
        self.gate = RefreshGate(0.1)
        self.refreshes = 0
        self.active_high: dict[int, int] = {}
        self.replica_high: dict[Address, dict[int, int]] = {}
        self.failure: BaseException | None = None
        #: node -> when it last failed to answer a refresh (asked last for a while)
        self._failed_at: dict[Address, float] = {}
        self._warned_at: float | None = None  #: last "refresh failed" warning
        self.done = trio.Event()
        self._refresh_wanted = trio.Event()
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Stream until every ``to_latest`` vbucket is done; raises what ended it."""
        sup = self.sup
        if sup.session is None:
            await resolve_positions(self)
        assert sup.session is not None
        if sup.routing.prefer_replica:  # route to the replicas from the first request on
            await self._read_seqnos()
        now = trio.current_time()
        self.waiting = {vb: now for vb in sup.session.positions}
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._refresher)
            nursery.start_soon(self._router)
            await self.done.wait()
            nursery.cancel_scope.cancel()
        self._nursery = None
        if self.failure is not None:
            raise self.failure

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        self.done.set()

    def _check_done(self) -> None:
        session = self.sup.session
        if session is not None and session.all_done():
            self.done.set()

    async def _router(self) -> None:
        session = self.sup.session
        assert session is not None
        while True:
            now = trio.current_time()
            for vb in [vb for vb, t in self.waiting.items() if t <= now]:
                if session[vb].done:
                    del self.waiting[vb]
                else:
                    self._place(vb, now)
            self._check_done()
            self._wake = trio.Event()
            soonest = min(self.waiting.values(), default=now + 3600)
            with trio.move_on_after(max(soonest - now, 0.0)):
                await self._wake.wait()

    def _place(self, vb: int, now: float) -> None:
        target = self._target(vb, None)
        if target is None:
            err = NoActiveError(f"the map (rev {self.config.rev}) names no active for vb {vb}")
            self._retry(vb, err, now, "route")
            return
        del self.waiting[vb]
        self.route[vb] = target
        link = self.links.get(target)
        if link is None:
            link = self.links[target] = NodeLink(self, target)
            assert self._nursery is not None
            self._nursery.start_soon(link.run)
        link.add(vb)

    def _target(self, vb: int, current: Address | None) -> Address | None:
        r = self.sup.routing
        resume = 0
        session = self.sup.session
        if session is not None and vb in session:
            p = session[vb]  # a replica must have what the next request asks from
            resume = max(p.r_seqno, p.r_snap_end)
        return pick(
            self.config,
            vb,
            current=current,
            prefer_replica=r.prefer_replica,
            max_lag=r.max_replica_lag,
            active_high=self.active_high,
            replica_high=self.replica_high,
            resume=resume,
        )

    def _retry(self, vb: int, err: BaseException, now: float, operation: str) -> None:
        """Wait before routing ``vb`` again, or fail once its retry timeout passed."""
        retries = self.sup.retries
        since, attempts = retries.get(vb, (now, 0))
        attempts += 1
        if now - since >= self.sup.retry_timeout:
            exc = RetryTimeoutError(
                operation, vbucket=vb, attempts=attempts, elapsed=now - since, last_error=err
            )
            exc.__cause__ = err
            self.fail(exc)
            return
        retries[vb] = (since, attempts)
        self._wait(vb, now + backoff(attempts))

    def _wait(self, vb: int, when: float) -> None:
        self.waiting[vb] = when
        self._wake.set()
        self.want_refresh()

    def _unroute(self, vb: int) -> None:
        node = self.route.pop(vb, None)
        link = self.links.get(node) if node is not None else None
        if link is not None:
            link.remove(vb)
            if not link.vbs:
                del self.links[link.addr]
                link.close()

    # ------------------------------------------------------------------ what links report

    def moved(self, vb: int, delay: float, config: bytes) -> None:
        """A node does not serve ``vb`` (NOT_MY_VBUCKET, or its stream ended): route it
        again after ``delay`` s, with the answer's config when it is newer."""
        self._unroute(vb)
        if config:
            newer = newer_config(self.config, config)
            if newer is not None:
                self._adopt(newer)
        self._wait(vb, trio.current_time() + max(delay, 0.05))

    def link_ended(self, link: NodeLink, error: BaseException | None) -> None:
        if self.links.get(link.addr) is link:
            del self.links[link.addr]
        vbs = sorted(link.vbs)
        for vb in vbs:
            self.route.pop(vb, None)
        if error is None:  # every to_latest vbucket reached its end
            self._check_done()
            for vb in vbs:
                self._wait(vb, trio.current_time())
            return
        if not self.sup.transient(error):
            self.fail(error)
            return
        log.info("lost %s (%r); routing its %d vbuckets again", link.name, error, len(vbs))
        self.sup.stats["reconnects"] += 1
        now = trio.current_time()
        for vb in vbs:
            self._retry(vb, error, now, "connect")

    # ------------------------------------------------------------------ the config

    def want_refresh(self) -> None:
        self._refresh_wanted.set()

    def _adopt(self, config: ClusterConfig) -> None:
        log.info("cluster config rev %s -> %s", self.config.rev, config.rev)
        self.config = config

    async def _refresher(self) -> None:
        poll = self.sup.routing.config_poll_interval
        while True:
            with trio.move_on_after(poll):
                await self._refresh_wanted.wait()
            self._refresh_wanted = trio.Event()
            pause = self.gate.wait_time(trio.current_time())
            if pause:
                await trio.sleep(pause)
            self.gate.start(trio.current_time())
            try:
                await self.refresh()
            finally:
                self.gate.done()

    async def refresh(self) -> None:
        """Fetch the config (and, with ``prefer_replica``, the seqnos); move what the new
        picture routes elsewhere."""
        self.refreshes += 1
        await self._fetch_newer()
        if self.sup.routing.prefer_replica:
            await self._read_seqnos()
        now = trio.current_time()
        for vb, node in list(self.route.items()):
            if self._target(vb, node) != node:
                self._unroute(vb)
                self.waiting[vb] = now
        self._wake.set()

    async def _fetch_newer(self) -> None:
        """Ask nodes in turn until one has a newer config (module rules)."""
        limit = min(ASK_TIMEOUT, self.sup.connect_timeout)
        tried: list[Address] = []
        errors: list[BaseException] = []
        answered = False
        for addr in self._candidates():
            tried.append(addr)
            try:
                with trio.fail_after(limit):
                    data = await self.ask(addr, cluster_config)
            except Exception as exc:  # that node cannot tell (TooSlowError too): the next
                errors.append(exc)
                self._failed_at[addr] = trio.current_time()
                continue
            self._failed_at.pop(addr, None)
            answered = True
            newer = newer_config(self.config, data) if data else None
            if newer is not None:
                self._adopt(newer)
                break
            # not newer: this node may be the stale one; the next may know better
        if tried and not answered:
            self._warn_unanswered(NoNodeAnsweredError([format_address(a) for a in tried], errors))
        elif self._warned_at is not None:
            log.info("cluster config refresh works again (rev %s)", self.config.rev)
            self._warned_at = None

    def _warn_unanswered(self, exc: NoNodeAnsweredError) -> None:
        now = trio.current_time()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning("cluster config refresh failed, keeping rev %s: %s", self.config.rev, exc)
        else:
            log.debug("cluster config refresh failed again: %s", exc)

    def _candidates(self) -> list[Address]:
        """Whom a refresh asks, in order (module rules)."""
        busy = sorted(
            (link.pending_requests(), i, addr)
            for i, (addr, link) in enumerate(self.links.items())
            if link.ready
        )
        order: list[Address] = []
        for addr in [
            *(addr for _, _, addr in busy),
            *self.config.servers,
            *self.sup.routing.addresses,
        ]:
            if addr not in order:
                order.append(addr)
        recent = trio.current_time() - WARN_EVERY
        failed_at = self._failed_at
        return sorted(order, key=lambda a: failed_at.get(a, -math.inf) > recent)

    async def _read_seqnos(self) -> None:
        """Every node's active and replica high seqnos (a node that does not answer
        within ``ASK_TIMEOUT`` counts as having no current replica)."""
        active: dict[int, int] = {}
        replica: dict[Address, dict[int, int]] = {}
        limit = min(ASK_TIMEOUT, self.sup.connect_timeout)

        async def one(addr: Address) -> None:
            try:
                with trio.fail_after(limit):
                    act, rep = await self.ask(addr, active_and_replica_seqnos)
            except Exception as exc:  # any failure: no replica there
                log.debug("seqnos of %s: %r", format_address(addr), exc)
                return
            for vb, h in act:
                if self.config.active(vb) == addr:
                    active[vb] = h
            replica[addr] = dict(rep)

        async with trio.open_nursery() as nursery:
            for addr in self.config.servers:
                nursery.start_soon(one, addr)
        self.active_high, self.replica_high = active, replica

    async def ask(self, addr: Address, fn: Callable[[DcpConnection], Awaitable[T]]) -> T:
        link = self.links.get(addr)
        if link is not None:
            return await link.ask(fn)
        return await control_call(self.sup, addr, fn)

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> dict[str, Any]:
        """The client's cluster statistics: per node, the map's revision, and connected /
        flow control over every connection."""
        nodes: dict[str, dict[str, Any]] = {}
        for addr in self.config.servers:
            link = self.links.get(addr)
            nodes[format_address(addr)] = (
                link.statistics()
                if link is not None
                else {"vbuckets": 0, "connected": False, "flow_control": None}
            )
        for addr, link in self.links.items():
            nodes.setdefault(format_address(addr), link.statistics())
        totals: dict[str, int] = {}
        for n in nodes.values():
            for k, v in (n["flow_control"] or {}).items():
                totals[k] = totals.get(k, 0) + v
        return {
            "connected": any(n["connected"] for n in nodes.values()),
            "flow_control": totals or None,  # summed over the nodes' connections
            "config_rev": self.config.rev,
            "config_refreshes": self.refreshes,
            "nodes": nodes,
            "waiting_vbuckets": len(self.waiting),
        }
