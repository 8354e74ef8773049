"""Change items as Arrow columns, straight from the receive buffer.

Rules of this module:
- ``from_frames(buf, starts)`` turns the frames of one ``ItemFrames`` run
  (dcp/protocol/events.py) into one ``pyarrow.RecordBatch`` of ``ROW_SCHEMA`` with numpy
  gathers over the frame offsets: no Python object per row. This is the executor's hot
  path (docs/spark.md, "Performance"): per row the session only found and validated the
  frame; every field is read here for the whole run at once.
- The session validated every frame of the run (header rules, extras length per opcode,
  the stream's opaque), so every offset and length read here lies inside ``buf``.
- Keys and values are built as Arrow binary *views* over ``buf`` (a 16-byte view per row:
  the bytes inline when at most 12, else a prefix and the offset) and then cast to plain
  binary, which copies them out in C: the cost per row does not grow with the value size
  the way a per-row slice and a list would.
- ``from_runs(runs)`` decodes every run of one received chunk with one ``from_frames``
  call and hands out slices: the numpy calls cost the same for 10 rows as for 10,000.
- ``from_rows(rows)`` does the same for row tuples (``changes.Row``): items the session
  built one by one (outside a run) and rollback rows. Same schema, same nulls.
- Column meanings (``ROW_SCHEMA``): ``value`` is null for an expiration and for a deletion
  without a body; ``flags``/``expiry`` are null unless the row is a mutation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["ROW_SCHEMA", "from_frames", "from_rows", "from_runs"]

ROW_SCHEMA = pa.schema(
    [
        ("seqno", pa.uint64()),
        ("op", pa.int8()),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("cas", pa.uint64()),
        ("rev_seqno", pa.uint64()),
        ("flags", pa.int64()),
        ("expiry", pa.int64()),
        ("datatype", pa.int32()),
    ]
)

# op codes of changes.py (OP_MUTATION, OP_DELETION, OP_EXPIRATION) by wire opcode - 0x57
_OPS = np.array([0, 1, 2], np.int8)
#: zero bytes after a chunk, so a 48-byte window at any frame start stays inside it (a
#: frame is at least 42 bytes: a header and 18 bytes of deletion extras)
_PAD = bytes(64)
_INLINE = np.arange(12)  # a binary view holds up to 12 bytes inline
_NATIVE = {">u4": np.uint32, ">u8": np.uint64}
#: a run smaller than 1/_SHARE of its chunk's bytes is copied out (``from_runs``)
_SHARE = 4


def _be(cols: np.ndarray, dtype: str) -> np.ndarray:
    """Big-endian fields (rows of bytes) as native unsigned integers."""
    return np.ascontiguousarray(cols).view(dtype)[:, 0].astype(_NATIVE[dtype])


def _binary(win: np.ndarray, data: Any, offs: np.ndarray, lens: np.ndarray, valid: Any) -> Any:
    """``data[offs[i] : offs[i] + lens[i]]`` for every row, as an Arrow binary array
    (``win``: 12-byte windows over ``data``; ``valid``: a boolean mask of non-null rows,
    or None)."""
    m = len(offs)
    views = np.empty((m, 4), np.int32)
    views[:, 0] = lens
    inline = win[offs]  # the first 12 bytes of each (the buffer is padded: never past it)
    short = lens < 12
    if short.any():  # an inline view is zero-padded
        inline[short] = np.where(_INLINE < lens[short, None], inline[short], 0)
    views.view(np.uint8).reshape(m, 16)[:, 4:16] = inline
    far = lens > 12  # prefix (the first 4 bytes, already inline) + buffer 0 + offset
    views[far, 2] = 0
    views[far, 3] = offs[far]
    bitmap = None
    if valid is not None:
        views[~valid] = 0
        bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    arr = pa.Array.from_buffers(pa.binary_view(), m, [bitmap, pa.py_buffer(views), data])
    return arr.cast(pa.binary())


def from_frames(buf: bytes, starts: Sequence[int]) -> Any:
    """The rows of the item frames at ``starts`` in ``buf`` (module rules)."""
    padded = buf + _PAD  # one copy per chunk: every window below stays inside it
    # binary views address the buffer with int32 offsets (a chunk is a receive buffer plus
    # at most one frame: far below this)
    assert len(padded) < 2**31, "a received chunk above 2 GiB"
    a = np.frombuffer(padded, np.uint8)
    data = pa.py_buffer(padded)
    s = np.array(starts, np.int64)
    # Rows of fixed-width windows gathered with one index per row (a sliding window view
    # costs nothing; the gather copies 48 bytes per row).
    h = sliding_window_view(a, 48)[s]
    op = h[:, 1]
    kl = (h[:, 2].astype(np.int64) << 8) | h[:, 3]
    el = h[:, 4].astype(np.int64)
    body = _be(h[:, 8:12], ">u4").astype(np.int64)
    mut = op == 0x57
    ks = s + 24 + el
    vs = ks + kl
    vl = s + 24 + body - vs
    all_mut = bool(mut.all())
    if all_mut:
        flags = _be(h[:, 40:44], ">u4").astype(np.int64)
        expiry = _be(h[:, 44:48], ">u4").astype(np.int64)
    else:  # bytes 40..47 are a mutation's flags and expiry, and something else otherwise
        flags = np.where(mut, _be(h[:, 40:44], ">u4"), 0).astype(np.int64)
        expiry = np.where(mut, _be(h[:, 44:48], ">u4"), 0).astype(np.int64)
    nulls = None if all_mut else ~mut
    # a deletion's body is its value when present; an expiration's is never a value
    has_value = None if all_mut else mut | ((op == 0x58) & (vl > 0))
    win = sliding_window_view(a, 12)
    arrays = [
        pa.array(_be(h[:, 24:32], ">u8")),
        pa.array(_OPS[op - 0x57]),
        _binary(win, data, ks, kl, None),
        _binary(win, data, vs, vl, has_value),
        pa.array(_be(h[:, 16:24], ">u8")),
        pa.array(_be(h[:, 32:40], ">u8")),
        pa.array(flags, mask=nulls),
        pa.array(expiry, mask=nulls),
        # an expiration carries no datatype (the row rules give 0, whatever the byte says)
        pa.array(np.where(op == 0x59, 0, h[:, 5]).astype(np.int32)),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=ROW_SCHEMA)


def from_runs(runs: Sequence[Any]) -> list[Any]:
    """One batch per ``ItemFrames`` run of ``runs``; runs in the same buffer (every run of
    one ``receive_data`` call) are decoded together, so the fixed cost of the numpy calls
    is paid per received chunk, not per run (a chunk holds runs of many vbuckets).

    A run gets a slice of the chunk's batch only when it holds at least a quarter of the
    chunk's wire bytes; a smaller one gets its own copy. A slice keeps its whole parent
    alive, and a range may keep its rows across many chunks (a slow vbucket among fast
    ones): so a kept row never pins more than ~4x its own bytes, and the range's buffer
    bound (``ranges.BUFFER_BYTES``) still bounds memory."""
    out: list[Any] = []
    i = 0
    while i < len(runs):
        buf = runs[i].buf
        j = i + 1
        while j < len(runs) and runs[j].buf is buf:
            j += 1
        if j == i + 1:
            out.append(from_frames(buf, runs[i].starts))
        else:
            group = runs[i:j]
            batch = from_frames(buf, [p for r in group for p in r.starts])
            total = sum(r.nbytes for r in group)
            at = 0
            for r in group:
                piece = batch.slice(at, len(r.starts))
                if r.nbytes * _SHARE < total:
                    piece = pa.concat_batches([piece.slice(0, 0), piece])  # a copy of its own
                out.append(piece)
                at += len(r.starts)
        i = j
    return out


def from_rows(rows: Sequence[tuple]) -> Any:
    """Row tuples (``changes.Row``, column order) as a batch of ``ROW_SCHEMA``."""
    cols = list(zip(*rows, strict=True)) if rows else [()] * len(ROW_SCHEMA)
    return pa.RecordBatch.from_arrays(
        [pa.array(c, f.type) for c, f in zip(cols, ROW_SCHEMA, strict=True)], schema=ROW_SCHEMA
    )
