"""A server that fails to start leaves trio as it found it."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from dcp.producer.engine.errors import StorageError
from dcp.producer.server import DcpServer, ServerConfig


async def test_a_failed_start_raises_and_the_next_server_starts(tmp_path: Path) -> None:
    bad = tmp_path / "data"
    bad.mkdir()
    (bad / "data.mdb").write_bytes(b"not lmdb at all" * 10)  # refused before it is mapped
    with pytest.raises((StorageError, OSError)):
        async with DcpServer(ServerConfig(port=0, data_dir=str(bad), num_vbuckets=4)):
            pass
    # the same task can go on: no nursery was left open by the failed start
    await trio.sleep(0)
    async with DcpServer(ServerConfig(port=0, data_dir=str(tmp_path / "ok"), num_vbuckets=4)) as s:
        assert s.port
