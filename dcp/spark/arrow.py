"""The source's fixed schema, and ``Chunk`` -> ``pyarrow.RecordBatch``.

Rules of this module:
- One schema for batch and stream reads (``SCHEMA_DDL``). The Arrow schema is built here
  without the JVM (executors cannot parse DDL) and must equal what pyspark derives from
  the DDL (a test checks it): Spark refuses record batches whose types differ.
- Conversion is column by column from the executor's lists; unsigned 64-bit fields (cas,
  seqnos) go through uint64 and are reinterpreted as Spark longs (no value is lost: a cas
  above 2**63 shows as a negative long, bit for bit).
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


def _u64_as_long(pa: Any, values: list) -> Any:
    return pa.array(values, pa.uint64()).cast(pa.int64(), safe=False)


def to_record_batch(chunk: Chunk) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    vbs: list[int] = []
    ss: list[int] = []
    se: list[int] = []
    uu: list[int] = []
    base: list[int] = []
    for vb, s, e, n, u, g in chunk.segments:
        vbs += [vb] * n
        ss += [s] * n
        se += [e] * n
        uu += [u] * n
        if g or base:
            base += [0] * (len(vbs) - n - len(base)) + [g << POSITION_SHIFT] * n
    seqnos = _u64_as_long(pa, chunk.seqno)
    position = pc.add(seqnos, pa.array(base, pa.int64())) if base else seqnos
    cas = pa.array(chunk.cas, pa.uint64())
    stamp = pc.divide(cas, pa.scalar(1000, pa.uint64())).cast(pa.int64())
    try:
        keys = pa.array(chunk.key, pa.binary()).cast(pa.string())
    except pa.ArrowInvalid:
        keys = pa.array(
            [k.decode("utf-8", "replace") if k is not None else None for k in chunk.key],
            pa.string(),
        )
    ops = pc.take(pa.array(OPS, pa.string()), pa.array(chunk.op, pa.int8()))
    arrays = [
        pa.array(vbs, pa.int32()),
        seqnos,
        ops,
        keys,
        pa.array(chunk.value, pa.binary()),
        cas.cast(pa.int64(), safe=False),
        _u64_as_long(pa, chunk.rev),
        pa.array(chunk.flags, pa.int64()),
        pa.array(chunk.expiry, pa.int64()),
        pa.array(chunk.datatype, pa.int32()),
        _u64_as_long(pa, ss),
        _u64_as_long(pa, se),
        _u64_as_long(pa, uu),
        position,
        stamp.cast(pa.timestamp("us", tz="UTC")),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema())
