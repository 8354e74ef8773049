"""Rows on their way to Spark: columnar chunks of change sets.

Rules of this module:
- A ``Chunk`` holds rows column by column (plain Python lists, the cheapest thing to
  append to on the hot path) plus ``segments``: ``(vbucket, snapshot start, snapshot
  end, rows, vbucket uuid, rollback generation)`` runs in row order, from which
  ``arrow.py`` fills the per-row vbucket, snapshot, branch and position columns.
- ``newest_per_key`` is the change-set rule: per key, only its newest row survives.
- ``mutation_row``/``deletion_row``/``expiration_row`` build one item as a row tuple in
  column order; the executor's protocol session calls them per item, instead of building
  event objects (so their parameters are the session's item fields, in its order).
- No I/O; no pyarrow.
"""

from __future__ import annotations

__all__ = [
    "NCOLS",
    "OP_DELETION",
    "OP_EXPIRATION",
    "OP_MUTATION",
    "OP_ROLLBACK",
    "Chunk",
    "Row",
    "columns",
    "deletion_row",
    "expiration_row",
    "mutation_row",
    "newest_per_key",
]

OP_MUTATION, OP_DELETION, OP_EXPIRATION, OP_ROLLBACK = 0, 1, 2, 3
#: Columns of a chunk, in order: seqno, op, key, value, cas, rev_seqno, flags, expiry,
#: datatype.
NCOLS = 9
#: One change in column order (``None`` where a column does not apply).
Row = tuple[int, int, bytes, bytes | None, int, int, int | None, int | None, int]


def mutation_row(
    vb: int,
    by: int,
    rev: int,
    cas: int,
    flags: int,
    exp: int,
    lock: int,
    dt: int,
    key: bytes,
    value: bytes,
) -> Row:
    return (by, 0, key, value, cas, rev, flags, exp, dt)  # 0: OP_MUTATION, no global lookup


def deletion_row(
    vb: int, by: int, rev: int, cas: int, dt: int, key: bytes, value: bytes, delete_time: int | None
) -> Row:
    return (by, OP_DELETION, key, value or None, cas, rev, None, None, dt)


def expiration_row(vb: int, by: int, rev: int, cas: int, key: bytes, delete_time: int) -> Row:
    return (by, OP_EXPIRATION, key, None, cas, rev, None, None, 0)


def columns() -> tuple[list, ...]:
    return tuple([] for _ in range(NCOLS))


class Chunk:
    """Rows ready for Spark, column by column."""

    __slots__ = ("cols", "segments")

    def __init__(self) -> None:
        self.cols = columns()
        self.segments: list[tuple[int, int, int, int, int, int]] = []

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

    def add(
        self,
        vb: int,
        snap_start: int,
        snap_end: int,
        cols: tuple[list, ...],
        uuid: int = 0,
        gen: int = 0,
    ) -> None:
        n = len(cols[0])
        if n:
            for mine, theirs in zip(self.cols, cols, strict=True):
                mine.extend(theirs)
            self.segments.append((vb, snap_start, snap_end, n, uuid, gen))

    def add_rollback(self, vb: int, seqno: int, uuid: int = 0, gen: int = 0) -> None:
        """One ``op = rollback`` row: forget every change of ``vb`` above ``seqno`` that
        came before it (rows of generation ``gen`` and later come after it)."""
        self.add(
            vb,
            seqno,
            seqno,
            ([seqno], [OP_ROLLBACK], [None], [None], [None], [None], [None], [None], [None]),
            uuid,
            gen,
        )


def newest_per_key(cols: tuple[list, ...]) -> tuple[list, ...]:
    """Keep, for every key, only its last (newest) row; rows stay in seqno order."""
    keys = cols[2]
    last = dict(zip(keys, range(len(keys)), strict=True))
    if len(last) == len(keys):
        return cols
    keep = sorted(last.values())
    return tuple([col[i] for i in keep] for col in cols)
