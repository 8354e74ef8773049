"""Applying a change feed that a sink stored: the current documents, rollbacks included.

Rules of this module:
- Works on any DataFrame with the source's columns (a parquet sink read back, a Delta
  table, ...); pure DataFrame operations, no I/O of its own.
- The rules it applies are the connector's guarantees (docs/spark.md, "Sinks"):
  ``position`` orders a vbucket's rows across the whole stream (rollback generation,
  then seqno); a ``rollback`` row at seqno R undoes every row of its vbucket that came
  before it (lower ``position``) with a seqno above R; what remains, newest per key by
  ``position``, is the state the server has now (up to what the stream read). A key
  always maps to the same vbucket, so ``position`` compares the versions of one key.
"""

from __future__ import annotations

from typing import Any

__all__ = ["current_documents", "live_changes"]


def live_changes(changes: Any) -> Any:
    """The change rows no later ``rollback`` row undid (rollback rows dropped)."""
    from pyspark.sql import functions as F

    rollbacks = changes.where("op = 'rollback'").select(
        F.col("vbucket").alias("rb_vbucket"),
        F.col("seqno").alias("rb_seqno"),
        F.col("position").alias("rb_position"),
    )
    rows = changes.where("op != 'rollback'")
    undone = (
        (rows["vbucket"] == rollbacks["rb_vbucket"])
        & (rows["seqno"] > rollbacks["rb_seqno"])
        & (rows["position"] < rollbacks["rb_position"])
    )
    return rows.join(rollbacks, undone, "left_anti")


def current_documents(changes: Any) -> Any:
    """One row per live document: its newest surviving change, when that is a mutation
    (deletions and expirations remove the document)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    newest = Window.partitionBy("key").orderBy(F.col("position").desc())
    return (
        live_changes(changes)
        .withColumn("_n", F.row_number().over(newest))
        .where("_n = 1 AND op = 'mutation'")
        .drop("_n")
    )
