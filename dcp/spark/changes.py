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
        self.nbytes = 0  # what the rows cost to buffer: wire bytes of received runs

    def __len__(self) -> int:
        return self.n

    def add(self, batch: Any, nbytes: int | None = None) -> None:
        """``nbytes``: what the rows cost to buffer, when the caller knows it (the wire
        bytes of a received run): cheaper than asking Arrow for a slice's size."""
        if batch.num_rows:
            self.batches.append(batch)
            self.n += batch.num_rows
            self.nbytes += batch.nbytes if nbytes is None else nbytes

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
        self.nbytes -= self.nbytes // self.n
        self.n -= 1

    def split_after(self, seqno: int) -> Rows:
        """Keep the rows up to ``seqno``; return the rows past it."""
        import numpy as np

        keep, tail = Rows(), Rows()
        for b in self.batches:
            i = int(np.searchsorted(b.column(0).to_numpy(), seqno, "right"))
            keep.add(b.slice(0, i), 0)
            tail.add(b.slice(i), 0)
        if self.n:  # the bytes go with the rows (the pieces' own sizes are not kept)
            tail.nbytes = self.nbytes * tail.n // self.n
        self.batches, self.n, self.nbytes = keep.batches, keep.n, self.nbytes - tail.nbytes
        return tail

    def column(self, i: int) -> list:
        """Column ``i`` as Python values (tests, checks on a few rows)."""
        return [v for b in self.batches for v in b.column(i).to_pylist()]


class Chunk:
    """Rows ready for Spark: record batches (``columns.ROW_SCHEMA``) plus ``segments``.

    Change sets are added as received (every version); ``final()`` applies the change-set
    rule to all of them at once (``newest_per_key``), so its fixed cost is paid per chunk,
    not per vbucket. ``segments`` and the column views are those of the final rows."""

    __slots__ = ("_final", "_py", "_segs", "batches", "n")

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self._segs: list[tuple[int, int, int, int, int, int]] = []
        self.n = 0  # rows added (before the change-set rule)
        self._final: tuple[Any, list] | None = None
        self._py: dict[int, list] | None = None

    def final(self) -> tuple[Any, list[tuple[int, int, int, int, int, int]]]:
        """One record batch of the chunk's change sets (newest version per key of each)
        and its segments ``(vbucket, snapshot start, snapshot end, rows, vb uuid, gen)``."""
        if self._final is None:
            self._final = newest_per_key(self.batches, self._segs)
        return self._final

    @property
    def segments(self) -> list[tuple[int, int, int, int, int, int]]:
        return self.final()[1]

    def _col(self, i: int) -> list:
        """Column ``i`` as Python values (tests and debugging; cached until the next add)."""
        if self._py is None:
            self._py = {}
        if i not in self._py:
            self._py[i] = self.final()[0].column(i).to_pylist()
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
        out.batches, out._segs, out.n = self.batches, self._segs, self.n
        self.batches, self._segs, self.n = [], [], 0
        self._final = self._py = None
        return out

    def add(
        self, vb: int, snap_start: int, snap_end: int, rows: Rows, uuid: int = 0, gen: int = 0
    ) -> None:
        """One change set: ``rows`` of ``vb`` (every version; the rule applies in ``final``)."""
        if rows.n:
            self.batches += rows.batches
            self._segs.append((vb, snap_start, snap_end, rows.n, uuid, gen))
            self.n += rows.n
            self._final = self._py = None

    def add_rollback(self, vb: int, seqno: int, uuid: int = 0, gen: int = 0) -> None:
        """One ``op = rollback`` row: forget every change of ``vb`` above ``seqno`` that
        came before it (rows of generation ``gen`` and later come after it)."""
        from .columns import from_rows

        rows = Rows()
        rows.add(from_rows([(seqno, OP_ROLLBACK, None, None, None, None, None, None, None)]))
        self.add(vb, seqno, seqno, rows, uuid, gen)


def _all_distinct(keys: Any) -> bool:
    """True only if no key occurs twice (a false "maybe not" just takes the exact path).
    Each key is summed up as its length and its first and last 8 bytes, mixed into one
    64-bit number: equal keys give equal numbers, so distinct numbers prove distinct keys.
    Vectorized over the array's buffers (hashing the keys in Arrow costs ~5x more)."""
    import sys

    import numpy as np

    n = len(keys)
    if keys.null_count or sys.byteorder != "little":  # the masks below read little-endian
        return False
    offsets = np.frombuffer(keys.buffers()[1], np.int32, n + 1, keys.offset * 4)
    data = np.frombuffer(keys.buffers()[2], np.uint8)
    data = np.concatenate([np.zeros(8, np.uint8), data, np.zeros(8, np.uint8)])
    win = np.lib.stride_tricks.sliding_window_view(data, 8)
    start, end = offsets[:-1].astype(np.int64), offsets[1:].astype(np.int64)
    first = np.ascontiguousarray(win[start + 8]).view(np.uint64)[:, 0]
    last = np.ascontiguousarray(win[end]).view(np.uint64)[:, 0]
    length = (end - start).astype(np.uint64)
    # bytes past a short key are the next key's: mask them so equal keys mix equally
    short = length < 8
    if short.any():
        keep = np.where(
            short, (np.uint64(1) << (length * np.uint64(8))) - np.uint64(1), ~np.uint64(0)
        )
        first = first & keep
        last = np.where(short, 0, last)
    with np.errstate(over="ignore"):
        mixed = (
            first * np.uint64(0x9E3779B97F4A7C15) ^ last * np.uint64(0xC2B2AE3D27D4EB4F) ^ length
        )
    mixed.sort()
    return not (mixed[1:] == mixed[:-1]).any()


def newest_per_key(batches: list[Any], segments: list[tuple]) -> tuple[Any, list[tuple]]:
    """The change-set rule over every segment at once: keep, for every key of a segment,
    only its last (newest) row; rows stay in order. Returns the rows as one record batch
    and the segments with their new row counts. One distinct count decides the common
    case (no key twice in the chunk: keys of different vbuckets never meet); only then a
    group-by on (segment, key)."""
    import numpy as np
    import pyarrow as pa

    from .columns import ROW_SCHEMA

    if not batches:
        return pa.RecordBatch.from_pylist([], schema=ROW_SCHEMA), []
    b = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
    n = b.num_rows
    keys = b.column(2)
    if n < 2 or _all_distinct(keys):
        return b, segments
    counts = np.array([seg[3] for seg in segments], np.int64)
    seg_of = np.repeat(np.arange(len(segments)), counts)
    last = (
        pa.table({"s": seg_of, "k": keys, "i": np.arange(n)})
        .group_by(["s", "k"], use_threads=False)
        .aggregate([("i", "max")])
        .column("i_max")
        .to_numpy()
    )
    keep = np.sort(last)
    kept = np.bincount(seg_of[keep], minlength=len(segments))
    out = [(*seg[:3], int(k), *seg[4:]) for seg, k in zip(segments, kept, strict=True) if k]
    return b.take(pa.array(keep)), out
