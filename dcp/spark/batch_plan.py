"""How a batch is planned, as pure decisions: rollback checks, snapshot-aligned end
offsets, the per-vbucket ranges and their grouping into tasks.

Rules of this module:
- No I/O, no clock, no Spark: every function takes what the server said (high seqnos,
  failover logs) and what the planner has observed, and returns a decision. The
  stateful driver-side ``Planner`` (``driver.py``) and the tests drive these.
- An end offset is only ever a seqno the server presented as a snapshot boundary: a high
  seqno returned by GET_ALL_VB_SEQNOS (the server closes each vbucket's open checkpoint
  when it answers, so later writes cannot be deduplicated into it). The planner remembers
  the boundaries it saw, and a row limit cuts at the largest remembered boundary within
  budget; at least one boundary is taken per batch so a stream always progresses.
- Stable-only (``stable`` given): an end is also at or below the vbucket's stable seqno,
  so no batch ends where a single node failure could roll it back: the largest observed
  boundary (or target) at or below it, else nothing for that vbucket yet. The stable
  seqno itself is not taken as an end: it need not be a boundary of the stream a task
  reads (a snapshot across it makes the range merged), and it becomes one as soon as a
  later high seqno at or below it has been observed.
- A rewind goes back to a change-set boundary the sink has: the rollback seqno only when
  it is one (the start of the change set that ended at the position, ``p``), else that
  start when it is below the rollback seqno, else 0 (``rewind_point``). Rows delivered
  before get a lower ``position`` (the rollback generation ``g`` is its high part).
- The rollback rule is the server's (``protocol_spec/README.md`` section 8) for a
  zero-width snapshot ``S = SS = SE``: find the uuid in the failover log (newest
  first); *upper* is the next newer entry's seqno, or the high seqno; the position is
  on history iff ``S <= upper``, else the rollback seqno is ``upper``; an unknown uuid
  rolls back to 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dcp.protocol.cluster_config import Address

from .errors import OffsetError, RangeUnavailableError, RollbackDetectedError
from .offsets import Offsets, VbPosition

__all__ = [
    "FailoverLog",
    "VbRange",
    "branch_uuid",
    "group_by_node",
    "group_ranges",
    "plan_end",
    "plan_ranges",
    "rewind_point",
    "rollback_seqno",
]

FailoverLog = Sequence[tuple[int, int]]  # (uuid, seqno), newest first


@dataclass(frozen=True, slots=True)
class VbRange:
    """One vbucket's share of a batch: the changes in ``(start, end]``, requested with
    ``uuid`` (the start's branch) and planned on branch ``end_uuid`` (0 = not checked);
    ``rollback`` (if set) means "emit a rollback to this seqno" and nothing else.
    ``prev`` is the start of the change set that ended at ``start`` (None: unknown; where
    a rollback found while reading rewinds to), ``gen`` the rollback generation of the
    rows (a rollback found while reading starts generation ``gen + 1``)."""

    vbucket: int
    uuid: int
    start: int
    end: int
    rollback: int | None = None
    end_uuid: int = 0
    prev: int | None = None
    gen: int = 0

    @property
    def weight(self) -> int:
        return max(1, self.end - self.start)


def rollback_seqno(pos: VbPosition, log: FailoverLog, high: int) -> int | None:
    """Where the server would roll ``pos`` back to, or None when it is on history."""
    s = pos.seqno
    if s == 0:
        return None
    if pos.uuid == 0:
        # A position given without uuid ("seqno N of whatever branch is current"):
        # accepted as long as the vbucket has reached it.
        return None if s <= high else high
    upper = None
    for i, (uuid, _seq) in enumerate(log):
        if uuid == pos.uuid:
            upper = log[i - 1][1] if i > 0 else high
            break
    if upper is None:
        return 0
    return None if s <= upper else upper


def rewind_point(seqno: int, prev: int | None, rollback: int) -> int:
    """Where a query whose vbucket stands at ``seqno`` (the change set ``(prev, seqno]``
    delivered last) re-reads from after the server rolled back to ``rollback``.

    The sink holds change sets: within one, only the newest version of each key. Undoing
    its rows above ``rollback`` would lose the versions at or below ``rollback`` that the
    set had deduplicated away, so the re-read starts at a change-set boundary at or below
    ``rollback``: ``seqno`` itself when the rollback does not reach it, ``prev`` when the
    rollback is inside the last change set, else 0 (the earlier boundaries are not kept).
    Unknown ``prev`` (offsets given by the user or written by an older version): the
    rollback seqno, the best available.
    """
    if rollback >= seqno:
        return seqno
    if prev is None:
        return rollback
    return prev if prev <= rollback else 0


def branch_uuid(log: FailoverLog, seqno: int) -> int:
    """The uuid of the history branch that holds ``seqno`` (newest entry at or below it)."""
    for uuid, seq in log:
        if seq <= seqno:
            return uuid
    return log[-1][0] if log else 0


def _budget_ends(
    start: Offsets, options: Mapping[int, list[int]], limit: int | None
) -> dict[int, int]:
    """Per vbucket, the chosen boundary. ``options[vb]`` are ascending candidate ends
    (all > start). With a limit, vbuckets advance one boundary at a time, round robin,
    while the seqno budget lasts; the first step is always taken."""
    chosen: dict[int, int] = {}
    if limit is None:
        return {vb: c[-1] for vb, c in options.items() if c}
    used = 0
    idx = dict.fromkeys(options, 0)
    progressed = True
    while progressed:
        progressed = False
        for vb in sorted(options):
            cands = options[vb]
            i = idx[vb]
            if i >= len(cands):
                continue
            prev = chosen.get(vb, start[vb].seqno)
            cost = cands[i] - prev
            if chosen and used + cost > limit:
                continue
            chosen[vb] = cands[i]
            idx[vb] = i + 1
            used += cost
            progressed = True
    return chosen


def plan_end(
    start: Offsets,
    highs: Mapping[int, int],
    logs: Mapping[int, FailoverLog],
    boundaries: Mapping[int, Sequence[int]],
    *,
    limit: int | None = None,
    target: Mapping[int, int] | None = None,
    on_rollback: str = "fail",
    floor: Mapping[int, int] | None = None,
    stable: Mapping[int, int] | None = None,
) -> Offsets:
    """The end offset of the next batch (``start`` itself when there is nothing new).

    Args:
        start: the batch's start offset.
        highs: the server's high seqno per vbucket (just observed: a boundary).
        logs: failover logs, at least of every vbucket whose position is checked.
        boundaries: earlier observed boundaries per vbucket (ascending; may be empty).
        limit: seqno budget of the batch (``maxRowsPerBatch``), None = no bound.
        target: availableNow: never plan past these seqnos.
        on_rollback: "fail" raises ``RollbackDetectedError``; "rewind" ends the vbucket
            at the rollback seqno with the rollback mark.
        floor: rewind at least this low (per vbucket): the start of the previous batch,
            whose executors may have found the branch gone and delivered nothing past
            it. Rewinding lower than needed only repeats changes after an explicit
            rollback row; rewinding higher would lose them.
        stable: stable-only: never end above these seqnos (see the module rules).
    """
    end: Offsets = dict(start)
    options: dict[int, list[int]] = {}
    for vb, pos in start.items():
        if vb not in highs:
            raise RangeUnavailableError(
                f"vbucket {vb} is not served by the server any more (GET_ALL_VB_SEQNOS does "
                f"not list it); was the server restarted with fewer vbuckets?"
            )
        high = highs[vb]
        log = logs.get(vb, ())
        if pos.seqno and (pos.uuid or pos.seqno > high):
            r = rollback_seqno(pos, log, high)
            if r is not None:
                if on_rollback != "rewind":
                    detail = f"Server failover log (uuid, seqno), newest first: {list(log)}."
                    ahead = pos.uuid in (0, log[0][0] if log else 0) and r == high
                    raise RollbackDetectedError(
                        vb, pos.uuid, pos.seqno, r, "planning", detail, ahead=ahead
                    )
                x = rewind_point(pos.seqno, pos.prev, r)
                if floor is not None and vb in floor:
                    x = min(x, floor[vb])
                end[vb] = VbPosition(branch_uuid(log, x), x, x, x, pos.gen + 1)
                continue
        cap = high if target is None else min(high, target.get(vb, high))
        cands = [b for b in boundaries.get(vb, ()) if pos.seqno < b < cap]
        if cap > pos.seqno:
            cands.append(cap)
        if stable is not None:
            top = stable.get(vb, 0)
            cands = [c for c in cands if c <= top]
        if cands:
            options[vb] = cands
    for vb, e in _budget_ends(start, options, limit).items():
        s = start[vb]
        end[vb] = VbPosition(branch_uuid(logs.get(vb, ()), e), e, None, s.seqno, s.gen)
    return end


def plan_ranges(start: Offsets, end: Offsets) -> list[VbRange]:
    """The per-vbucket ranges of batch ``(start, end]`` (vbuckets without change skipped).

    Raises:
        OffsetError: the offsets name different vbuckets, or an end is below its start
            without a rollback mark (Spark would otherwise run an empty batch: data loss).
    """
    if set(start) != set(end):
        raise OffsetError(
            f"start and end offsets name different vbuckets: {sorted(set(start) ^ set(end))}"
        )
    out: list[VbRange] = []
    for vb in sorted(end):
        s, e = start[vb], end[vb]
        if s == e:
            continue
        if e.rollback is not None:
            r = e.rollback
            out.append(VbRange(vb, e.uuid, r, r, r, e.uuid, r, e.gen))
            continue
        if e.seqno < s.seqno:
            raise OffsetError(
                f"vbucket {vb}: end seqno {e.seqno} is below start seqno "
                f"{s.seqno} without a rollback; refusing to plan an empty range"
            )
        if e.seqno == s.seqno:
            continue  # uuid learned, nothing to read
        out.append(VbRange(vb, s.uuid or e.uuid, s.seqno, e.seqno, None, e.uuid, s.prev, e.gen))
    return out


def group_ranges(ranges: Sequence[VbRange], n: int) -> list[list[VbRange]]:
    """Spread ranges over at most ``n`` groups of similar weight (largest first into the
    lightest group); deterministic; each group sorted by vbucket."""
    n = max(1, min(n, len(ranges)))
    groups: list[list[VbRange]] = [[] for _ in range(n)]
    loads = [0] * n
    for r in sorted(ranges, key=lambda r: (-r.weight, r.vbucket)):
        i = min(range(n), key=lambda j: (loads[j], j))
        groups[i].append(r)
        loads[i] += r.weight
    return [sorted(g, key=lambda r: r.vbucket) for g in groups if g]


def group_by_node(
    ranges: Sequence[VbRange], owners: Mapping[int, Address] | None, n: int
) -> list[tuple[Address | None, list[VbRange]]]:
    """Tasks for a batch: ``(node, ranges)`` where every range of a task is on ``node``.

    ``owners`` (vbucket -> node holding it active) None: a single server, grouped as
    ``group_ranges`` does (node None). Otherwise the ranges are grouped per node, and
    the ``n`` tasks shared among the nodes by weight (largest remainder; at least one
    per node with ranges, so there may be more than ``n`` when nodes outnumber it), then
    each node's ranges are spread over its share like ``group_ranges``. Deterministic:
    nodes in address order.
    """
    if owners is None:
        return [(None, g) for g in group_ranges(ranges, n)] if ranges else []
    per: dict[Address, list[VbRange]] = {}
    for r in ranges:
        per.setdefault(owners[r.vbucket], []).append(r)
    nodes = sorted(per)
    weights = {a: sum(r.weight for r in per[a]) for a in nodes}
    total = sum(weights.values()) or 1
    exact = {a: max(1, n) * weights[a] / total for a in nodes}
    share = {a: max(1, int(exact[a])) for a in nodes}
    for a in sorted(nodes, key=lambda a: (-(exact[a] - int(exact[a])), a)):
        if sum(share.values()) >= n:
            break
        share[a] += 1
    return [(a, g) for a in nodes for g in group_ranges(per[a], share[a])]
