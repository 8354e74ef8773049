"""Test helpers: the real server on its own thread (its own ``trio.run``), and writes.

Spark's executors are other processes, so the server must be reachable over a socket
while the test (the Spark driver) blocks in pyspark calls: a background thread with its
own trio loop does that, and the test reaches into it with ``trio.from_thread``.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import trio

from dcp.consumer import BlockingKvClient
from dcp.producer.server import DcpServer, ServerConfig


class ThreadServer:
    """``DcpServer`` on a background thread. ``stop(clean=False)`` is a crash: no final
    flush, no clean-shutdown marker; a new ``ThreadServer`` on the same directory then
    recovers like after ``kill -9``."""

    def __init__(self, data_dir: Path, num_vbuckets: int = 16, port: int = 0, **kw: Any) -> None:
        self.data_dir = data_dir
        self.num_vbuckets = num_vbuckets
        self.config = ServerConfig(
            host="127.0.0.1",
            port=port,
            data_dir=str(data_dir),
            num_vbuckets=num_vbuckets,
            log_level="WARNING",
            **kw,
        )
        self.crashed: BaseException | None = None
        ready: queue.Queue = queue.Queue()

        async def main() -> None:
            async with DcpServer(self.config) as server:
                ready.put((server, trio.lowlevel.current_trio_token()))
                await server._shutdown.wait()

        def target() -> None:
            try:
                trio.run(main)
            except BaseException as exc:  # pragma: no cover - reported to the test
                self.crashed = exc
                ready.put(exc)

        self._thread = threading.Thread(target=target, name="dcp-server", daemon=True)
        self._thread.start()
        got = ready.get(timeout=60)
        if isinstance(got, BaseException):
            raise got
        self.server: DcpServer = got[0]
        self._token = got[1]
        self.port: int = self.server.port
        self.stopped = False

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a sync function on the server's trio thread."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def flush(self) -> None:
        trio.from_thread.run(self.server.flush_all, trio_token=self._token)

    def pause_persistence(self) -> None:
        self.call(self.server.pause_persistence)

    def stop(self, clean: bool = True) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.crashed is None:
            self.call(self.server.request_shutdown, clean)
        self._thread.join(60)
        if self.crashed is not None:
            raise AssertionError(f"the server crashed: {self.crashed!r}") from self.crashed

    def kv(self) -> BlockingKvClient:
        return BlockingKvClient("127.0.0.1", self.port, num_vbuckets=self.num_vbuckets)
