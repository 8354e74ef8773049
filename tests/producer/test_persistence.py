"""``Persistence`` on its own: a real bucket and storage, storage errors injected.

The final flush's rules (persistence.py): a full *map* grows the map and tries again; a
full disk or an I/O error gives up at once; either way the caller learns whether
everything acknowledged was persisted. Pause, the storage error and the wake-up of
connections with durable writes waiting are checked here too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from dcp.producer.config import ServerConfig
from dcp.producer.engine import (
    Bucket,
    DiskFullError,
    EngineConfig,
    StorageError,
    StorageFullError,
)
from dcp.producer.metrics import ServerMetrics
from dcp.producer.persistence import Persistence
from dcp.protocol.layout import vbucket_for_key


class Waiter:
    """A connection as the flusher sees it."""

    def __init__(self, pending: bool) -> None:
        self.pending = pending
        self.woken = 0

    def has_pending_durable(self) -> bool:
        return self.pending

    def wake(self) -> None:
        self.woken += 1


@pytest.fixture
def bucket(tmp_path: Path) -> Iterator[Bucket]:
    uuids = itertools.count(1)
    b = Bucket.open(
        tmp_path / "data",
        EngineConfig(num_vbuckets=4, map_size=64 << 20),
        clock=lambda: 1000.0,
        uuid_source=lambda: next(uuids),
    )
    yield b
    b.close()


def _persistence(bucket: Bucket, *waiters: Waiter) -> Persistence:
    cfg = ServerConfig(num_vbuckets=4, flush_batch_items=1000)
    return Persistence(bucket, cfg, ServerMetrics(), list(waiters), clock=lambda: 1000.0)


def _write(bucket: Bucket, n: int) -> None:
    for i in range(n):
        key = b"k%d" % i
        bucket.set(vbucket_for_key(key, bucket.num_vbuckets), key, b"v")


def _all_persisted(bucket: Bucket) -> bool:
    return all(
        bucket.vbucket(vb).persisted_seqno == bucket.vbucket(vb).high_seqno
        for vb in range(bucket.num_vbuckets)
    )


class Faults:
    """``write_batch`` raises the given errors first, then writes; ``grow_map`` records."""

    def __init__(self, bucket: Bucket, errors: list[BaseException]) -> None:
        self.errors = list(errors)
        self.grown: list[int] = []
        storage: Any = bucket.storage
        real = storage.write_batch

        def write_batch(batch: Any) -> None:
            if self.errors:
                raise self.errors.pop(0)
            real(batch)

        storage.write_batch = write_batch
        storage.grow_map = self.grown.append


async def test_a_full_map_at_the_final_flush_grows_the_map_and_persists_everything(
    bucket: Bucket,
) -> None:
    _write(bucket, 20)
    size = bucket.storage.map_size
    faults = Faults(bucket, [StorageFullError("map full"), StorageFullError("map full")])
    assert await _persistence(bucket).final_flush() is True
    assert faults.grown == [2 * size, 2 * size]  # (the fake grow_map leaves the size)
    assert _all_persisted(bucket)


@pytest.mark.parametrize(
    "error", [DiskFullError("no space left on device"), StorageError("I/O error")]
)
async def test_a_full_disk_or_an_io_error_ends_the_final_flush_at_once_without_growing(
    bucket: Bucket, error: StorageError
) -> None:
    _write(bucket, 20)
    faults = Faults(bucket, [error])
    assert await _persistence(bucket).final_flush() is False
    assert faults.grown == []
    assert not _all_persisted(bucket)
    assert bucket.flusher.pending_items() == 20  # still queued: nothing was dropped


async def test_a_map_that_never_fits_gives_up_after_a_bounded_number_of_growths(
    bucket: Bucket,
) -> None:
    _write(bucket, 5)
    faults = Faults(bucket, [StorageFullError("map full")] * 100)
    assert await _persistence(bucket).final_flush() is False
    assert 1 <= len(faults.grown) <= 8


async def test_paused_persistence_writes_nothing_until_resumed(bucket: Bucket) -> None:
    _write(bucket, 10)
    p = _persistence(bucket)
    p.pause()
    assert await p.flush_once(respect_pause=True) is False
    assert bucket.flusher.pending_items() == 10
    async with trio.open_nursery() as nursery:
        nursery.start_soon(p.run_flusher)
        await trio.sleep(0.1)
        assert bucket.flusher.pending_items() == 10  # the flusher waits while paused
        p.resume()
        with trio.fail_after(5):
            while not _all_persisted(bucket):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


async def test_a_failed_flush_sets_the_storage_error_and_refuses_writes_until_one_succeeds(
    bucket: Bucket,
) -> None:
    _write(bucket, 3)
    Faults(bucket, [StorageError("EIO")])
    p = _persistence(bucket)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(p.run_flusher)
        with trio.fail_after(5):
            while p.storage_error is None:
                await trio.sleep(0.005)
        assert "EIO" in p.write_refusal()
        assert p.metrics.flush_errors == 1
        with trio.fail_after(5):  # the retry succeeds: the error clears, writes are welcome
            while p.storage_error is not None:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert p.write_refusal() == ""
    assert _all_persisted(bucket)


async def test_a_flush_that_persists_something_wakes_only_connections_with_durable_writes(
    bucket: Bucket,
) -> None:
    waiting, idle = Waiter(pending=True), Waiter(pending=False)
    p = _persistence(bucket, waiting, idle)
    _write(bucket, 4)
    assert await p.flush_once() is True
    assert (waiting.woken, idle.woken) == (1, 0)
    assert await p.flush_once() is False  # nothing queued: nobody woken again
    assert waiting.woken == 1
