"""Fixtures for engine tests: a settable clock, a deterministic uuid source, buckets."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dcp.producer.engine import Bucket, EngineConfig


class FakeClock:
    """Epoch seconds that only move when a test says so."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class UuidSource:
    """Deterministic vbucket uuids: 0x1000, 0x1001, ..."""

    def __init__(self, start: int = 0x1000) -> None:
        self._it = itertools.count(start)

    def __call__(self) -> int:
        return next(self._it)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def uuids() -> UuidSource:
    return UuidSource()


def small_config(**kw: object) -> EngineConfig:
    base: dict[str, object] = dict(num_vbuckets=4, map_size=64 * 1024 * 1024, lmdb_sync=False)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def open_bucket(
    tmp_path: Path, clock: FakeClock, uuids: UuidSource
) -> Iterator[Callable[..., Bucket]]:
    """``open_bucket(**config)`` opens (or reopens) the bucket in one data dir."""
    opened: list[Bucket] = []

    def _open(**kw: object) -> Bucket:
        b = Bucket.open(tmp_path / "data", small_config(**kw), clock=clock, uuid_source=uuids)
        opened.append(b)
        return b

    yield _open
    for b in opened:
        b.close(clean=False)


@pytest.fixture
def bucket(open_bucket: Callable[..., Bucket]) -> Bucket:
    return open_bucket()
