"""Carrying out failovers for the orchestrator: automatic, manual hard, manual graceful.

Rules of this module:
- The decisions are cluster/failover.py's (pure); this module gathers what they need
  (the live replicas' seqnos, through ``NodeControl``), writes the result through the
  orchestrator's guarded CAS and reports in its ``StatusBoard``.
- Automatic: the replicas whose seqnos decide must all answer, with their seqnos and
  the failover logs of the vbuckets concerned (which branch those seqnos are on), else
  it is refused this time (retried at the next poll): promoting without knowing who
  has the most would lose acknowledged writes needlessly. The write is guarded on the
  failed node's key being absent; then the ``autofailover`` count goes up by one (a
  CAS loop, so a reset by an operator at the same moment is not overwritten with an
  older count).
- Hard (``requests/failover``, graceful false): as automatic without the count or the
  one-down rule, also for a live node: that one is first made to stop taking writes
  (``_stop_live_node``: forward chains, its actives set dead, replicas given a moment
  to catch up), else refused, so there are never two actives; a vbucket with no live
  replica is left unavailable and the report says which. A replica that does not
  answer ranks last but may be promoted. For a live node the replica to promote is
  chosen again from seqnos read once its actives are dead: until then it counted its
  replicas' acks (dcp/producer/durability.py), so a replica read before may since have
  fallen behind another that holds writes answered at MAJORITY.
- A manual failover (hard or graceful) also removes the node from ``members/``: the
  automatic rebalance would otherwise take a live node straight back. An automatic
  failover keeps it a member, so a node that comes back is rebalanced in again (as a
  replica of its old vbuckets first: its unreplicated tail is rolled back).
- Graceful: the node must be live and every vbucket active on it must have a live
  replica; its actives are handed over to their best replicas by takeover moves
  (cluster/rebalance.py), then it leaves every chain.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import trio

from ...protocol.opcodes import VBucketState
from .control import ControlUnavailable
from .failover import FailoverPlan, auto_refusal, orphans, plan_failover, replicas_to_ask
from .rebalance import MoveAborted
from .store import Entry, Guard
from .vbmap import VBucketMap
from .view import ClusterView

if TYPE_CHECKING:
    from .orchestrator import Orchestrator

__all__ = ["auto_failover", "failover_request"]

SeqnoMap = dict[str, dict[int, int]]

log = logging.getLogger("dcp.cluster")

#: a live node being hard-failed-over: how often its actives are set dead and checked,
#: how long its reconcile gets between two tries, how long replicas may take to catch up
STOP_ATTEMPTS = 5
STOP_SETTLE = 0.6
CATCH_UP_WAIT = 5.0


async def replica_seqnos(
    orch: Orchestrator, view: ClusterView, nodes: set[str]
) -> dict[str, dict[int, int]]:
    """The replica high seqnos of each of ``nodes`` that answers."""
    out: dict[str, dict[int, int]] = {}
    for node in sorted(nodes):
        addr = view.address(node)
        if addr is None:
            continue
        try:
            out[node] = await orch.control.seqnos(addr, VBucketState.REPLICA)
        except ControlUnavailable as exc:
            log.warning("replica seqnos of %s: %s", node, exc)
    return out


async def replica_logs(
    orch: Orchestrator, view: ClusterView, vbmap: VBucketMap, node: str, seqnos: SeqnoMap
) -> dict[str, dict[int, list[tuple[int, int]]]]:
    """The failover logs of ``node``'s active vbuckets on each replica that said its
    seqnos (which branch those seqnos are on: cluster/failover.py ``valid_seqno``). A
    replica holding none of them in replica state has nothing to be asked: its logs
    are known (none), or an automatic failover would count it missing at every poll."""
    out: dict[str, dict[int, list[tuple[int, int]]]] = {}
    mine = {vb for vb in range(vbmap.num_vbuckets) if vbmap.active(vb) == node}
    for replica, held in sorted(seqnos.items()):
        vbs = sorted(mine & held.keys())
        if not vbs:
            out[replica] = {}
            continue
        addr = view.address(replica)
        if addr is None:
            continue
        try:
            out[replica] = await orch.control.failover_logs(addr, vbs)
        except ControlUnavailable as exc:
            log.warning("failover logs of %s: %s", replica, exc)
    return out


def _inputs(plan: FailoverPlan, seqnos: SeqnoMap) -> str:
    """What each promotion was decided on (logged: to trace a promotion later), at most
    32 vbuckets: "vb 0: n2 at 1392 (n3 1391)"."""
    parts = []
    for vb, best in sorted(plan.promoted.items())[:32]:
        rest = " ".join(
            f"{r} {seqnos.get(r, {}).get(vb, '?')}" for r in sorted(seqnos) if r != best
        )
        parts.append(f"vb {vb}: {best} at {seqnos.get(best, {}).get(vb, '?')} ({rest})")
    more = " ..." if len(plan.promoted) > 32 else ""
    return "; ".join(parts) + more


def _summary(plan: FailoverPlan) -> str:
    text = f"{plan.node} failed over: {len(plan.promoted)} replicas promoted"
    if plan.unavailable:
        shown = ", ".join(map(str, plan.unavailable[:16]))
        more = " ..." if len(plan.unavailable) > 16 else ""
        text += (
            f"; {len(plan.unavailable)} vbuckets had no replica and are unavailable ({shown}{more})"
        )
    return text


async def auto_failover(orch: Orchestrator, view: ClusterView, vbmap: VBucketMap) -> bool:
    """Fail over a node down for the timeout, when every safety rule allows; True when
    the map was written (or the attempt must be decided again)."""
    s = orch.settings
    down = view.down()
    expired = [n for n in down if orch.down_for(n) >= s.auto_failover_timeout]
    if not expired:
        return False
    node = expired[0]
    live = view.live
    reason = auto_refusal(vbmap, node, down, live, view.auto_count, s.auto_failover_max_count)
    seqnos: dict[str, dict[int, int]] = {}
    logs: dict[str, dict[int, list[tuple[int, int]]]] = {}
    if reason is None:
        ask = replicas_to_ask(vbmap, node, live)
        seqnos = await replica_seqnos(orch, view, ask)
        missing = sorted(ask - seqnos.keys())
        if not missing:
            logs = await replica_logs(orch, view, vbmap, node, seqnos)
            missing = sorted(ask - logs.keys())
        if missing:
            reason = (
                f"replica(s) {', '.join(missing)} did not say their seqnos and failover "
                "logs: the replica to promote cannot be chosen"
            )
    if reason is not None:
        orch.board.set_failover(node=node, state="refused", message=reason, auto=True)
        orch.say(f"automatic failover of {node} refused: {reason}")
        return False
    plan = plan_failover(vbmap, node, live, seqnos, logs)
    if plan.unavailable:
        reason = (
            f"{len(plan.unavailable)} vbuckets active on {node} have no replica holding a "
            f"copy ({', '.join(map(str, plan.unavailable[:8]))}): failing it over would "
            "leave them without an active copy"
        )
        orch.board.set_failover(node=node, state="refused", message=reason, auto=True)
        orch.say(f"automatic failover of {node} refused: {reason}")
        return False
    # Counted before the map is written: an orchestrator that dies in between leaves one
    # failover too many counted (fewer automatic ones allowed), never one uncounted.
    if await _count(orch, node) is None:
        return False
    gone = Guard(orch.prefix + "nodes/" + node, 0)
    if await orch.write_map(plan.vbmap, view.map_revision, [gone]) is None:
        log.info("automatic failover of %s not written: the map changed or it is back", node)
        await _count(orch, node, undo=True)
        return True
    await orch.refresh()  # the report goes out with the view that has the new count
    message = _summary(plan)
    log.warning("automatic failover: %s", message)
    log.info("automatic failover of %s decided on: %s", node, _inputs(plan, seqnos))
    orch.board.set_failover(node=node, state="done", message=message, auto=True)
    return True


async def _count(orch: Orchestrator, node: str, *, undo: bool = False) -> int | None:
    """Add one automatic failover of ``node`` to ``autofailover`` (``undo``: take the
    one just added back, when its map write did not land)."""
    key = orch.prefix + "autofailover"
    for _ in range(5):
        got = await orch.store.get(key)
        count, failed = 0, []
        if got is not None and got.value:
            try:
                doc = json.loads(got.value)
                count, failed = int(doc.get("count", 0)), list(doc.get("failed_over", []))
            except (ValueError, TypeError, AttributeError):
                count = orch.settings.auto_failover_max_count  # it was unreadable: stay safe
        if undo:
            if node in failed:
                del failed[len(failed) - 1 - failed[::-1].index(node)]
            count = max(0, count - 1)
        else:
            count, failed = count + 1, [*failed, node]
        value = json.dumps({"count": count, "failed_over": failed}).encode()
        revision = got.mod_revision if got is not None else 0
        if await orch.store.compare_and_put(key, value, mod_revision=revision) is not None:
            return count
    log.error("could not count the automatic failover of %s (autofailover keeps changing)", node)
    return None


async def _remove_member(orch: Orchestrator, node: str) -> None:
    """A manual failover takes the node out of the roster: the operator removed it, so
    the automatic rebalance must not take it back while it runs (it rejoins when it is
    started again)."""
    await orch.store.delete(orch.prefix + "members/" + node)


async def _stop_live_node(
    orch: Orchestrator, view: ClusterView, vbmap: VBucketMap, plan: FailoverPlan
) -> tuple[int, FailoverPlan] | None:
    """Before a live node's actives are promoted elsewhere, make it stop taking writes:
    else it would go on acknowledging writes on them until it reads the new map, writes
    its successors never see. The map is first written with the plan as forward chains
    (the node stays head, the replicas go on streaming from it), the node's actives are
    set DEAD (a dead head under a forward chain stays dead: cluster/reconcile.py), the
    plan is made again from the replicas' seqnos read now (module rules), and the
    promoted replicas are given a moment to catch up with what it took until then.
    Returns the revision to write the plan on and the plan, or None (the forward chains
    withdrawn) when the node could not be made to stop."""
    node = plan.node
    actives = [vb for vb in range(vbmap.num_vbuckets) if vbmap.active(vb) == node]
    addr = view.address(node)
    if not actives:
        return view.map_revision, plan
    if addr is None:
        return None
    forward = VBucketMap.from_names(
        vbmap.num_replicas,
        [vbmap.names(vb) for vb in range(vbmap.num_vbuckets)],
        servers=vbmap.servers,
        forward=[plan.vbmap.names(vb) for vb in range(vbmap.num_vbuckets)],
    )
    revision = await orch.write_map(forward, view.map_revision)
    if revision is None:
        return None
    try:
        for _ in range(STOP_ATTEMPTS):
            # repeated: a node that had not read the forward map yet may reconcile a
            # vbucket back to active once (the map it knew still said so)
            await orch.control.set_states(addr, actives, VBucketState.DEAD)
            await trio.sleep(STOP_SETTLE)
            states = await orch.control.states(addr, actives)
            if all(states.get(vb) == VBucketState.DEAD for vb in actives):
                break
        else:
            raise ControlUnavailable(f"{node} keeps vbuckets active")
        tail = await orch.control.seqnos(addr, VBucketState.DEAD)
        others = view.live - {node}
        seqnos = await replica_seqnos(orch, view, replicas_to_ask(vbmap, node, others))
        logs = await replica_logs(orch, view, vbmap, node, seqnos)
        plan = plan_failover(vbmap, node, others, seqnos, logs)
        await _catch_up(orch, view, plan, tail)
    except ControlUnavailable as exc:
        log.warning("hard failover of live %s: %s; withdrawing the forward chains", node, exc)
        await orch.write_map(vbmap, revision)  # its heads are dead or active: reconciled
        return None
    return revision, plan


async def _catch_up(
    orch: Orchestrator, view: ClusterView, plan: FailoverPlan, tail: dict[int, int]
) -> None:
    """Wait (bounded) until each promoted replica holds what the stopped node had."""
    deadline = trio.current_time() + CATCH_UP_WAIT
    while trio.current_time() < deadline:
        behind = False
        for replica in sorted(set(plan.promoted.values())):
            addr = view.address(replica)
            if addr is None:
                continue
            have = await orch.control.seqnos(addr, VBucketState.REPLICA)
            behind |= any(
                have.get(vb, 0) < tail.get(vb, 0) for vb, r in plan.promoted.items() if r == replica
            )
        if not behind:
            return
        await trio.sleep(0.1)
    log.warning("hard failover of %s: replicas still behind after %g s", plan.node, CATCH_UP_WAIT)


async def failover_request(orch: Orchestrator, view: ClusterView, entry: Entry) -> None:
    req = await orch.take_request(entry)
    if req is None:
        return
    rid = req.get("id") if isinstance(req.get("id"), str) else None
    node = req.get("node")
    graceful = req.get("graceful", False) is True
    vbmap = view.vbmap
    assert vbmap is not None
    orch.board.set_failover(id=rid, node=node, state="running", auto=False)

    def fail(message: str) -> None:
        log.warning("failover of %s failed: %s", node, message)
        orch.board.set_failover(id=rid, node=node, state="failed", message=message)

    if not isinstance(node, str) or node not in vbmap.servers:
        return fail(f"{node!r} is not a node of the map")
    if len(vbmap.servers) == 1:
        return fail(f"{node} is the only node of the map")
    others = view.live - {node}
    if graceful:
        if node not in view.live:
            return fail(f"{node} is down: a graceful failover needs it up (use a hard one)")
        lost = orphans(vbmap, node, others)
        if lost:
            return fail(
                f"{len(lost)} vbuckets active on {node} have no live replica to hand "
                "them over to (a hard failover would leave them unavailable)"
            )
    seqnos = await replica_seqnos(orch, view, replicas_to_ask(vbmap, node, others))
    logs = await replica_logs(orch, view, vbmap, node, seqnos)
    plan = plan_failover(vbmap, node, others, seqnos, logs)
    if not graceful:
        revision = view.map_revision
        if node in view.live:
            stopped = await _stop_live_node(orch, view, vbmap, plan)
            if stopped is None:
                return fail(
                    f"{node} is up but did not stop taking writes when asked: a hard "
                    "failover now could make two actives; retry, or wait until it is down"
                )
            revision, plan = stopped
        guards = [] if node in view.live else [Guard(orch.prefix + "nodes/" + node, 0)]
        if await orch.write_map(plan.vbmap, revision, guards) is None:
            return fail("the map changed meanwhile (or the node came back): try again")
        await _remove_member(orch, node)
        message = _summary(plan)
        log.warning("hard failover: %s", message)
        orch.board.set_failover(id=rid, node=node, state="done", message=message)
        return None

    def progress(done: int, total: int) -> None:
        orch.board.set_failover(
            id=rid, node=node, state="running", message=f"{done} of {total} moves"
        )

    try:
        final, _, rolled = await orch.mover(progress).run(vbmap, view.map_revision, plan.vbmap)
    except MoveAborted as exc:
        return fail(str(exc))
    if rolled or node in final.servers:
        return fail(f"{rolled} moves did not finish: {node} still holds copies")
    await _remove_member(orch, node)
    message = f"{node} failed over gracefully: {len(plan.promoted)} vbuckets handed over"
    log.warning("%s", message)
    orch.board.set_failover(id=rid, node=node, state="done", message=message)
    return None
