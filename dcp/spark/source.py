"""The pyspark Python Data Source: ``spark.read.format("dcp")`` / ``spark.readStream``.

Rules of this module:
- Spark runs each method in a different process (see docs/spark.md, "How it works"):
  ``initialOffset``/``latestOffset``/``partitions``/``commit`` in the long-lived
  streaming source runner, the batch ``partitions`` in a planning worker, ``read`` in
  executor workers. So readers hold configuration only; the planner (a socket) is
  created lazily and dropped when the reader is pickled; ``read`` depends only on the
  partition and the configuration.
- Offsets cross Spark as canonical JSON (``offsets.py``); an idle stream returns its
  start offset unchanged, so Spark plans no empty batch. Spark hands the same offsets
  back at every poll (about every 12 ms when idle) and again to ``partitions``, so the
  stream reader keeps the last few it parsed or made (``_OffsetMemo``): an equal dict
  is not parsed again (a comparison costs ~0.2 ms, parsing 1024 vbuckets ~5 ms).
- ``read`` yields ``pyarrow.RecordBatch``es of whole snapshots (``executor.py``).
"""

from __future__ import annotations

import copy
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
from .batch_plan import VbRange, group_by_node, plan_ranges
from .driver import Planner
from .errors import DcpSparkError, OffsetError, OptionError
from .executor import read_ranges
from .offsets import Offsets, from_json, to_json
from .options import SourceConfig, parse_options

__all__ = ["DcpBatchReader", "DcpDataSource", "DcpPartition", "DcpStreamReader"]

_SPARK_TYPES = {
    "int": "integer",
    "long": "long",
    "string": "string",
    "binary": "binary",
    "timestamp": "timestamp",
}


class DcpPartition(InputPartition):
    """One Spark task: the vbucket ranges it reads, as plain tuples
    ``(vbucket, uuid, start, end, rollback)``, and on a cluster the ``node``
    ``(host, port)`` holding their vbuckets when the batch was planned (None: the
    query's single server)."""

    def __init__(
        self, index: int, ranges: list[VbRange], node: tuple[str, int] | None = None
    ) -> None:
        super().__init__(index)
        self.ranges = [
            (r.vbucket, r.uuid, r.start, r.end, r.rollback, r.end_uuid, r.prev, r.gen)
            for r in ranges
        ]
        self.node = node

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


def _need_pyarrow() -> None:
    """Executors convert rows with pyarrow: say so directly when this Python lacks it
    (instead of a worker crash far from the cause)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        import sys

        raise DcpSparkError(
            f"the dcp source needs pyarrow in the Python that Spark runs for its workers "
            f"({sys.executable}), which does not have it ({exc}). Point Spark at the "
            f"environment where this project is installed: PYSPARK_PYTHON=/path/to/.venv/"
            f"bin/python (or the spark.pyspark.python setting) before the session starts."
        ) from exc


def _read(cfg: SourceConfig, partition: InputPartition, what: str) -> Iterator[Any]:
    if not isinstance(partition, DcpPartition):  # Spark's placeholder for "no partitions"
        return
    _need_pyarrow()
    node = getattr(partition, "node", None)  # None also for a partition pickled before
    for chunk in read_ranges(cfg, partition.vb_ranges(), f"spark-dcp-{what}", node):
        yield to_record_batch(chunk)


class DcpDataSource(DataSource):
    """``format("dcp")``: every change of a DCP server's vbuckets, as rows.

    Options: see ``dcp.spark.options.OPTIONS`` and docs/spark.md.
    """

    @classmethod
    def name(cls) -> str:
        return "dcp"

    def schema(self) -> str:
        """Called by ``load()`` (in a Python worker): the options are checked here, so a
        typo fails at ``load()`` rather than when the query starts."""
        parse_options(dict(self.options), streaming=None)
        _need_pyarrow()
        return SCHEMA_DDL

    def reader(self, schema: Any) -> DataSourceReader:
        return DcpBatchReader(self.options, schema)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return DcpStreamReader(self.options, schema)


class DcpBatchReader(DataSourceReader):
    """A consistent read of every vbucket, ``(startingOffsets, endingOffsets]``: by
    default from 0 up to its high seqno when the read is planned (a merged snapshot on
    disk is read whole, so each vbucket ends on a real state)."""

    def __init__(self, options: Any, schema: Any) -> None:
        _check_schema(schema)
        self.cfg = parse_options(dict(options), streaming=False)

    def partitions(self) -> list[InputPartition]:
        planner = Planner(self.cfg)
        try:
            end = planner.ending_offsets()
            start = planner.on_branches(planner.initial_offsets())
            owners = planner.owners()
        finally:
            planner.close()
        for vb, e in end.items():
            if e.seqno < start[vb].seqno:
                raise OffsetError(
                    f"vbucket {vb}: endingOffsets seqno {e.seqno} is below startingOffsets "
                    f"seqno {start[vb].seqno}"
                )
        groups = group_by_node(plan_ranges(start, end), owners, self.cfg.partitions)
        return [DcpPartition(i, g, node) for i, (node, g) in enumerate(groups)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.cfg, partition, "batch")


class _OffsetMemo:
    """The last few offsets as Spark's dicts beside their parsed form (see the module
    rules). The parsed ``Offsets`` are shared: callers do not change them."""

    SIZE = 4

    def __init__(self) -> None:
        self._pairs: list[tuple[dict, Offsets]] = []

    def parse(self, obj: dict) -> Offsets:
        for known, offsets in self._pairs:
            if known == obj:
                return offsets
        return self.keep(obj, from_json(obj))

    def keep(self, obj: dict, offsets: Offsets) -> Offsets:
        # a copy: the caller may change its dict later, which must not change what it meant
        self._pairs = [(copy.deepcopy(obj), offsets), *self._pairs[: self.SIZE - 1]]
        return offsets


class DcpStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches that end, per vbucket, on snapshot boundaries."""

    def __init__(self, options: Any, schema: Any) -> None:
        _check_schema(schema)
        self.cfg = parse_options(dict(options), streaming=True)
        self._planner: Planner | None = None
        self._target: dict[int, int] | None = None
        self._history_checked = False
        self._memo = _OffsetMemo()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_planner"] = None  # a socket: never shipped to other processes
        state["_memo"] = _OffsetMemo()  # driver-side only
        return state

    def _out(self, offsets: Offsets) -> dict:
        """``offsets`` as Spark's JSON dict, remembered with its parsed form (a dict of
        its own: the one handed to Spark is Spark's)."""
        self._memo.keep(to_json(offsets), offsets)
        return to_json(offsets)

    @property
    def planner(self) -> Planner:
        if self._planner is None:
            self._planner = Planner(self.cfg)
            if not self._history_checked:  # once per query run (this runner process)
                self._history_checked = True
                self._planner.warn_without_history()
        return self._planner

    def initialOffset(self) -> dict:
        return self._out(self.planner.initial_offsets())

    def getDefaultReadLimit(self) -> ReadLimit:
        cfg = self.cfg
        if cfg.max_rows_per_batch:
            return ReadMaxRows(cfg.max_rows_per_batch)
        if cfg.min_rows_per_batch:
            return ReadMinRows(cfg.min_rows_per_batch)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self.planner.target()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = self._memo.parse(start)
        cfg = self.cfg
        # Spark hands one limit; the other bound of a min/max pair comes from the options.
        # ReadAllAvailable (availableNow, or no bound set) lifts both.
        max_rows = min_rows = None
        if isinstance(limit, ReadMaxRows):
            max_rows, min_rows = limit.max_rows, cfg.min_rows_per_batch
        elif isinstance(limit, ReadMinRows):
            max_rows, min_rows = cfg.max_rows_per_batch, limit.min_rows
        end = self.planner.latest(
            begin,
            limit=max_rows,
            min_rows=min_rows or 0,
            max_delay=cfg.max_trigger_delay,
            target=self._target,
        )
        if end == begin:
            return start  # unchanged text: Spark plans no batch
        return self._out(end)

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        begin, finish = self._memo.parse(start), self._memo.parse(end)
        ranges = plan_ranges(begin, finish)
        planner = self.planner
        planner.remember(begin, finish)
        groups = group_by_node(ranges, planner.owners(), self.cfg.partitions)
        return [DcpPartition(i, g, node) for i, (node, g) in enumerate(groups)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.cfg, partition, "stream")

    def commit(self, end: dict) -> None:
        """Spark's checkpoint is the source of truth; nothing to do on the server."""

    def stop(self) -> None:
        if self._planner is not None:
            self._planner.close()
            self._planner = None
