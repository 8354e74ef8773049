"""Fixtures of the Spark connector tests: one local Spark session for the whole run,
tuned for start-up time (docs/spark.md, "Testing"), and the real server per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .helpers import ThreadServer

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors use this venv


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("dcp-spark-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.streaming.stopTimeout", "10s")
        .config("spark.driver.extraJavaOptions", "-XX:+UseSerialGC -XX:TieredStopAtLevel=1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


#: Server settings with the change history off, explicitly (the server's default today;
#: the tests of the no-history paths say so, whatever the default becomes).
NO_HISTORY = {"history_seconds": 0, "history_bytes": 0}
#: A bounded change history (what docs/spark.md asks streaming servers to run with).
HISTORY = {"history_seconds": 3600, "history_bytes": 1 << 30}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    """A server with default settings."""
    s = ThreadServer(tmp_path / "data")
    yield s
    s.stop()


@pytest.fixture
def no_history_server(tmp_path: Path) -> Iterator[ThreadServer]:
    """History explicitly off, the default checkpoint retention (10 s)."""
    s = ThreadServer(tmp_path / "data", **NO_HISTORY)
    yield s
    s.stop()


@pytest.fixture
def disk_server(tmp_path: Path) -> Iterator[ThreadServer]:
    """History explicitly off and no checkpoint retention: a persisted range is freed
    from memory at once, so ranges are read from disk (merged by later rewrites)."""
    s = ThreadServer(tmp_path / "data", checkpoint_retain_seconds=0, **NO_HISTORY)
    yield s
    s.stop()


@pytest.fixture
def history_server(tmp_path: Path) -> Iterator[ThreadServer]:
    """A server that keeps every version for an hour (exact replays)."""
    s = ThreadServer(tmp_path / "data", history_seconds=3600)
    yield s
    s.stop()
