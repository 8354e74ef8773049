"""Offline consistency check of a data directory: what warm-up and backfills rely on.

Rules of this module:
- Read-only, through ``OfflineStore``; one pass over each vbucket's records.
- A *problem* is a broken invariant, reported as one line naming the vbucket; any
  problem makes ``dcpctl inspect DIR check`` exit 1. A *note* is worth knowing but legal
  (superseded versions kept by the history window, no clean-shutdown marker).
- Invariants checked, per vbucket:
  state record: present, decodable, a known state; failover log non-empty, newest first
  (seqnos never rising), uuids non-zero and distinct, newest entry <= persisted high
  seqno; snap_start <= snap_end <= high seqno; purge seqno <= high seqno; history start
  <= high seqno + 1.
  records: the LMDB key names this vbucket and the record's own seqno; seqnos strictly
  increase; the op is a mutation, deletion or expiration; the key is non-empty and
  inside the record; the record matches its CRC-32C checksum (records.py: a byte changed
  on disk after it was written; the server refuses to serve such a record); the record
  decodes; a key's versions have rising rev seqnos (its
  latest seqno is its newest version); no record above the persisted high seqno; no
  CAS above the persisted max CAS.
- At most ``MAX_PER_VBUCKET`` problems are listed per vbucket, then a count.
"""

from __future__ import annotations

from typing import Any

from ..producer.engine.item import ItemOp
from ..producer.engine.records import VBStateRecord, decode_item, record_intact
from ..protocol.opcodes import VBucketState
from .store_reader import DamagedRecord, OfflineStore, Snapshot

__all__ = ["MAX_PER_VBUCKET", "check_store"]

MAX_PER_VBUCKET = 20
_OPS = frozenset(int(op) for op in ItemOp)
_STATES = frozenset(int(s) for s in VBucketState)


def _check_state(rec: VBStateRecord) -> list[str]:
    p = []
    if rec.state not in _STATES:
        p.append(f"unknown vbucket state {rec.state}")
    log = rec.failover
    if not log:
        p.append("empty failover log")
    uuids = [u for u, _ in log]
    if any(u == 0 for u in uuids):
        p.append("failover log has a zero vb_uuid")
    if len(set(uuids)) != len(uuids):
        p.append("failover log has a repeated vb_uuid")
    for i in range(len(log) - 1):
        if log[i][1] < log[i + 1][1]:
            p.append(
                f"failover log not newest first: entry {i} at seqno {log[i][1]} is "
                f"older than entry {i + 1} at seqno {log[i + 1][1]}"
            )
            break
    if log and log[0][1] > rec.high_seqno:
        p.append(
            f"newest failover entry at seqno {log[0][1]} is above the persisted high "
            f"seqno {rec.high_seqno}"
        )
    if not rec.snap_start <= rec.snap_end <= rec.high_seqno:
        p.append(
            f"persisted snapshot {rec.snap_start}..{rec.snap_end} does not end at or "
            f"below the high seqno {rec.high_seqno}"
        )
    if rec.purge_seqno > rec.high_seqno:
        p.append(f"purge seqno {rec.purge_seqno} is above the high seqno {rec.high_seqno}")
    if rec.history_start > rec.high_seqno + 1:
        p.append(
            f"history start {rec.history_start} is above high seqno + 1 ({rec.high_seqno + 1})"
        )
    return p


def _check_records(
    snap: Snapshot, vb: int, rec: VBStateRecord | None, p: list[str]
) -> tuple[int, int]:
    """Scan ``vb``'s records into ``p``; returns (records, superseded versions)."""
    last = 0
    n = 0
    superseded = 0
    newest: dict[bytes, tuple[int, int]] = {}
    cas_over = 0
    max_cas = rec.max_cas if rec is not None else 0
    try:
        for r in snap.records(vb):
            n += 1
            s = r.key_seqno
            if r.key_vb != vb:
                p.append(f"record at seqno {s} is keyed for vbucket {r.key_vb}")
            if r.seqno != s:
                p.append(f"record keyed at seqno {s} says it is seqno {r.seqno}")
            if s <= last:
                p.append(f"seqnos not strictly increasing: {s} after {last}")
            last = max(last, s)
            if r.op not in _OPS:
                p.append(f"record at seqno {s} has unknown op 0x{r.op:02x}")
            if not record_intact(r.raw):
                p.append(
                    f"record at seqno {s} (key {r.key[:64]!r}) fails its checksum: "
                    "its bytes changed on disk after they were written"
                )
            if not r.key_len or len(r.key) != r.key_len:
                p.append(
                    f"record at seqno {s} has a key of {r.key_len} bytes but holds {len(r.key)}"
                )
            else:
                try:
                    decode_item(vb, r.raw)
                except Exception as exc:  # struct.error, IndexError: damaged bytes
                    p.append(f"record at seqno {s} does not decode: {exc}")
            prev = newest.get(r.key)
            if prev is not None:
                superseded += 1
                if r.rev_seqno <= prev[1]:
                    p.append(
                        f"key {r.key!r}: version at seqno {s} has rev seqno "
                        f"{r.rev_seqno}, not above {prev[1]} of seqno {prev[0]}"
                    )
            newest[r.key] = (s, r.rev_seqno)
            if max_cas and r.cas > max_cas:
                cas_over += 1
    except DamagedRecord as exc:
        p.append(str(exc).split(": ", 1)[-1])  # without the "vbucket N: " prefix
    if rec is not None and last > rec.high_seqno:
        p.append(
            f"records up to seqno {last} on disk, but the persisted high seqno is {rec.high_seqno}"
        )
    if cas_over:
        p.append(f"{cas_over} records have a CAS above the persisted max CAS {max_cas}")
    return n, superseded


def check_vbucket(snap: Snapshot, vb: int) -> dict[str, Any]:
    """Check one vbucket inside one read transaction (state and items agree in time)."""
    p: list[str] = []
    raw_state = snap.state_raw(vb)
    rec = None
    if raw_state is None:
        p.append("no vbucket state record")
    else:
        try:
            rec = VBStateRecord.decode(raw_state)
        except Exception as exc:  # ValueError (version), struct.error (short)
            p.append(f"unreadable state record: {exc}")
    if rec is not None:
        p.extend(_check_state(rec))
    records, superseded = _check_records(snap, vb, rec, p)
    return {"vbucket": vb, "records": records, "superseded": superseded, "problems": p}


def check_store(store: OfflineStore, vbs: list[int], bar: Any) -> dict[str, Any]:
    """Check ``vbs``; ``bar.advance()`` once per vbucket. Returns the report document."""
    with store.read() as snap:
        states = snap.state_records()
    problems: list[dict[str, Any]] = []
    notes: list[str] = []
    for key in sorted(states):
        if key < 0:
            problems.append(
                {
                    "vbucket": None,
                    "problem": f"vbstate key {states[key]!r} is not a 2-byte vbucket id",
                }
            )
        elif key >= store.num_vbuckets:
            problems.append(
                {
                    "vbucket": key,
                    "problem": f"state record for vbucket {key}, "
                    f"but the data dir has {store.num_vbuckets}",
                }
            )
    if not store.clean_shutdown:
        notes.append(
            "no clean-shutdown marker: the server is running, or it stopped "
            "uncleanly (the next start adds failover entries)"
        )
    records = 0
    for vb in vbs:
        with store.read() as snap:
            res = check_vbucket(snap, vb)
        records += res["records"]
        for text in res["problems"][:MAX_PER_VBUCKET]:
            problems.append({"vbucket": vb, "problem": text})
        if len(res["problems"]) > MAX_PER_VBUCKET:
            problems.append(
                {
                    "vbucket": vb,
                    "problem": f"... and {len(res['problems']) - MAX_PER_VBUCKET} more problems",
                }
            )
        if res["superseded"]:
            notes.append(f"vb {vb}: {res['superseded']} superseded versions kept (history window)")
        bar.advance()
    return {
        "ok": not problems,
        "data_dir": str(store.path),
        "vbuckets_checked": len(vbs),
        "records_checked": records,
        "problems": problems,
        "notes": notes,
    }
