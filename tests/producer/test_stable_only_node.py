"""Stable-only streams on a single node, with the server's own ``DurabilityMonitor``:
without a cluster the stable seqno is the persisted seqno (dcp/producer/durability.py),
so a stable-only stream follows the flusher."""

from __future__ import annotations

from pathlib import Path

from dcp.protocol import Status

from .conftest import client_of, running_server
from .test_stable_only import data_seqnos, open_dcp, quiet
from .wire import keys_for_vb, markers_of


async def test_a_stable_only_stream_follows_persistence(tmp_path: Path) -> None:
    keys = keys_for_vb(1, 8, 4)
    async with running_server(tmp_path / "d") as server:
        async with client_of(server) as kv, client_of(server) as so, client_of(server) as nm:
            await kv.set_many([(k, b"a") for k in keys[:4]])
            await server.flush_all()
            await open_dcp(so, "t-node-stable", stable_only=True)
            await open_dcp(nm, "t-node-normal", stable_only=False)
            assert (await so.stream_req(1)).status == Status.SUCCESS
            assert (await nm.stream_req(1)).status == Status.SUCCESS
            got = await so.read_stream_until(lambda f: data_seqnos([f]) == [4])
            assert data_seqnos(got) == [1, 2, 3, 4]  # persisted: stable at once

            server.pause_persistence()
            await kv.set_many([(k, b"b") for k in keys[4:]])
            normal = await nm.read_stream_until(lambda f: data_seqnos([f]) == [8])
            assert data_seqnos(normal)[-4:] == [5, 6, 7, 8]
            assert await quiet(so, 1.0) == []  # in memory only: nothing, not even a marker
            assert server.bucket.vbucket(1).persisted_seqno == 4

            server.resume_persistence()
            got = await so.read_stream_until(lambda f: data_seqnos([f]) == [8])
            assert data_seqnos(got) == [5, 6, 7, 8]
            assert all(e <= server.bucket.vbucket(1).persisted_seqno for _, e, _ in markers_of(got))
