"""Rows on their way to Spark: columnar chunks of change sets.

Rules of this module:
- A ``Chunk`` holds rows column by column (plain Python lists, the cheapest thing to
  append to on the hot path) plus ``segments``: ``(vbucket, snapshot start, snapshot
  end, rows)`` runs in row order, from which ``arrow.py`` fills the per-row vbucket and
  snapshot columns.
- ``newest_per_key`` is the change-set rule: per key, only its newest row survives.
- No I/O; no pyarrow.
"""

from __future__ import annotations

__all__ = ["NCOLS", "OP_DELETION", "OP_EXPIRATION", "OP_MUTATION", "OP_ROLLBACK", "Chunk",
           "columns", "newest_per_key"]

OP_MUTATION, OP_DELETION, OP_EXPIRATION, OP_ROLLBACK = 0, 1, 2, 3
#: Columns of a chunk, in order: seqno, op, key, value, cas, rev_seqno, flags, expiry,
#: datatype.
NCOLS = 9


def columns() -> tuple[list, ...]:
    return tuple([] for _ in range(NCOLS))


class Chunk:
    """Rows ready for Spark, column by column."""

    __slots__ = ("cols", "segments")

    def __init__(self) -> None:
        self.cols = columns()
        self.segments: list[tuple[int, int, int, int]] = []

    seqno = property(lambda self: self.cols[0])
    op = property(lambda self: self.cols[1])
    key = property(lambda self: self.cols[2])
    value = property(lambda self: self.cols[3])
    cas = property(lambda self: self.cols[4])
    rev = property(lambda self: self.cols[5])
    flags = property(lambda self: self.cols[6])
    expiry = property(lambda self: self.cols[7])
    datatype = property(lambda self: self.cols[8])

    def __len__(self) -> int:
        return len(self.cols[0])

    def take(self) -> Chunk:
        """Move the rows into a new chunk and leave this one empty (its holders keep
        appending to it)."""
        out = Chunk()
        out.cols, out.segments = self.cols, self.segments
        self.cols, self.segments = columns(), []
        return out

    def add(self, vb: int, snap_start: int, snap_end: int, cols: tuple[list, ...]) -> None:
        n = len(cols[0])
        if n:
            for mine, theirs in zip(self.cols, cols, strict=True):
                mine.extend(theirs)
            self.segments.append((vb, snap_start, snap_end, n))

    def add_rollback(self, vb: int, seqno: int) -> None:
        """One ``op = rollback`` row: forget every change of ``vb`` above ``seqno``."""
        self.add(vb, seqno, seqno, ([seqno], [OP_ROLLBACK], [None], [None], [None], [None],
                                    [None], [None], [None]))


def newest_per_key(cols: tuple[list, ...]) -> tuple[list, ...]:
    """Keep, for every key, only its last (newest) row; rows stay in seqno order."""
    keys = cols[2]
    last = dict(zip(keys, range(len(keys)), strict=True))
    if len(last) == len(keys):
        return cols
    keep = sorted(last.values())
    return tuple([col[i] for i in keep] for col in cols)
