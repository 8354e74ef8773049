"""Rows on their way to Spark: columnar chunks of change sets.

Rules of this module:
- Rows travel as Arrow record batches of ``columns.ROW_SCHEMA`` (built from the receive
  buffer by ``columns.py``), never as a Python object per row: ``Rows`` is one range's
  rows (a list of batch pieces, sliced, not copied), ``Chunk`` the rows ready for Spark
  plus ``segments``: ``(vbucket, snapshot start, snapshot end, rows, vbucket uuid,
  rollback generation)`` runs in row order, from which ``arrow.py`` fills the per-row
  vbucket, snapshot, branch and position columns.
- ``newest_per_key`` is the change-set rule: per key, only its newest row survives
  (computed in Arrow: a distinct count, and a group-by only when keys repeat).
- ``mutation_row``/``deletion_row``/``expiration_row`` build one item as a row tuple in
  column order, for the rare item the protocol session builds one by one (outside a run
  of frames); ``columns.from_rows`` turns such tuples into a batch.
- No I/O. numpy and pyarrow are imported when first used, so the driver side (which
  never builds rows) imports this module without them.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "NCOLS",
    "OP_DELETION",
    "OP_EXPIRATION",
    "OP_MUTATION",
    "OP_ROLLBACK",
    "Chunk",
    "Row",
    "Rows",
    "deletion_row",
    "expiration_row",
    "mutation_row",
    "newest_per_key",
]

OP_MUTATION, OP_DELETION, OP_EXPIRATION, OP_ROLLBACK = 0, 1, 2, 3
#: Columns of a row, in order: seqno, op, key, value, cas, rev_seqno, flags, expiry,
#: datatype (``columns.ROW_SCHEMA``).
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


class Rows:
    """Rows of one vbucket in seqno order, as Arrow record batches of
    ``columns.ROW_SCHEMA`` (pieces of received runs, never copied until handed out)."""

    __slots__ = ("batches", "n", "nbytes")

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.n = 0
        self.nbytes = 0  # Arrow bytes of the rows: what a range buffers

    def __len__(self) -> int:
        return self.n

    def add(self, batch: Any) -> None:
        if batch.num_rows:
            self.batches.append(batch)
            self.n += batch.num_rows
            self.nbytes += batch.nbytes

    def extend(self, other: Rows) -> None:
        self.batches += other.batches
        self.n += other.n
        self.nbytes += other.nbytes

    def clear(self) -> None:
        self.batches = []
        self.n = self.nbytes = 0

    def last_seqno(self) -> int:
        b = self.batches[-1]
        return b.column(0)[b.num_rows - 1].as_py()

    def drop_last(self) -> None:
        b = self.batches.pop()
        if b.num_rows > 1:
            self.batches.append(b.slice(0, b.num_rows - 1))
        self.n -= 1

    def split_after(self, seqno: int) -> Rows:
        """Keep the rows up to ``seqno``; return the rows past it."""
        import numpy as np

        keep, tail = Rows(), Rows()
        for b in self.batches:
            i = int(np.searchsorted(b.column(0).to_numpy(), seqno, "right"))
            keep.add(b.slice(0, i))
            tail.add(b.slice(i))
        self.batches, self.n, self.nbytes = keep.batches, keep.n, keep.nbytes
        return tail

    def column(self, i: int) -> list:
        """Column ``i`` as Python values (tests, checks on a few rows)."""
        return [v for b in self.batches for v in b.column(i).to_pylist()]

    def combined(self) -> Any:
        """One record batch of every row."""
        import pyarrow as pa

        from .columns import ROW_SCHEMA

        if len(self.batches) == 1:
            return self.batches[0]
        return pa.concat_batches(self.batches) if self.batches else ROW_SCHEMA.empty_table()


class Chunk:
    """Rows ready for Spark: record batches (``columns.ROW_SCHEMA``) plus ``segments``."""

    __slots__ = ("_py", "batches", "n", "segments")

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.segments: list[tuple[int, int, int, int, int, int]] = []
        self.n = 0
        self._py: dict[int, list] | None = None

    def _col(self, i: int) -> list:
        """Column ``i`` as Python values (tests and debugging; cached until the next add)."""
        if self._py is None:
            self._py = {}
        if i not in self._py:
            self._py[i] = [v for b in self.batches for v in b.column(i).to_pylist()]
        return self._py[i]

    seqno = property(lambda self: self._col(0))
    op = property(lambda self: self._col(1))
    key = property(lambda self: self._col(2))
    value = property(lambda self: self._col(3))
    cas = property(lambda self: self._col(4))
    rev = property(lambda self: self._col(5))
    flags = property(lambda self: self._col(6))
    expiry = property(lambda self: self._col(7))
    datatype = property(lambda self: self._col(8))

    def __len__(self) -> int:
        return self.n

    def take(self) -> Chunk:
        """Move the rows into a new chunk and leave this one empty (its holders keep
        appending to it)."""
        out = Chunk()
        out.batches, out.segments, out.n = self.batches, self.segments, self.n
        self.batches, self.segments, self.n, self._py = [], [], 0, None
        return out

    def add(
        self,
        vb: int,
        snap_start: int,
        snap_end: int,
        batch: Any,
        uuid: int = 0,
        gen: int = 0,
    ) -> None:
        n = batch.num_rows
        if n:
            self.batches.append(batch)
            self.segments.append((vb, snap_start, snap_end, n, uuid, gen))
            self.n += n
            self._py = None

    def add_rollback(self, vb: int, seqno: int, uuid: int = 0, gen: int = 0) -> None:
        """One ``op = rollback`` row: forget every change of ``vb`` above ``seqno`` that
        came before it (rows of generation ``gen`` and later come after it)."""
        from .columns import from_rows

        row = (seqno, OP_ROLLBACK, None, None, None, None, None, None, None)
        self.add(vb, seqno, seqno, from_rows([row]), uuid, gen)


def newest_per_key(rows: Rows) -> Any:
    """Keep, for every key, only its last (newest) row; rows stay in seqno order. Returns
    one record batch."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    b = rows.combined()
    n = b.num_rows
    keys = b.column(2)
    if n < 2 or pc.count_distinct(keys).as_py() == n:
        return b
    last = (
        pa.table({"k": keys, "i": pa.array(np.arange(n))})
        .group_by("k", use_threads=False)
        .aggregate([("i", "max")])
        .column("i_max")
        .to_numpy()
    )
    return b.take(pa.array(np.sort(last)))
