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

__all__ = ["ROW_SCHEMA", "from_frames", "from_rows"]

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
#: header (24) + by_seqno (8) + rev_seqno (8): what every item frame starts with
_HEAD = np.arange(40)
_FLAGS_EXP = np.arange(40, 48)  # a mutation's flags and expiration, after rev_seqno
_INLINE = np.arange(12)  # a binary view holds up to 12 bytes inline
_NATIVE = {">u4": np.uint32, ">u8": np.uint64}


def _be(cols: np.ndarray, dtype: str) -> np.ndarray:
    """Big-endian fields (rows of bytes) as native unsigned integers."""
    return np.ascontiguousarray(cols).view(dtype)[:, 0].astype(_NATIVE[dtype])


def _binary(a: np.ndarray, buf: bytes, offs: np.ndarray, lens: np.ndarray, valid: Any) -> Any:
    """``buf[offs[i] : offs[i] + lens[i]]`` for every row, as an Arrow binary array
    (``valid``: a boolean mask of non-null rows, or None)."""
    m = len(offs)
    views = np.zeros((m, 4), np.int32)
    views[:, 0] = lens
    idx = offs[:, None] + _INLINE
    np.minimum(idx, len(a) - 1, out=idx)  # a short last value: never read past the buffer
    inline = np.where(_INLINE < lens[:, None], a[idx], 0).astype(np.uint8)
    views.view(np.uint8).reshape(m, 16)[:, 4:16] = inline
    far = lens > 12  # prefix (the first 4 bytes, already inline) + buffer 0 + offset
    views[far, 2] = 0
    views[far, 3] = offs[far]
    bitmap = None
    if valid is not None:
        views[~valid] = 0
        bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    arr = pa.Array.from_buffers(
        pa.binary_view(), m, [bitmap, pa.py_buffer(views), pa.py_buffer(buf)]
    )
    return arr.cast(pa.binary())


def from_frames(buf: bytes, starts: Sequence[int]) -> Any:
    """The rows of the item frames at ``starts`` in ``buf`` (module rules)."""
    a = np.frombuffer(buf, np.uint8)
    s = np.array(starts, np.int64)
    m = len(s)
    h = a[s[:, None] + _HEAD]
    op = h[:, 1]
    kl = (h[:, 2].astype(np.int64) << 8) | h[:, 3]
    el = h[:, 4].astype(np.int64)
    body = _be(h[:, 8:12], ">u4").astype(np.int64)
    mut = op == 0x57
    ks = s + 24 + el
    vs = ks + kl
    vl = s + 24 + body - vs
    flags = np.zeros(m, np.int64)
    expiry = np.zeros(m, np.int64)
    if mut.any():
        sm = s[mut]
        fe = a[sm[:, None] + _FLAGS_EXP]
        flags[mut] = _be(fe[:, 0:4], ">u4")
        expiry[mut] = _be(fe[:, 4:8], ">u4")
    all_mut = bool(mut.all())
    nulls = None if all_mut else ~mut
    # a deletion's body is its value when present; an expiration's is never a value
    has_value = None if all_mut else mut | ((op == 0x58) & (vl > 0))
    arrays = [
        pa.array(_be(h[:, 24:32], ">u8")),
        pa.array(_OPS[op - 0x57]),
        _binary(a, buf, ks, kl, None),
        _binary(a, buf, vs, vl, has_value),
        pa.array(_be(h[:, 16:24], ">u8")),
        pa.array(_be(h[:, 32:40], ">u8")),
        pa.array(flags, mask=nulls),
        pa.array(expiry, mask=nulls),
        pa.array(h[:, 5].astype(np.int32)),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=ROW_SCHEMA)


def from_rows(rows: Sequence[tuple]) -> Any:
    """Row tuples (``changes.Row``, column order) as a batch of ``ROW_SCHEMA``."""
    cols = list(zip(*rows, strict=True)) if rows else [()] * len(ROW_SCHEMA)
    return pa.RecordBatch.from_arrays(
        [pa.array(c, f.type) for c, f in zip(cols, ROW_SCHEMA, strict=True)], schema=ROW_SCHEMA
    )
