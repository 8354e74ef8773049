"""``dcp-server``: run the server from flags, a TOML file or DCP_* environment variables.

Rules of this module: argument parsing, logging setup and signal handling only. The first
SIGINT/SIGTERM starts a graceful stop (streams end with Disconnected, everything queued is
flushed, a clean-shutdown marker is written, exit 0); a second one exits at once.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from pathlib import Path

import trio

from ..protocol.errors import StatusError
from .config import ConfigError, ServerConfig, add_arguments, load_config

__all__ = ["main"]

log = logging.getLogger("dcp.server")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


async def _serve(cfg: ServerConfig) -> None:
    from .server import DcpServer

    server = DcpServer(cfg)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)

            async def watch_signals() -> None:
                seen = 0
                async for sig in signals:
                    seen += 1
                    if seen == 1:
                        log.info("signal %s: shutting down gracefully (again to exit now)",
                                 signal.Signals(sig).name)
                        server.request_shutdown()
                    else:
                        log.warning("second signal: exiting immediately")
                        logging.shutdown()
                        os._exit(1)

            nursery.start_soon(watch_signals)
            await server.wait_stopped()
            nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dcp-server",
        description="DCP change-streaming server (Couchbase memcached-binary DCP wire format).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        print(f"dcp-server: {exc}", file=sys.stderr)
        return 2
    _setup_logging(cfg.log_level)
    # Many long-lived queued items: fewer, larger GC passes (research/perf-baseline.md §7).
    gc.set_threshold(100_000, 50, 100)
    sys.setswitchinterval(cfg.gil_switch_interval)
    data = Path(cfg.data_dir)
    if data.exists() and not data.is_dir():
        print(f"dcp-server: data dir {data} exists and is not a directory", file=sys.stderr)
        return 2
    try:
        trio.run(_serve, cfg)
    except BaseException as exc:
        leaf = _first_leaf(exc)
        if isinstance(leaf, KeyboardInterrupt | SystemExit) or not isinstance(leaf, Exception):
            raise
        if not isinstance(leaf, OSError | StatusError) and type(leaf).__module__ != "lmdb":
            raise  # a bug: keep the traceback
        print(f"dcp-server: {cfg.data_dir}: {leaf}", file=sys.stderr)
        return 1
    return 0


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


if __name__ == "__main__":
    sys.exit(main())
