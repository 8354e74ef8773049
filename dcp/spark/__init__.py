"""PySpark connector: ``spark.read.format("dcp")`` and ``spark.readStream.format("dcp")``.

Micro-batches hold whole snapshots only: offsets are per-vbucket ``(vbucket uuid, seqno)``
positions on snapshot boundaries, executors re-read exactly ``(start, end]`` and check the
server's snapshot markers, and a rollback is never silent. See ``docs/spark.md``.

Imports ``dcp.protocol`` (and pyspark/pyarrow, the ``spark`` extra) only. The Spark
classes are loaded lazily, so the option, offset and planning modules can be used without
pyspark installed.
"""

from __future__ import annotations

from typing import Any

from .errors import (
    DcpSparkError,
    MergedSnapshotError,
    OffsetError,
    OptionError,
    RangeUnavailableError,
    RollbackDetectedError,
    TlsError,
)

__all__ = [
    "DcpBatchReader",
    "DcpDataSource",
    "DcpSparkError",
    "DcpStreamReader",
    "MergedSnapshotError",
    "OffsetError",
    "OptionError",
    "RangeUnavailableError",
    "RollbackDetectedError",
    "TlsError",
    "current_documents",
    "live_changes",
    "register",
]

_LAZY = {"DcpDataSource", "DcpBatchReader", "DcpStreamReader"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import source

        return getattr(source, name)
    if name in ("current_documents", "live_changes"):
        from . import apply

        return getattr(apply, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(spark: Any) -> None:
    """Register the ``dcp`` format on a session explicitly. Spark finds the installed
    ``pyspark_dcp`` module by itself only when it sees it on its module listing, which an
    editable install hides outside the repository root (docs/spark.md, "Install");
    registering twice is harmless."""
    from .source import DcpDataSource

    spark.dataSource.register(DcpDataSource)
