"""Backfill limits on a running server: disk reads one at a time server-wide
(``backfill_disk_readers``), several scans per connection (``max_concurrent_backfills``),
and connections taking turns at the disk so a huge scan never starves another's.

The scans' reads are slowed (a sleep in the worker thread, as a slow disk would) so that
reads which could overlap do, and a long scan is long enough to be overtaken."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from dcp.producer.config import ConfigError, ServerConfig
from dcp.producer.engine.backfill import BackfillScan
from dcp.protocol import Opcode, SnapshotMarkerFlag, Status, codec

from .conftest import client_of, running_server
from .wire import WireClient, items_of, keys_for_vb, markers_of


class ReadWatch:
    """Wraps ``BackfillScan.read_frames``: counts reads under way at once (threads) and
    the scans open meanwhile, and makes each read last ``delay`` seconds at least."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.reads = 0
        self.most_open = 0
        self.storage: Any = None  # the server's, to count its open scans
        original = BackfillScan.read_frames
        watch = self

        def read_frames(scan: BackfillScan, *args: Any) -> Any:
            storage = watch.storage
            with watch.lock:
                watch.now += 1
                watch.reads += 1
                watch.most = max(watch.most, watch.now)
                if storage is not None:
                    watch.most_open = max(watch.most_open, storage.open_scans)
            try:
                time.sleep(delay)
                return original(scan, *args)
            finally:
                with watch.lock:
                    watch.now -= 1

        monkeypatch.setattr(BackfillScan, "read_frames", read_frames)


async def load(data: Path, per_vb: dict[int, int], num_vbuckets: int) -> dict[int, list[bytes]]:
    """Write ``per_vb[vb]`` keys to each vbucket, then stop: the next server on ``data``
    holds them on disk only, so every stream of them is a backfill."""
    keys = {vb: keys_for_vb(vb, n, num_vbuckets) for vb, n in per_vb.items()}
    async with running_server(data, num_vbuckets=num_vbuckets) as server:
        async with client_of(server) as c:
            for ks in keys.values():
                await c.set_many([(k, b"value-of-" + k) for k in ks])
    return keys


async def read_streams(c: WireClient, ends: dict[int, int], timeout: float = 30.0) -> list[Any]:
    """Stream each vbucket of ``ends`` up to its end seqno and read every stream to its
    end; the frames, in arrival order."""
    for vb, end in ends.items():
        assert (await c.stream_req(vb, end=end)).status == Status.SUCCESS
    left = set(ends)

    def ended(f: Any) -> bool:
        if f.opcode == Opcode.DCP_STREAM_END:
            left.discard(f.vbucket)
        return not left

    return await c.read_stream_until(ended, timeout=timeout, ack=True)


async def test_one_disk_read_at_a_time_while_each_connection_runs_several_scans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nv = 8
    keys = await load(tmp_path / "d", {vb: 300 for vb in range(nv)}, nv)
    watch = ReadWatch(monkeypatch, delay=0.005)
    # a small buffer: every scan takes several chunks, so scans overlap in time
    async with running_server(
        tmp_path / "d", num_vbuckets=nv, backfill_buffer_bytes=4096, max_concurrent_backfills=4
    ) as server:
        watch.storage = server.bucket.storage
        got: dict[str, list[Any]] = {}

        async def reader(name: str, vbs: list[int]) -> None:
            async with client_of(server) as c:
                await c.dcp_open(name)
                got[name] = await read_streams(c, dict.fromkeys(vbs, 300))

        async with trio.open_nursery() as n:
            n.start_soon(reader, "t-even", [0, 2, 4, 6])
            n.start_soon(reader, "t-odd", [1, 3, 5, 7])
    for frames in got.values():
        assert all(flags & SnapshotMarkerFlag.DISK for _, _, flags in markers_of(frames))
        for vb in {f.vbucket for f in frames}:
            mine = [(s, k) for _, s, k, _ in items_of([f for f in frames if f.vbucket == vb])]
            assert mine == list(enumerate(keys[vb], start=1))
    assert watch.reads > 2 * nv  # several chunks per scan
    assert watch.most == 1  # never two disk reads at once, across both connections
    assert watch.most_open >= 3  # yet several scans were open at once


async def test_a_small_backfill_overtakes_a_huge_one_of_another_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nv = 2
    await load(tmp_path / "d", {0: 3000, 1: 5}, nv)
    watch = ReadWatch(monkeypatch, delay=0.01)
    # 1 KiB of buffer: chunks of 16 items, so vb 0 takes ~190 reads (~2 s at 10 ms each)
    async with running_server(tmp_path / "d", num_vbuckets=nv, backfill_buffer_bytes=1024) as srv:
        done: dict[str, float] = {}

        async with client_of(srv) as big, client_of(srv) as small:
            await big.dcp_open("t-big")
            await small.dcp_open("t-small")

            async def read_big() -> None:
                await read_streams(big, {0: 3000}, timeout=60)
                done["big"] = trio.current_time()

            async with trio.open_nursery() as n:
                n.start_soon(read_big)
                while watch.reads < 5:  # the huge scan is under way
                    await trio.sleep(0.01)
                t0 = trio.current_time()
                frames = await read_streams(small, {1: 5}, timeout=60)
                done["small"] = trio.current_time()
        assert [s for _, s, _, _ in items_of(frames)] == [1, 2, 3, 4, 5]
        assert done["small"] < done["big"]
        assert done["small"] - t0 < 0.5 * (done["big"] - t0)


async def test_a_backfill_waiting_for_a_stream_that_is_closed_frees_its_slot(
    tmp_path: Path,
) -> None:
    """A backfill paused on its buffer waits for the writer; a stream closed meanwhile
    never drains it and does not wake it: the backfill must still notice (its periodic
    recheck) and give the connection's only slot to the next vbucket."""
    nv = 2
    keys = await load(tmp_path / "d", {0: 3000, 1: 5}, nv)
    async with running_server(
        tmp_path / "d", num_vbuckets=nv, backfill_buffer_bytes=4096, max_concurrent_backfills=1
    ) as srv:
        async with client_of(srv) as c:
            await c.dcp_open("t-closed")
            await c.control("connection_buffer_size", str(16 * 1024))
            assert (await c.stream_req(0, end=3000)).status == Status.SUCCESS
            # not acked: the window fills, the writer stops, the scan waits on its buffer
            first = await c.frames_for(0.3)
            assert 0 < len(items_of(first)) < 3000
            await c.send(codec.request(Opcode.DCP_CLOSE_STREAM, vbucket=0, opaque=77))
            await c.ack_all(first)
            assert (await c.stream_req(1, end=5)).status == Status.SUCCESS
            frames = await c.read_stream_until(
                lambda f: f.opcode == Opcode.DCP_STREAM_END and f.vbucket == 1, ack=True
            )
    assert [k for _, _, k, _ in items_of([f for f in frames if f.vbucket == 1])] == keys[1]


def test_backfill_disk_readers_must_be_positive() -> None:
    assert ServerConfig().backfill_disk_readers == 1
    with pytest.raises(ConfigError, match="backfill_disk_readers must be positive"):
        ServerConfig(backfill_disk_readers=0).validate()
