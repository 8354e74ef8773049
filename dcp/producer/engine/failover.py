"""The failover log of one vbucket: (vbucket uuid, seqno) history branches, newest first.

Rules of this module (protocol_spec/README.md §8):
- Always at least one entry; a new vbucket starts with ``(random uuid, 0)``. A uuid is a
  random non-zero 64-bit value, drawn from the injected ``uuid_source``.
- A new entry is created when a vbucket becomes active from another state (not a
  takeover) and at warm-up of an active vbucket after an unclean shutdown. Creating an
  entry removes every entry whose seqno is above the new one (abandoned branches); at
  most ``max_entries`` are kept, the oldest dropped.
- When the vbucket itself rolls back to R, entries above R are pruned.
- Pure bookkeeping: persisting the table is the flusher's job (it rides in the vbucket
  state record written with the items).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["FailoverTable", "draw_uuid"]

_U64 = 0xFFFF_FFFF_FFFF_FFFF


def draw_uuid(uuid_source: Callable[[], int]) -> int:
    """A non-zero 64-bit uuid from ``uuid_source`` (0 is reserved: "no uuid")."""
    for _ in range(64):
        u = uuid_source() & _U64
        if u:
            return u
    raise ValueError("uuid_source keeps returning 0")


class FailoverTable:
    """Entries ``(uuid, seqno)`` newest first, as sent on the wire."""

    __slots__ = ("entries", "max_entries")

    def __init__(self, entries: Iterable[tuple[int, int]], max_entries: int = 25) -> None:
        self.entries: list[tuple[int, int]] = [(int(u), int(s)) for u, s in entries]
        self.max_entries = max_entries
        if not self.entries:
            raise ValueError("a failover table needs at least one entry")
        del self.entries[max_entries:]

    @classmethod
    def new(cls, uuid_source: Callable[[], int], max_entries: int = 25) -> FailoverTable:
        """The table of a brand-new vbucket: one entry at seqno 0."""
        return cls([(draw_uuid(uuid_source), 0)], max_entries)

    @property
    def latest_uuid(self) -> int:
        return self.entries[0][0]

    @property
    def latest_seqno(self) -> int:
        return self.entries[0][1]

    def create_entry(self, seqno: int, uuid_source: Callable[[], int]) -> int:
        """Start a new history branch at ``seqno``; returns the new uuid.

        Entries above ``seqno`` are removed first (they describe a branch that no longer
        exists), then the table is capped at ``max_entries``.
        """
        uuid = draw_uuid(uuid_source)
        known = {u for u, _ in self.entries}
        while uuid in known:  # a duplicate uuid would make rollback decisions ambiguous
            uuid = draw_uuid(uuid_source)
        kept = [e for e in self.entries if e[1] <= seqno]
        self.entries = [(uuid, seqno), *kept][: self.max_entries]
        return uuid

    def prune_above(self, seqno: int) -> None:
        """Drop entries above ``seqno`` after a rollback (keeping at least one)."""
        kept = [e for e in self.entries if e[1] <= seqno]
        self.entries = kept or [self.entries[-1]]

    def find(self, uuid: int) -> int | None:
        """Index (0 = newest) of ``uuid`` in the table, or None."""
        for i, (u, _) in enumerate(self.entries):
            if u == uuid:
                return i
        return None

    def copy(self) -> list[tuple[int, int]]:
        return list(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"FailoverTable({self.entries!r})"
