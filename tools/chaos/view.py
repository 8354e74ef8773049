"""A materialized view that can be rolled back, and the journal that makes it durable.

Rules of this module:
- ``View`` keeps, per vbucket, every change it applied in seqno order (seqno, branch
  uuid, key, value-or-None) plus each key's stack of versions, so ``truncate(vb, R)``
  restores exactly the state at R (what a ``RollbackEvent`` asks the application to do).
  The "branch uuid" of a change is the failover-log entry that owns its seqno in the log
  the change was streamed under (``uuid_of``).
- The journal is the view's file: one JSON line per group of operations, appended with
  one ``write`` and flushed *before* the consumer commits to its offset store. A line
  torn by SIGKILL (no trailing newline, or not JSON) is discarded on load: it was never
  committed. Operations: ``["t", vb, seqno]`` (undo above seqno: the offset store is
  behind the view), ``["r", vb, rollback_seqno, asked_seqno, asked_uuid]`` (a rollback
  event), ``["b", vb, start, end, flags, log, events]`` with events
  ``[seqno, kind, key, value]`` (kind m|d|x).
- Pure: no trio, no sockets. Used by the consumer process and by the verifier.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["Journal", "View", "read_journal", "uuid_of"]

Log = list[list[int]]  # failover log, newest first: [[uuid, seqno], ...]


def uuid_of(seqno: int, log: Log) -> int | None:
    """The uuid of the failover-log entry that owns ``seqno`` (None: older than the log)."""
    for uuid, start in log:
        if start < seqno:
            return uuid
    return None


class VbView:
    __slots__ = ("by_key", "changes", "end", "log")

    def __init__(self) -> None:
        self.changes: list[tuple[int, int | None, str, str | None]] = []
        self.by_key: dict[str, list[int]] = {}
        self.end = 0
        self.log: Log = []

    def apply(self, seqno: int, uuid: int | None, key: str, value: str | None) -> None:
        self.by_key.setdefault(key, []).append(len(self.changes))
        self.changes.append((seqno, uuid, key, value))

    def truncate(self, seqno: int) -> int:
        """Undo every change above ``seqno``; returns how many were undone."""
        n = 0
        changes = self.changes
        while changes and changes[-1][0] > seqno:
            _, _, key, _ = changes.pop()
            stack = self.by_key[key]
            stack.pop()
            if not stack:
                del self.by_key[key]
            n += 1
        self.end = min(self.end, seqno)
        return n

    def latest(self, key: str) -> tuple[int, int | None, str, str | None] | None:
        stack = self.by_key.get(key)
        return self.changes[stack[-1]] if stack else None

    def state(self) -> dict[str, str]:
        out = {}
        for key, stack in self.by_key.items():
            value = self.changes[stack[-1]][3]
            if value is not None:
                out[key] = value
        return out


class View:
    def __init__(self) -> None:
        self.vbs: dict[int, VbView] = {}

    def vb(self, vb: int) -> VbView:
        v = self.vbs.get(vb)
        if v is None:
            v = self.vbs[vb] = VbView()
        return v

    def state(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for v in self.vbs.values():
            out.update(v.state())
        return out

    def positions(self) -> dict[int, tuple[int, int]]:
        """vb -> (applied end seqno, newest uuid of the log it was streamed under)."""
        return {vb: (v.end, v.log[0][0] if v.log else 0) for vb, v in self.vbs.items()}

    def apply_op(self, op: list[Any]) -> None:
        """Apply one journal operation (no checks; the verifier checks around this)."""
        kind, vb = op[0], op[1]
        v = self.vb(vb)
        if kind == "t" or kind == "r":
            v.truncate(op[2])
            if kind == "r":
                v.log = [e for e in v.log if e[1] <= op[2]]
        elif kind == "b":
            _, _, _start, end, _flags, log, events = op
            v.log = log
            for seqno, ek, key, value in events:
                v.apply(seqno, uuid_of(seqno, log), key, value if ek == "m" else None)
            v.end = max(v.end, end)
        else:
            raise ValueError(f"unknown journal op {kind!r}")


def read_journal(path: Path) -> Iterator[list[list[Any]]]:
    """Every complete group of operations in the journal, in order."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return
    for line in data.split(b"\n")[:-1]:  # the part after the last newline is torn
        try:
            group = json.loads(line)
        except ValueError:
            continue  # torn by a kill in the middle of an earlier append (then truncated)
        yield group


class Journal:
    """Append-only journal file; ``open`` cuts a torn tail so appends start on a line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        good = 0
        if self.path.exists():
            data = self.path.read_bytes()
            good = data.rfind(b"\n") + 1
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self.fd, good)
        os.lseek(self.fd, good, os.SEEK_SET)

    def append(self, ops: list[list[Any]]) -> None:
        if ops:
            data = (json.dumps(ops, separators=(",", ":")) + "\n").encode()
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]

    def close(self) -> None:
        os.close(self.fd)
