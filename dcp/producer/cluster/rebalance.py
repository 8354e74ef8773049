"""Moving vbuckets: a rebalance (or a graceful failover) as batches of takeover moves,
and settling half-done moves (a move that timed out, or one a dead orchestrator left).

Rules of this module:
- A batch is published as the map's forward chains (``vBucketMapForward``): the nodes
  build the copies it names as replicas of the current active (cluster/agent.py
  reconciles them). The mover also tells each node with a new copy at once (the same
  replica assignment the node's reconcile computes, so the two never disagree): a node
  reads etcd only every so often, and every batch would wait for that. Not the new
  active of a move: its takeover must wait until its node has read the forward map
  (else a reconcile of the older map could call the takeover off), and its copy having
  caught up is what shows that. A new copy has
  caught up when its replica high seqno reaches the
  active's high seqno read after the batch was published (polled). A vbucket whose
  active changes is then handed over by a TAKEOVER stream: the new active is told
  ``REPLICA {"source": old, "takeover": true}`` and polled until it is ACTIVE (the old
  one turns itself DEAD on the way). Finishing the batch writes those chains as the
  current ones, without forward chains. Moves that change the active go first.
- Waits poll the nodes quickly at first and then more slowly (``poll_interval`` at most):
  a batch's copies and takeovers usually finish within tens of milliseconds, and a fixed
  poll would cost each batch that interval twice.
- Every vbucket of a batch has ``move_timeout`` to finish; what has not by then is
  settled. Settling decides by what the nodes say, never by time alone: a new active
  that is ACTIVE wins (the move is finished); otherwise its takeover is stopped (it is
  made a plain replica of the old active), asked again (it may have won the race),
  and only then is a non-active old copy made ACTIVE again. A new active that is live
  but does not answer is not decided on: its move stays in flight (forward chain kept,
  ``unsettled``) and a later ``resume`` settles it. So a vbucket never ends with two
  active copies, and never with none while the old active is reachable.
- A map node going down stops the rebalance (``MoveAborted``) after settling the batch
  in flight: the failover it needs is the orchestrator's next decision.
- Map writes go through ``MoveContext.write_map`` (the guarded CAS); a failed CAS stops
  the rebalance: the map is not what this mover wrote, so it decides nothing more.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import trio

from ...protocol.opcodes import VBucketState
from .control import ControlUnavailable, NodeControl
from .placement import moves
from .vbmap import VBucketMap
from .view import ClusterView

__all__ = ["MoveAborted", "MoveContext", "Mover"]

log = logging.getLogger("dcp.cluster")

ACTIVE = VBucketState.ACTIVE


class MoveAborted(Exception):
    """The moves stopped before the end (the message says why)."""


class MoveContext(Protocol):
    control: NodeControl

    def view(self) -> ClusterView: ...
    async def write_map(self, vbmap: VBucketMap, revision: int) -> int | None: ...


def _groups(pairs: Iterable[tuple[Any, int]]) -> dict[Any, list[int]]:
    out: dict[Any, list[int]] = defaultdict(list)
    for key, vb in pairs:
        out[key].append(vb)
    return out


class Mover:
    def __init__(
        self,
        ctx: MoveContext,
        *,
        batch: int,
        move_timeout: float,
        poll_interval: float = 0.2,
        progress: Callable[[int, int], None] = lambda done, total: None,
    ) -> None:
        self.ctx = ctx
        self.batch = max(1, batch)
        self.move_timeout = move_timeout
        self.poll = poll_interval
        self.progress = progress
        #: moves of the last batch that could not be settled (their new active did not
        #: answer): they keep their forward chains, to be settled by a later ``resume``
        self.unsettled: set[int] = set()

    # -- the whole move -----------------------------------------------------------------

    async def run(
        self, current: VBucketMap, revision: int, target: VBucketMap
    ) -> tuple[VBucketMap, int, int]:
        """Move from ``current`` (stored at ``revision``) to ``target``; returns the map
        written last, its revision and how many moves were rolled back. Raises
        ``MoveAborted`` after settling when a node went down or the map changed."""
        r = current.num_replicas
        servers = sorted(set(current.servers) | set(target.servers))
        todo = sorted(moves(current, target), key=lambda m: (not m.changes_active, m.vb))
        chains = [list(current.names(vb)) for vb in range(current.num_vbuckets)]
        total, done, rolled = len(todo), 0, 0
        self.progress(0, total)
        latest = current
        for start in range(0, total, self.batch):
            batch = todo[start : start + self.batch]
            fwd = [list(c) for c in chains]
            for m in batch:
                fwd[m.vb] = list(m.new)
            latest = VBucketMap.from_names(r, chains, servers=servers, forward=fwd)
            revision = await self._write(latest, revision)
            await self._start_copies(latest)
            finished, aborted = await self.move_batch(latest)
            for vb in finished:
                chains[vb] = fwd[vb]
            rolled += len(batch) - len(finished)
            latest = self._after(r, chains, servers, fwd)
            revision = await self._write(latest, revision)
            done += len(batch)
            self.progress(done, total)
            if aborted is None and self.unsettled:
                aborted = f"{len(self.unsettled)} moves unsettled: their new active does not answer"
            if aborted is not None:
                raise MoveAborted(aborted)
        named = {n for c in chains for n in c if n is not None}
        end_servers = sorted(set(target.servers) | named)
        if end_servers != servers:
            latest = VBucketMap.from_names(r, chains, servers=end_servers)
            revision = await self._write(latest, revision)
        return latest, revision, rolled

    async def resume(self, vbmap: VBucketMap, revision: int) -> tuple[VBucketMap, int]:
        """Finish or roll back the moves a map's forward chains describe (left by an
        orchestrator that died), then write the map without them."""
        finished, aborted = await self.move_batch(vbmap)
        chains = [
            list(vbmap.forward_names(vb) or vbmap.names(vb))
            if vb in finished
            else list(vbmap.names(vb))
            for vb in range(vbmap.num_vbuckets)
        ]
        moving = vbmap.moving()
        log.info(
            "resumed %d moves: %d finished, %d rolled back%s",
            len(moving),
            len(finished),
            len(moving) - len(finished),
            f" ({aborted})" if aborted else "",
        )
        fwd = [list(vbmap.forward_names(vb) or vbmap.names(vb)) for vb in range(vbmap.num_vbuckets)]
        new = self._after(vbmap.num_replicas, chains, list(vbmap.servers), fwd)
        return new, await self._write(new, revision)

    def _after(
        self,
        r: int,
        chains: list[list[str | None]],
        servers: list[str],
        fwd: list[list[str | None]] | list[tuple[str | None, ...]],
    ) -> VBucketMap:
        """The map once a batch is settled: no forward chains, except for the moves
        that could not be settled (``unsettled``), which stay in flight."""
        if not self.unsettled:
            return VBucketMap.from_names(r, chains, servers=servers)
        forward = [fwd[vb] if vb in self.unsettled else chains[vb] for vb in range(len(chains))]
        return VBucketMap.from_names(r, chains, servers=servers, forward=forward)

    def _pause(self, attempt: int) -> float:
        """How long to wait before the next poll (module rules): 10 ms, growing by half
        at each poll, at most ``poll``."""
        return min(self.poll, 0.01 * 1.5**attempt)

    async def _start_copies(self, vbmap: VBucketMap) -> None:
        """Tell the nodes of the batch's new copies to replicate them from the current
        active now, rather than when they next read the map (module rules)."""
        pairs = []
        for vb in vbmap.moving():
            old = vbmap.names(vb)
            source = self._address(old[0])
            if source is None:
                continue
            new = vbmap.forward_names(vb) or ()
            pairs += [
                ((n, source), vb)
                for n in new
                if n is not None and n not in old and (n != new[0] or new[0] == old[0])
            ]

        async def tell(node: str, source: str, vbs: list[int]) -> None:
            addr = self._address(node)
            if addr is None:
                return
            try:
                await self.ctx.control.set_states(
                    addr, vbs, VBucketState.REPLICA, {"source": source}
                )
            except ControlUnavailable as exc:  # its reconcile will do it
                log.info("starting %d copies on %s: %s", len(vbs), node, exc)

        async with trio.open_nursery() as nursery:
            for (node, source), vbs in _groups(pairs).items():
                nursery.start_soon(tell, node, source, vbs)

    async def _write(self, vbmap: VBucketMap, revision: int) -> int:
        written = await self.ctx.write_map(vbmap, revision)
        if written is None:
            raise MoveAborted("the map changed under the moves (it was not written)")
        return written

    # -- one batch ----------------------------------------------------------------------

    async def move_batch(self, vbmap: VBucketMap) -> tuple[set[int], str | None]:
        """Carry out (or settle) the moves of ``vbmap``'s forward chains; returns the
        vbuckets whose move is finished, and why the moves stopped early (or None)."""
        self.unsettled = set()
        vbs = vbmap.moving()
        fwd = {vb: vbmap.forward_names(vb) or vbmap.names(vb) for vb in vbs}
        old = {vb: vbmap.active(vb) for vb in vbs}
        changing = [vb for vb in vbs if old[vb] is not None and old[vb] != fwd[vb][0]]
        finished = {vb for vb in vbs if old[vb] is None}  # nothing to hand over
        new_st = await self._states_of(_groups((fwd[vb][0], vb) for vb in changing))
        old_st = await self._states_of(_groups((old[vb], vb) for vb in changing))
        finished |= {vb for vb in changing if new_st.get(vb) == ACTIVE}
        # the old active is no longer active: a takeover is under way (or was cut short)
        in_flight = [vb for vb in changing if vb not in finished and old_st.get(vb) != ACTIVE]
        rest = [vb for vb in vbs if vb not in finished and vb not in in_flight]
        caught: set[int] = set()
        aborted: str | None = None
        take = [vb for vb in rest if vb in changing]

        async def proceed() -> None:
            await self._catch_up(vbmap, fwd, rest, caught)
            await self._take_over(vbmap, fwd, take, finished)

        try:  # a takeover in flight does not hold the others up: side by side
            with trio.move_on_after(self.move_timeout):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._wait_active, vbmap, fwd, in_flight, finished)
                    nursery.start_soon(proceed)
        except* MoveAborted as group:
            aborted = str(group.exceptions[0])
        finished |= caught - set(changing)
        left = [vb for vb in vbs if vb not in finished]
        if left:
            await self._settle(vbmap, fwd, left, finished)
        return finished, aborted

    def _check(self, vbmap: VBucketMap) -> None:
        live = self.ctx.view().live
        down = [s for s in vbmap.servers if s not in live]
        if down:
            raise MoveAborted(f"node {', '.join(down)} went down")

    def _address(self, node: str | None) -> str | None:
        view = self.ctx.view()
        return view.address(node) if node in view.live else None

    async def _states_of(self, groups: dict[Any, list[int]]) -> dict[int, VBucketState]:
        """The states of the vbuckets on the nodes they are grouped by (a node that does
        not answer contributes nothing)."""
        out: dict[int, VBucketState] = {}
        for node, vbs in groups.items():
            addr = self._address(node)
            if addr is None:
                continue
            try:
                out.update(await self.ctx.control.states(addr, vbs))
            except ControlUnavailable as exc:
                log.info("states of %d vbuckets on %s: %s", len(vbs), node, exc)
        return out

    async def _seqnos_of(
        self, groups: dict[Any, list[int]], state: VBucketState
    ) -> dict[Any, dict[int, int]]:
        """Per node that answers, the high seqnos of its grouped vbuckets in ``state``
        (a node that does not answer contributes nothing, as in ``_states_of``)."""
        out: dict[Any, dict[int, int]] = {}
        for node, vbs in groups.items():
            addr = self._address(node)
            if addr is None:
                continue
            try:
                got = await self.ctx.control.seqnos(addr, state)
            except ControlUnavailable:
                continue
            out[node] = {vb: got[vb] for vb in vbs if vb in got}
        return out

    async def _wait_active(
        self,
        vbmap: VBucketMap,
        fwd: dict[int, tuple[str | None, ...]],
        vbs: list[int],
        finished: set[int],
    ) -> None:
        waiting = set(vbs)
        attempt = 0
        while waiting:
            self._check(vbmap)
            st = await self._states_of(_groups((fwd[vb][0], vb) for vb in waiting))
            now = {vb for vb in waiting if st.get(vb) == ACTIVE}
            finished |= now
            waiting -= now
            if waiting:
                await trio.sleep(self._pause(attempt))
                attempt += 1

    async def _catch_up(
        self,
        vbmap: VBucketMap,
        fwd: dict[int, tuple[str | None, ...]],
        vbs: list[int],
        caught: set[int],
    ) -> None:
        need = {
            vb: {n for n in fwd[vb] if n is not None and n not in vbmap.names(vb)} for vb in vbs
        }
        caught |= {vb for vb, nodes in need.items() if not nodes}
        need = {vb: nodes for vb, nodes in need.items() if nodes}
        target: dict[int, int] = {}
        attempt = 0
        while need:
            self._check(vbmap)
            missing = _groups((vbmap.active(vb), vb) for vb in need if vb not in target)
            for got in (await self._seqnos_of(missing, ACTIVE)).values():
                target.update(got)
            pairs = [(n, vb) for vb, nodes in need.items() if vb in target for n in nodes]
            have = await self._seqnos_of(_groups(pairs), VBucketState.REPLICA)
            for node, got in have.items():
                for vb, seqno in got.items():
                    if seqno >= target[vb]:
                        need[vb].discard(node)
            for vb in [vb for vb, nodes in need.items() if not nodes]:
                caught.add(vb)
                del need[vb]
            if need:
                await trio.sleep(self._pause(attempt))
                attempt += 1

    async def _take_over(
        self,
        vbmap: VBucketMap,
        fwd: dict[int, tuple[str | None, ...]],
        vbs: list[int],
        finished: set[int],
    ) -> None:
        control = self.ctx.control
        for (new, old), group in _groups(
            ((fwd[vb][0], vbmap.active(vb)), vb) for vb in vbs
        ).items():
            addr, source = self._address(new), self._address(old)
            if addr is None or source is None:
                continue
            options = {"source": source, "takeover": True}
            try:
                await control.set_states(addr, group, VBucketState.REPLICA, options)
            except ControlUnavailable as exc:
                log.info("takeover of %d vbuckets by %s: %s", len(group), new, exc)
        await self._wait_active(vbmap, fwd, vbs, finished)

    async def _settle(
        self,
        vbmap: VBucketMap,
        fwd: dict[int, tuple[str | None, ...]],
        vbs: list[int],
        finished: set[int],
    ) -> None:
        """Finish or roll back each of ``vbs`` (see the module rules)."""
        control = self.ctx.control
        changing = [vb for vb in vbs if vbmap.active(vb) not in (None, fwd[vb][0])]
        by_new = _groups((fwd[vb][0], vb) for vb in changing)
        st = await self._states_of(by_new)
        finished |= {vb for vb in changing if st.get(vb) == ACTIVE}
        stop = [vb for vb in changing if vb not in finished]
        for (new, old), group in _groups(
            ((fwd[vb][0], vbmap.active(vb)), vb) for vb in stop
        ).items():
            addr, source = self._address(new), self._address(old)
            if addr is None:
                continue
            options = {"source": source} if source is not None else None
            try:  # a plain replica: its takeover, if one is running, is called off
                await control.set_states(addr, group, VBucketState.REPLICA, options)
            except ControlUnavailable as exc:
                log.info("stopping the takeover of %d vbuckets on %s: %s", len(group), new, exc)
        st = await self._states_of(_groups((fwd[vb][0], vb) for vb in stop))
        finished |= {vb for vb in stop if st.get(vb) == ACTIVE}
        # a live new active that did not answer may be ACTIVE, taking writes: making the old
        # copy active again could make two; such a move stays in flight (forward chain
        # kept, the old copy kept as it is by its node's reconcile) until it answers
        live = self.ctx.view().live  # a node whose lease is gone has fenced itself
        self.unsettled = {vb for vb in stop if vb not in st and fwd[vb][0] in live}
        back = [vb for vb in stop if vb not in finished and vb not in self.unsettled]
        old_st = await self._states_of(_groups((vbmap.active(vb), vb) for vb in back))
        for old, group in _groups((vbmap.active(vb), vb) for vb in back).items():
            revive = [vb for vb in group if vb in old_st and old_st[vb] != ACTIVE]
            addr = self._address(old)
            if revive and addr is not None:
                try:
                    await control.set_states(addr, revive, ACTIVE)
                except ControlUnavailable as exc:
                    log.warning("making %d vbuckets active again on %s: %s", len(revive), old, exc)
        if len(vbs) > len([vb for vb in vbs if vb in finished]):
            log.warning(
                "%d vbucket moves rolled back (not finished within %g s or stopped)",
                len([vb for vb in vbs if vb not in finished]),
                self.move_timeout,
            )
