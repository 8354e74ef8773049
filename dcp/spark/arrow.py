"""The source's fixed schema, and ``Chunk`` -> ``pyarrow.RecordBatch``.

Rules of this module:
- One schema for batch and stream reads (``SCHEMA_DDL``). The Arrow schema is built here
  without the JVM (executors cannot parse DDL) and must equal what pyspark derives from
  the DDL (a test checks it): Spark refuses record batches whose types differ.
- Conversion is vectorized from the rows' Arrow batches (``columns.ROW_SCHEMA``);
  unsigned 64-bit fields (cas, seqnos) are reinterpreted as Spark longs (no value is
  lost: a cas above 2**63 shows as a negative long, bit for bit).
- ``position`` orders the rows of a vbucket across the whole stream: the rollback
  generation (offsets.py, ``g``) in the high bits, the seqno in the low 48, so a
  ``rollback`` row sorts after every row it undoes and before the rows that follow it.
  ``timestamp`` is the CAS read as the hybrid logical clock it is (nanoseconds since the
  epoch, the low bits a logical counter), cut to Spark's microseconds.
- Keys are UTF-8 text (Couchbase keys are); a key that is not valid UTF-8 is decoded with
  U+FFFD replacement characters rather than failing the read.
"""

from __future__ import annotations

from typing import Any

from .changes import Chunk

__all__ = ["COLUMNS", "OPS", "POSITION_SHIFT", "SCHEMA_DDL", "arrow_schema", "to_record_batch"]

#: ``position`` = rollback generation << POSITION_SHIFT | seqno.
POSITION_SHIFT = 48

#: (name, Spark type) in column order.
COLUMNS = (
    ("vbucket", "int"),
    ("seqno", "long"),
    ("op", "string"),
    ("key", "string"),
    ("value", "binary"),
    ("cas", "long"),
    ("rev_seqno", "long"),
    ("flags", "long"),
    ("expiry", "long"),
    ("datatype", "int"),
    ("snapshot_start", "long"),
    ("snapshot_end", "long"),
    ("vb_uuid", "long"),
    ("position", "long"),
    ("timestamp", "timestamp"),
)
SCHEMA_DDL = ", ".join(f"{n} {t}" for n, t in COLUMNS)
#: Values of the ``op`` column, indexed by the executor's op codes.
OPS = ("mutation", "deletion", "expiration", "rollback")

_schema: Any = None


def arrow_schema() -> Any:
    global _schema
    if _schema is None:
        import pyarrow as pa

        types = {
            "int": pa.int32(),
            "long": pa.int64(),
            "string": pa.string(),
            "binary": pa.binary(),
            "timestamp": pa.timestamp("us", tz="UTC"),
        }
        _schema = pa.schema([pa.field(n, types[t]) for n, t in COLUMNS])
    return _schema


def to_record_batch(chunk: Chunk) -> Any:
    """The chunk's rows (``columns.ROW_SCHEMA`` batches) in the source's schema: the
    per-row vbucket, snapshot and branch columns repeated from ``chunk.segments``, all
    vectorized (no Python object per row)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rows, segments = chunk.final()
    seg = np.array(segments, np.uint64).reshape(-1, 6)
    counts = seg[:, 3].astype(np.int64)

    def per_row(i: int, dtype: Any) -> Any:
        return np.repeat(seg[:, i], counts).astype(dtype)

    # uint64 fields are reinterpreted bit for bit as Spark longs (module rules); cas and
    # rev_seqno are null on rollback rows, so they stay in Arrow
    seqnos = rows.column(0).to_numpy().view(np.int64)
    position = seqnos
    if seg[:, 5].any():
        position = seqnos + (per_row(5, np.int64) << POSITION_SHIFT)
    cas = rows.column(4)
    stamp = pc.divide(cas, pa.scalar(1000, pa.uint64())).cast(pa.int64())
    keys = rows.column(2)
    try:
        keys = keys.cast(pa.string())
    except pa.ArrowInvalid:
        keys = pa.array(
            [k.decode("utf-8", "replace") if k is not None else None for k in keys.to_pylist()],
            pa.string(),
        )
    arrays = [
        pa.array(per_row(0, np.int32)),
        pa.array(seqnos),
        pc.take(pa.array(OPS, pa.string()), rows.column(1)),
        keys,
        rows.column(3),
        cas.cast(pa.int64(), safe=False),
        rows.column(5).cast(pa.int64(), safe=False),
        rows.column(6),
        rows.column(7),
        rows.column(8),
        pa.array(per_row(1, np.uint64).view(np.int64)),
        pa.array(per_row(2, np.uint64).view(np.int64)),
        pa.array(per_row(4, np.uint64).view(np.int64)),
        pa.array(position),
        stamp.cast(pa.timestamp("us", tz="UTC")),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema())
