"""The verifier: replays a consumer's journal against the writer's log and says where a
change was lost, invented, exposed half-done, or kept after the server lost it.

Rules of this module:
- Pure: journal operations and writer attempts in, findings out (strings, one per
  problem; the harness counts them as divergences). No trio, no sockets.
- "Truth" is what the writer was told: an acknowledged write is (vb, vb_uuid, seqno) ->
  (key, value or delete). Changes the writer cannot place (expirations, writes whose
  answer was lost) are accepted when they are plausible: the value names a write attempt
  of that key, a deletion/expiration is of a key that had one attempted.
- Per delivered snapshot of vbucket vb with end E under failover log L, after applying
  it on top of the view at the previous position P:
    a) events are in seqno order, inside [start, E] and above P, one per key, and each
       key belongs to vb;
    b) each event matches the acknowledged write at (uuid_of(seqno, L), seqno), if any;
    c) every acknowledged write on this history with P < seqno <= E is reflected: the
       key's newest change in the view has a seqno >= it (a missing one means a partial
       snapshot or a lost change);
    d) whenever L changes, no change in the view belongs to a branch L does not contain
       (a change the server lost, kept because a rollback was not surfaced or obeyed).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from dcp.protocol import codec

from .view import View, uuid_of
from .writer import Attempt, decode_value

__all__ = ["Truth", "check_server_state", "verify_journal"]


class Truth:
    def __init__(self, attempts: Iterable[Attempt], num_vbuckets: int) -> None:
        self.num_vbuckets = num_vbuckets
        self.attempts = list(attempts)
        self.acked: dict[tuple[int, int, int], Attempt] = {}
        self.by_vb: dict[int, list[tuple[int, int, int]]] = {}  # sorted (seqno, uuid, id)
        self.by_value: dict[str, Attempt] = {}
        self.ops_by_key: dict[str, set[str]] = {}
        for a in self.attempts:
            self.ops_by_key.setdefault(a.key, set()).add(a.op)
            if a.value is not None:
                self.by_value[a.value] = a
            if a.status == "acked" and a.seqno:
                self.acked[(a.vb, a.uuid, a.seqno)] = a
                self.by_vb.setdefault(a.vb, []).append((a.seqno, a.uuid, a.id))
        for lst in self.by_vb.values():
            lst.sort()

    def acked_between(self, vb: int, lo: int, hi: int) -> list[Attempt]:
        """Acknowledged writes of ``vb`` with lo < seqno <= hi (any branch)."""
        lst = self.by_vb.get(vb, [])
        i = bisect.bisect_right(lst, (lo, 1 << 64, 1 << 64))
        j = bisect.bisect_right(lst, (hi, 1 << 64, 1 << 64))
        return [self.attempts[x[2]] for x in lst[i:j]]

    def plausible(self, kind: str, key: str, value: str | None) -> str:
        """'' if the change could come from the writer, else why not."""
        if kind == "m":
            a = self.by_value.get(value or "")
            if a is None:
                dv = decode_value((value or "").encode("latin-1"))
                return f"value {value[:40] if value else value!r} was never written" + (
                    "" if dv is None else f" (claims key {dv[0]} version {dv[1]})"
                )
            if a.key != key:
                return f"value of key {a.key} delivered under key {key}"
            return ""
        ops = self.ops_by_key.get(key, set())
        if kind == "d" and "del" not in ops:
            return f"deletion of {key}, which was never deleted"
        if kind == "x" and "exp" not in ops:
            return f"expiration of {key}, which never had an expiry"
        return ""


def _matches(a: Attempt, kind: str, key: str, value: str | None) -> bool:
    if a.key != key:
        return False
    if a.op == "del":
        return kind == "d"
    return kind == "m" and value == a.value


class _Checker:
    def __init__(self, name: str, truth: Truth, max_findings: int) -> None:
        self.name = name
        self.truth = truth
        self.view = View()
        self.findings: list[str] = []
        self.max_findings = max_findings
        self.counts = {
            "groups": 0,
            "batches": 0,
            "events": 0,
            "rollbacks": 0,
            "cuts": 0,
            "disk_snapshots": 0,
            "memory_snapshots": 0,
            "checked_writes": 0,
        }

    def find(self, msg: str) -> None:
        if len(self.findings) < self.max_findings:
            self.findings.append(f"{self.name}: {msg}")
        elif len(self.findings) == self.max_findings:
            self.findings.append(f"{self.name}: ... more findings suppressed")

    def op(self, op: list[Any]) -> None:
        kind, vb = op[0], op[1]
        v = self.view.vb(vb)
        if kind == "t":
            self.counts["cuts"] += 1
        elif kind == "r":
            self.counts["rollbacks"] += 1
            if op[2] > max(v.end, op[3]):
                self.find(f"vb {vb}: rollback to {op[2]} above the position {v.end}")
        elif kind == "b":
            self.batch(op)
            return
        self.view.apply_op(op)

    def batch(self, op: list[Any]) -> None:
        _, vb, start, end, flags, log, events = op
        truth = self.truth
        v = self.view.vb(vb)
        prev = v.end
        self.counts["batches"] += 1
        self.counts["events"] += len(events)
        self.counts["disk_snapshots" if flags & 0x02 else "memory_snapshots"] += 1
        where = f"vb {vb} snapshot [{start},{end}] after {prev}"
        if end < start or end < prev:
            self.find(f"{where}: end goes backwards")
        last = prev
        seen: set[str] = set()
        for seqno, ek, key, value in events:
            if not (start <= seqno <= end) or seqno <= last:
                self.find(f"{where}: event seqno {seqno} out of order or range (after {last})")
            last = max(last, seqno)
            if key in seen and not flags & 0x10:
                self.find(f"{where}: key {key} twice in one snapshot")
            seen.add(key)
            if codec.vbucket_for_key(key.encode("latin-1"), truth.num_vbuckets) != vb:
                self.find(f"{where}: key {key} does not belong to vb {vb}")
            why = truth.plausible(ek, key, value)
            if why:
                self.find(f"{where}: invented change at {seqno}: {why}")
            a = truth.acked.get((vb, uuid_of(seqno, log) or 0, seqno))
            if a is not None and not _matches(a, ek, key, value):
                self.find(
                    f"{where}: seqno {seqno} is {ek}:{key} but the server acknowledged "
                    f"{a.op}:{a.key} v{a.version} there"
                )
        log_changed = log != v.log
        self.view.apply_op(op)
        for a in truth.acked_between(vb, prev, end):
            if uuid_of(a.seqno, log) != a.uuid:
                continue  # that write was on another branch (lost, or not this history)
            self.counts["checked_writes"] += 1
            cur = v.latest(a.key)
            if cur is None or cur[0] < a.seqno:
                self.find(
                    f"{where}: missing {a.op}:{a.key} v{a.version} acknowledged at "
                    f"seqno {a.seqno} (view has "
                    f"{'nothing' if cur is None else f'seqno {cur[0]}'}): "
                    f"{'partial snapshot' if start <= a.seqno else 'lost change'}"
                )
        if log_changed:
            self.check_branches(vb, log)

    def check_branches(self, vb: int, log: list[list[int]]) -> None:
        v = self.view.vb(vb)
        oldest = log[-1][1] if log else 0
        for seqno, uuid, key, _value in v.changes:
            if seqno <= oldest or uuid is None:
                continue
            owner = uuid_of(seqno, log)
            if owner != uuid:
                self.find(
                    f"vb {vb}: view keeps {key} at seqno {seqno} from branch {uuid}, "
                    f"which the server's log {log[:3]}... does not contain there "
                    f"(a change the server lost; rollback not surfaced or not obeyed)"
                )


def verify_journal(
    name: str, groups: Iterable[list[list[Any]]], truth: Truth, max_findings: int = 50
) -> tuple[View, list[str], dict[str, int]]:
    """Replay ``groups`` with every check; returns (final view, findings, counts)."""
    c = _Checker(name, truth, max_findings)
    for group in groups:
        c.counts["groups"] += 1
        for op in group:
            c.op(op)
    for vb, v in c.view.vbs.items():
        c.check_branches(vb, v.log)
    return c.view, c.findings, c.counts


def check_server_state(
    state: dict[str, str], truth: Truth, *, final_epoch: int, now: float
) -> list[str]:
    """The server's final documents against the writer's log: nothing invented, every
    acknowledged durable write kept, and every write acknowledged in the last server
    incarnation (no crash after it) is the key's final state."""
    out: list[str] = []
    for key, value in state.items():
        why = truth.plausible("m", key, value)
        if why:
            out.append(f"server: {key} holds an invented value: {why}")
    last_durable: dict[str, Attempt] = {}
    last: dict[str, Attempt] = {}
    later_removal: dict[str, int] = {}
    for a in truth.attempts:
        last[a.key] = a
        if a.status == "acked" and a.durable:
            last_durable[a.key] = a
    for key, d in last_durable.items():
        cur = state.get(key)
        removals = [
            a.version
            for a in truth.attempts
            if a.key == key and a.version >= d.version and a.op in ("del", "exp")
        ]
        later_removal[key] = max(removals) if removals else 0
        if cur is None:
            if not removals:
                out.append(
                    f"server: durable {d.op}:{key} v{d.version} (seqno {d.seqno}) "
                    f"lost: the key is gone and no later delete/expiry was tried"
                )
            continue
        a = truth.by_value.get(cur)
        if a is not None and a.version < d.version:
            out.append(
                f"server: durable write {key} v{d.version} (seqno {d.seqno}) lost: "
                f"the key holds the older v{a.version}"
            )
    for key, a in last.items():
        if a.status != "acked" or a.sent_epoch != final_epoch:
            continue
        cur = state.get(key)
        if a.op == "set" and cur != a.value:
            out.append(
                f"server: {key} should hold v{a.version} (acknowledged at seqno "
                f"{a.seqno}, no crash since) but holds {cur[:30] if cur else cur!r}"
            )
        elif a.op == "del" and cur is not None:
            out.append(
                f"server: {key} was deleted at seqno {a.seqno} (no crash since) but "
                f"holds {cur[:30]}"
            )
        elif a.op == "exp" and cur is not None and a.expires_at + 2.0 < now:
            out.append(f"server: {key} expired (v{a.version}) but still holds {cur[:30]}")
    return out
