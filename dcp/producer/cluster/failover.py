"""Failover decisions: which replica to promote, and when an automatic failover must
be refused.

Rules of this module:
- Pure: the orchestrator (cluster/orchestrator.py) gathers the facts (the map, who is
  live, each live replica's seqnos) and writes what is decided here.
- The replica promoted is the live one with the highest seqno for the vbucket (the one
  that lost the fewest acknowledged writes, so it holds every write answered at
  MAJORITY: a majority of the chain held it, so at least one live replica does). That
  holds because the seqnos are read after the failed node's lease expired and its
  durability monitor counts only acks that reached it while its lease was sure
  (dcp/producer/durability.py): a replica that acks later, to an active resumed
  before it read the new map, holds more than it was read at, and that surplus is
  counted nowhere. A live node failed over by hand is first made to stop (its actives
  dead) and the seqnos read again (cluster/failover_ops.py). A replica whose seqnos
  could not be read ranks below every one that answered, and one that answered without
  the vbucket in replica state is no candidate at all (it holds no copy). Ties go to
  the newest branch first (a copy whose newest branch another tied copy lists as an
  older one is passed over: promoting it would make the newer copies roll back), then
  to chain order. Excluding those loses nothing counted: acks go only on plain replica
  streams (replication/acks.py), and a copy left pending by a takeover is settled back
  to replica before any failover (the orchestrator resumes moves in flight first,
  cluster/orchestrator.py).
- A seqno counts only on the branch of history the failed active wrote (``valid_seqno``,
  from the candidates' failover logs): a replica whose newest branch another candidate
  knows as an older one (a former active rejoined as a replica, not yet rolled back)
  holds seqnos above that branch's end that are not this history; they count no higher
  than that end. Else a stale copy with a higher seqno would be promoted and the
  writes the others acknowledged rolled back. The
  other replicas stay in the chain after it, the failed node's slots become empty (-1)
  and the node leaves the server list: the map no longer counts on it, and it is not
  reported down.
- A vbucket active on the failed node with no live replica is left without an active
  copy (unavailable) by a hard failover; an automatic one is refused instead
  (``auto_refusal``), as are automatic failovers while two or more map nodes are down
  or once the count of automatic failovers has reached its maximum.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from .vbmap import VBucketMap

__all__ = [
    "FailoverPlan",
    "auto_refusal",
    "orphans",
    "plan_failover",
    "replicas_to_ask",
    "valid_seqno",
]

#: a vbucket's failover log, newest first: (vb uuid, seqno its branch starts at)
Log = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class FailoverPlan:
    node: str
    vbmap: VBucketMap
    #: vb -> the replica promoted to active
    promoted: dict[int, str]
    #: vbuckets left without an active copy
    unavailable: list[int]


def orphans(vbmap: VBucketMap, node: str, live: Collection[str]) -> list[int]:
    """The vbuckets active on ``node`` that have no live replica elsewhere."""
    return [
        vb
        for vb in range(vbmap.num_vbuckets)
        if vbmap.active(vb) == node and not any(r in live for r in vbmap.replicas(vb))
    ]


def replicas_to_ask(vbmap: VBucketMap, node: str, live: Collection[str]) -> set[str]:
    """The live replicas of ``node``'s active vbuckets: whose seqnos decide."""
    return {
        r
        for vb in range(vbmap.num_vbuckets)
        if vbmap.active(vb) == node
        for r in vbmap.replicas(vb)
        if r in live and r != node
    }


def plan_failover(
    vbmap: VBucketMap,
    node: str,
    live: Collection[str],
    seqnos: Mapping[str, Mapping[int, int]],
    logs: Mapping[str, Mapping[int, Log]] | None = None,
) -> FailoverPlan:
    """The map with ``node`` failed over (see the module rules). ``seqnos``: per live
    replica, its replica vbuckets' high seqnos (a replica missing here ranks last);
    ``logs``: per live replica, the failover logs of those vbuckets (a log missing is
    taken as on the newest branch)."""
    logs = logs or {}
    width = vbmap.num_replicas + 1
    chains: list[list[str | None]] = []
    promoted: dict[int, str] = {}
    unavailable: list[int] = []
    for vb in range(vbmap.num_vbuckets):
        names = list(vbmap.names(vb))
        active, replicas = names[0], [r for r in names[1:] if r is not None and r != node]
        if active == node:
            # a replica that answered without this vbucket in replica state has no copy
            # to promote (dead, or not built yet): it is no candidate
            candidates = [
                r
                for r in replicas
                if r in live and r != node and (r not in seqnos or vb in seqnos[r])
            ]
            if candidates:
                highs = {r: seqnos.get(r, {}).get(vb, -1) for r in candidates}
                found = {r: logs[r][vb] for r in candidates if vb in logs.get(r, {})}
                valid = {
                    r: valid_seqno(highs[r], found[r], [(highs[o], found[o]) for o in found])
                    if r in found
                    else highs[r]
                    for r in candidates
                }
                older = _behind(candidates, valid, found)
                best = max(
                    candidates, key=lambda r: (valid[r], r not in older, -candidates.index(r))
                )
                promoted[vb] = best
                chain: list[str | None] = [best, *(r for r in replicas if r != best)]
            else:
                unavailable.append(vb)
                chain = [None, *replicas]
        else:
            chain = [active, *replicas]
        chains.append(chain + [None] * (width - len(chain)))
    servers = [s for s in vbmap.servers if s != node]
    if not servers:  # a map of no node serves nothing: refused, not written
        raise ValueError(f"failing over {node} would leave no node in the map")
    new = VBucketMap.from_names(vbmap.num_replicas, chains, servers=servers)
    return FailoverPlan(node, new, promoted, unavailable)


def valid_seqno(high: int, log: Log, others: Sequence[tuple[int, Log]]) -> int:
    """How much of a copy at ``high`` with failover log ``log`` is on the newest branch
    known to the copies ``others`` ((high, log) each): ``high``, unless another copy's
    log lists this one's newest branch as an older one, then no more than the seqno its
    next branch starts at. A branch that begins at or above a copy's own high seqno
    (the entry a restart adds) holds none of that copy's data, so it proves nothing
    and is skipped."""
    mine = _live_branches(high, log)
    if not mine:
        return high
    valid = high
    for other_high, other_log in others:
        theirs = _live_branches(other_high, other_log)
        if mine[0] in theirs[1:]:
            valid = min(valid, theirs[theirs.index(mine[0]) - 1][1])
    return valid


def _behind(
    candidates: Sequence[str], valid: Mapping[str, int], logs: Mapping[str, Log]
) -> set[str]:
    """The candidates whose newest branch another candidate with the same valid seqno
    lists as an older one (its whole log, restart entries included). Promoting such a
    copy makes every copy on the newer branch roll back (the new active does not know
    their branch), for no seqno gained; so ties go to the newest branch first."""
    out = set()
    for r in candidates:
        mine = logs.get(r)
        if not mine:
            continue
        newest = (int(mine[0][0]), int(mine[0][1]))
        for o in candidates:
            theirs = logs.get(o)
            if o == r or valid[o] != valid[r] or not theirs:
                continue
            if newest in [(int(u), int(s)) for u, s in theirs[1:]]:
                out.add(r)
                break
    return out


def _live_branches(high: int, log: Log) -> list[tuple[int, int]]:
    """``log`` without the newest entries that start at or above ``high``."""
    entries = [(int(u), int(s)) for u, s in log]
    while len(entries) > 1 and entries[0][1] >= high:
        entries.pop(0)
    return entries


def auto_refusal(
    vbmap: VBucketMap,
    node: str,
    down: Collection[str],
    live: Collection[str],
    count: int,
    max_count: int,
) -> str | None:
    """Why an automatic failover of ``node`` must not happen now, or None."""
    if len(down) >= 2:
        return (
            f"{len(down)} nodes are down ({', '.join(sorted(down))}): no automatic "
            "failover while more than one is"
        )
    if count >= max_count:
        return (
            f"automatic failovers used: {count} of {max_count}; reset the count "
            "(dcpctl cluster reset-autofailover) to allow another"
        )
    lost = orphans(vbmap, node, live)
    if lost:
        shown = ", ".join(map(str, lost[:8])) + (" ..." if len(lost) > 8 else "")
        return (
            f"{len(lost)} vbuckets active on {node} have no live replica ({shown}): "
            "failing it over would leave them without an active copy"
        )
    return None
