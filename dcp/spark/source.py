"""The pyspark Python Data Source: ``spark.read.format("dcp")`` / ``spark.readStream``.

Rules of this module:
- Spark runs each method in a different process (see docs/spark.md, "How it works"):
  ``initialOffset``/``latestOffset``/``partitions``/``commit`` in the long-lived
  streaming source runner, the batch ``partitions`` in a planning worker, ``read`` in
  executor workers. So readers hold configuration only; the planner (a socket) is
  created lazily and dropped when the reader is pickled; ``read`` depends only on the
  partition and the configuration.
- Offsets cross Spark as canonical JSON (``offsets.py``); an idle stream returns its
  start offset unchanged, so Spark plans no empty batch.
- ``read`` yields ``pyarrow.RecordBatch``es of whole snapshots (``executor.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)

from .arrow import COLUMNS, SCHEMA_DDL, to_record_batch
from .batch_plan import VbRange, group_ranges, plan_ranges
from .driver import Planner
from .errors import OptionError
from .executor import read_ranges
from .offsets import from_json, to_json
from .options import SourceConfig, parse_options

__all__ = ["DcpBatchReader", "DcpDataSource", "DcpPartition", "DcpStreamReader"]

_SPARK_TYPES = {"int": "integer", "long": "long", "string": "string", "binary": "binary"}


class DcpPartition(InputPartition):
    """One Spark task: the vbucket ranges it reads, as plain tuples
    ``(vbucket, uuid, start, end, rollback)``."""

    def __init__(self, index: int, ranges: list[VbRange]) -> None:
        super().__init__(index)
        self.ranges = [(r.vbucket, r.uuid, r.start, r.end, r.rollback) for r in ranges]

    def vb_ranges(self) -> list[VbRange]:
        return [VbRange(*t) for t in self.ranges]


def _check_schema(schema: Any) -> None:
    """The source has a fixed schema: a user-given one must be the same."""
    fields = getattr(schema, "fields", None)
    if fields is None:
        return
    got = [(f.name, f.dataType.typeName()) for f in fields]
    want = [(n, _SPARK_TYPES[t]) for n, t in COLUMNS]
    if got != want:
        raise OptionError(
            f"the dcp source has a fixed schema ({SCHEMA_DDL}); a different schema was given: {got}"
        )


def _read(cfg: SourceConfig, partition: InputPartition, what: str) -> Iterator[Any]:
    if not isinstance(partition, DcpPartition):  # Spark's placeholder for "no partitions"
        return
    for chunk in read_ranges(cfg, partition.vb_ranges(), f"spark-dcp-{what}"):
        yield to_record_batch(chunk)


class DcpDataSource(DataSource):
    """``format("dcp")``: every change of a DCP server's vbuckets, as rows.

    Options: see ``dcp.spark.options.OPTIONS`` and docs/spark.md.
    """

    @classmethod
    def name(cls) -> str:
        return "dcp"

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: Any) -> DataSourceReader:
        return DcpBatchReader(self.options, schema)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return DcpStreamReader(self.options, schema)


class DcpBatchReader(DataSourceReader):
    """A consistent read of every vbucket up to its high seqno when the read is planned
    (a merged snapshot on disk is read whole, so each vbucket ends on a real state)."""

    def __init__(self, options: Any, schema: Any) -> None:
        _check_schema(schema)
        self.cfg = parse_options(dict(options), streaming=False)

    def partitions(self) -> list[InputPartition]:
        planner = Planner(self.cfg)
        try:
            highs, _ = planner.refresh(force=True)
        finally:
            planner.close()
        ranges = [VbRange(vb, 0, 0, h) for vb, h in sorted(highs.items()) if h > 0]
        groups = group_ranges(ranges, self.cfg.partitions) if ranges else []
        return [DcpPartition(i, g) for i, g in enumerate(groups)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.cfg, partition, "batch")


class DcpStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches that end, per vbucket, on snapshot boundaries."""

    def __init__(self, options: Any, schema: Any) -> None:
        _check_schema(schema)
        self.cfg = parse_options(dict(options), streaming=True)
        self._planner: Planner | None = None
        self._target: dict[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_planner"] = None  # a socket: never shipped to other processes
        return state

    @property
    def planner(self) -> Planner:
        if self._planner is None:
            self._planner = Planner(self.cfg)
        return self._planner

    def initialOffset(self) -> dict:
        return to_json(self.planner.initial_offsets())

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.cfg.max_rows_per_batch
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self.planner.target()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = from_json(start)
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        min_rows = limit.min_rows if isinstance(limit, ReadMinRows) else 0
        end = self.planner.latest(begin, limit=max_rows, min_rows=min_rows, target=self._target)
        if end == begin:
            return start  # unchanged text: Spark plans no batch
        return to_json(end)

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        begin, finish = from_json(start), from_json(end)
        ranges = plan_ranges(begin, finish)
        self.planner.remember(begin, finish)
        return [DcpPartition(i, g) for i, g in enumerate(group_ranges(ranges, self.cfg.partitions))]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.cfg, partition, "stream")

    def commit(self, end: dict) -> None:
        """Spark's checkpoint is the source of truth; nothing to do on the server."""

    def stop(self) -> None:
        if self._planner is not None:
            self._planner.close()
            self._planner = None
