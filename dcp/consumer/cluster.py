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
  at a time and at most one per 100 ms (``routing.RefreshGate``). A fetched config is
  used only when it parses and is newer; a NOT_MY_VBUCKET answer's own config counts the
  same. After each refresh every routed vbucket is checked against the map (and, with
  ``prefer_replica``, the copies' seqnos) and moved when it should stream elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from dcp.protocol.cluster_config import Address, ClusterConfig, format_address

from .connection import DcpConnection
from .errors import NoNodeAnsweredError, RetryTimeoutError, TransientError, UsageError
from .node_link import NodeLink, control_call
from .offset import FailoverLog, StartFrom
from .routing import RefreshGate, backoff, newer_config, pick

if TYPE_CHECKING:
    from .supervisor import Supervisor

__all__ = ["ClusterRunner", "NoActiveError"]

log = logging.getLogger(__name__)
T = TypeVar("T")
ACTIVE, REPLICA = 1, 2


class NoActiveError(TransientError):
    """The map names no active node for a vbucket (a failover has not happened yet)."""


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
        self.done = trio.Event()
        self._refresh_wanted = trio.Event()
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Stream until every ``to_latest`` vbucket is done; raises what ended it."""
        sup = self.sup
        if sup.session is None:
            await self._resolve()
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
        try:
            data = await self.ask_any(lambda c: c.get_cluster_config())
        except NoNodeAnsweredError as exc:
            log.warning("cluster config refresh failed, keeping rev %s: %s", self.config.rev, exc)
            return
        if data:
            newer = newer_config(self.config, data)
            if newer is not None:
                self._adopt(newer)
        if self.sup.routing.prefer_replica:
            await self._read_seqnos()
        now = trio.current_time()
        for vb, node in list(self.route.items()):
            if self._target(vb, node) != node:
                self._unroute(vb)
                self.waiting[vb] = now
        self._wake.set()

    async def _read_seqnos(self) -> None:
        """Every node's active and replica high seqnos (a node that does not answer
        counts as having no current replica)."""
        active: dict[int, int] = {}
        replica: dict[Address, dict[int, int]] = {}

        async def one(addr: Address) -> None:
            async def both(c: DcpConnection) -> tuple[list[Any], list[Any]]:
                return await c.get_all_vb_seqnos(ACTIVE), await c.get_all_vb_seqnos(REPLICA)

            try:
                act, rep = await self.ask(addr, both)
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

    async def ask_any(self, fn: Callable[[DcpConnection], Awaitable[T]]) -> T:
        """``fn`` on the first node that answers: linked nodes, then the map's, then the
        bootstrap list; ``NoNodeAnsweredError`` naming each one tried when none does."""
        order: list[Address] = []
        for addr in [
            *(a for a, link in self.links.items() if link.ready),
            *self.config.servers,
            *self.sup.routing.addresses,
        ]:
            if addr not in order:
                order.append(addr)
        errors: list[BaseException] = []
        for addr in order:
            try:
                return await self.ask(addr, fn)
            except Exception as exc:  # try the next node
                errors.append(exc)
        raise NoNodeAnsweredError([format_address(a) for a in order], errors)

    # ------------------------------------------------------------------ start positions

    async def _resolve(self) -> None:
        """Start positions from the nodes the map names (retried until the timeout)."""
        sup = self.sup
        vbs = sup.vbuckets if sup.vbuckets is not None else list(range(self.config.num_vbuckets))
        bad = [vb for vb in vbs if vb >= self.config.num_vbuckets]
        if bad:
            raise UsageError(f"vbuckets {bad[:5]} not in the cluster's {self.config.num_vbuckets}")
        if not (sup.to_latest or sup.start is StartFrom.NOW):  # the map lists the vbuckets
            await sup.resolve(vbs, {}, None)
            return
        since = trio.current_time()
        attempts = 0
        while True:
            try:
                high, end_logs = await self._seqnos_and_logs(vbs)
                await sup.resolve(vbs, high, self._logs_of(end_logs), end_logs or None)
                return
            except Exception as exc:
                if not sup.transient(exc):
                    raise
                attempts += 1
                now = trio.current_time()
                if now - since >= sup.retry_timeout:
                    err = RetryTimeoutError(
                        "connect", attempts=attempts, elapsed=now - since, last_error=exc
                    )
                    raise err from exc
                await trio.sleep(backoff(attempts))
                await self.refresh()

    async def _seqnos_and_logs(
        self, vbs: list[int]
    ) -> tuple[dict[int, int], dict[int, FailoverLog]]:
        """The actives' high seqnos of ``vbs`` and, ``to_latest``, their failover logs,
        each node's log read before its seqnos: a failover in between then lowers the
        end (``Session.clamp_end``) rather than hiding the branch that lost the tail."""
        missing = self.config.without_active(vbs)
        if missing:
            raise NoActiveError(f"the map names no active for vbuckets {missing[:8]}")
        high: dict[int, int] = {}
        logs: dict[int, FailoverLog] = {}
        for addr, mine in self.config.actives_by_node(vbs).items():
            if self.sup.to_latest:
                logs.update(await self.ask(addr, _failover_logs(mine)))
            got = dict(await self.ask(addr, _seqnos_in(ACTIVE)))
            stale = [vb for vb in mine if vb not in got]
            if stale:  # the map moved them on: refresh, ask again
                raise NoActiveError(
                    f"{format_address(addr)} holds no active vbuckets {stale[:8]} (map rev "
                    f"{self.config.rev})"
                )
            high.update((vb, got[vb]) for vb in mine)
        return high, logs

    def _logs_of(
        self, known: dict[int, FailoverLog]
    ) -> Callable[[list[int]], Awaitable[dict[int, FailoverLog]]]:
        """Failover logs of vbuckets (``StartFrom.NOW``) from their actives, reusing
        those already read."""

        async def logs(now_vbs: list[int]) -> dict[int, FailoverLog]:
            out = {vb: known[vb] for vb in now_vbs if vb in known}
            rest = [vb for vb in now_vbs if vb not in out]
            for addr, mine in self.config.actives_by_node(rest).items():
                out.update(await self.ask(addr, _failover_logs(mine)))
            return out

        return logs

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


def _failover_logs(vbs: list[int]) -> Callable[[DcpConnection], Awaitable[dict[int, FailoverLog]]]:
    async def ask(c: DcpConnection) -> dict[int, FailoverLog]:
        return await c.get_failover_logs(vbs)

    return ask


def _seqnos_in(state: int) -> Callable[[DcpConnection], Awaitable[list[tuple[int, int]]]]:
    async def ask(c: DcpConnection) -> list[tuple[int, int]]:
        return await c.get_all_vb_seqnos(state)

    return ask
