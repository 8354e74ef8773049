"""The ``failover`` scenario's own checks: acknowledged writes lost per durability level,
and writes that prove two nodes accepted writes for one vbucket at once.

Rules of this module:
- Pure: the writers' attempts (``failover_writer.LevelAttempt``), the final documents and
  the failover logs seen in, counts and findings out. No trio, no sockets.
- A write is *kept* when the final state holds it or a later write of its key: the key's
  value is of that version or a later one, or the key is absent and the write was a
  delete or a later delete was tried and not refused. Lost writes are counted per level;
  a lost write at a majority level is a finding, at none/persistActive only a figure.
- Epoch checks, on acknowledged writes only, with the harness's clock (send time a lower
  bound, ack time an upper bound, so a finding is a proof):
    a) one branch, one writer: two acks on one (vb, uuid) at one seqno, or a write SENT
       after another write of that branch was ACKED that got a seqno no higher — both
       mean two nodes assigned seqnos on that branch at the same time (a takeover hands
       the branch over with its seqnos, so sequential owners never do this);
    b) an old branch after a newer one: a write acked on uuid U that was SENT after a
       write on a branch newer than U (placed after U in some failover log seen) had
       been ACKED — the old active still accepted writes after its successor did.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence

from .failover_writer import LEVELS, MAJORITY_LEVELS, LevelAttempt
from .writer import decode_value

__all__ = ["epoch_violations", "kept", "level_counts", "newer_branches"]


def kept(a: LevelAttempt, state: Mapping[str, str], later_deletes: Mapping[str, int]) -> bool:
    """Whether ``state`` holds ``a`` or a later write of its key (module rules);
    ``later_deletes``: per key the highest version of a delete that was not refused."""
    cur = state.get(a.key)
    if cur is None:
        return a.op == "del" or later_deletes.get(a.key, 0) > a.version
    got = decode_value(cur.encode("latin-1"))
    return got is not None and got[1] >= a.version


def level_counts(
    attempts: Iterable[LevelAttempt], state: Mapping[str, str], max_findings: int = 50
) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Per level: attempts, acked, ambiguous, impossible, error, notfound and lost; and a
    finding per lost write at a majority level."""
    atts = list(attempts)
    later_deletes: dict[str, int] = {}
    for a in atts:
        if a.op == "del" and a.status != "rejected":
            later_deletes[a.key] = max(later_deletes.get(a.key, 0), a.version)
    counts = {
        lv: dict.fromkeys(
            ("attempts", "acked", "ambiguous", "impossible", "error", "notfound", "lost"), 0
        )
        for lv in LEVELS
    }
    findings: list[str] = []
    for a in atts:
        c = counts.setdefault(a.level, dict.fromkeys(counts["none"], 0))
        c["attempts"] += 1
        c["acked" if a.outcome == "ok" else a.outcome] += 1
        if a.outcome == "ok" and not kept(a, state, later_deletes):
            c["lost"] += 1
            if a.level in MAJORITY_LEVELS and len(findings) < max_findings:
                cur = state.get(a.key)
                findings.append(
                    f"lost: {a.op}:{a.key} v{a.version} acknowledged at {a.level} "
                    f"(vb {a.vb} uuid {a.uuid} seqno {a.seqno}, node {a.node}); the final "
                    f"state holds {cur[:30] if cur else 'nothing'}"
                )
    return counts, findings


def newer_branches(logs: Iterable[Sequence[Sequence[int]]]) -> dict[int, set[int]]:
    """uuid -> the uuids placed newer than it in some failover log (newest first)."""
    out: dict[int, set[int]] = {}
    for log in logs:
        uuids = [int(e[0]) for e in log]
        for i, u in enumerate(uuids):
            out.setdefault(u, set()).update(x for x in uuids[:i] if x != u)
    return out


def epoch_violations(
    attempts: Iterable[LevelAttempt],
    logs_by_vb: Mapping[int, Iterable[Sequence[Sequence[int]]]],
    max_findings: int = 50,
) -> tuple[list[str], dict[str, int]]:
    """Checks a) and b) of the module rules: (findings, figures)."""
    acked: dict[int, list[LevelAttempt]] = {}
    for a in attempts:
        if a.outcome == "ok" and a.seqno:
            acked.setdefault(a.vb, []).append(a)
    findings: list[str] = []
    figures = {"branches": 0, "branches_on_several_nodes": 0, "acked_checked": 0}

    def find(msg: str) -> None:
        if len(findings) < max_findings:
            findings.append(msg)

    for vb, writes in sorted(acked.items()):
        figures["acked_checked"] += len(writes)
        by_uuid: dict[int, list[LevelAttempt]] = {}
        for a in writes:
            by_uuid.setdefault(a.uuid, []).append(a)
        figures["branches"] += len(by_uuid)
        first_ack: dict[int, LevelAttempt] = {}
        for uuid, ws in by_uuid.items():
            if len({a.node for a in ws if a.node}) > 1:
                figures["branches_on_several_nodes"] += 1
            first_ack[uuid] = min(ws, key=lambda a: a.t_acked)
            seen: dict[int, LevelAttempt] = {}
            for a in ws:
                b = seen.setdefault(a.seqno, a)
                if b is not a:
                    find(
                        f"vb {vb} uuid {uuid}: seqno {a.seqno} acknowledged for two writes: "
                        f"{b.key} v{b.version} (node {b.node}) and {a.key} v{a.version} "
                        f"(node {a.node})"
                    )
            # a write sent after the ack of another on this branch must get a higher seqno:
            # sweep the writes by send time, keeping the highest seqno acked before it
            by_ack = sorted(ws, key=lambda a: a.t_acked)
            ack_times = [a.t_acked for a in by_ack]
            best: list[LevelAttempt] = []
            for a in by_ack:
                best.append(a if not best or a.seqno > best[-1].seqno else best[-1])
            for a in ws:
                i = bisect.bisect_left(ack_times, a.t_sent)
                if i and best[i - 1].seqno >= a.seqno:
                    p = best[i - 1]
                    find(
                        f"vb {vb} uuid {uuid}: {a.key} v{a.version} got seqno {a.seqno} from "
                        f"{a.node}, sent after {p.key} v{p.version} had been acked at seqno "
                        f"{p.seqno} by {p.node}: two nodes took writes on one branch at once"
                    )
        newer = newer_branches(logs_by_vb.get(vb, []))
        for uuid, ws in by_uuid.items():
            later = [first_ack[u] for u in newer.get(uuid, ()) if u in first_ack]
            if not later:
                continue
            first = min(later, key=lambda a: a.t_acked)
            for a in ws:
                if a.t_sent > first.t_acked:
                    find(
                        f"vb {vb}: {a.key} v{a.version} acked on branch {uuid} by {a.node} "
                        f"(seqno {a.seqno}) was sent {a.t_sent - first.t_acked:.3f} s after "
                        f"{first.key} v{first.version} had been acked on the newer branch "
                        f"{first.uuid} by {first.node}: the old active still took writes"
                    )
    return findings, figures
