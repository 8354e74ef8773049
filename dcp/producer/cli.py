"""``dcp-server``: run the server from flags, a TOML file or DCP_* environment variables.

Rules of this module: argument parsing, logging setup, signal handling and the exit code
only. The first SIGINT/SIGTERM starts a graceful stop (streams end with Disconnected,
everything queued is flushed, a clean-shutdown marker is written, exit 0); a second one
exits at once. SIGHUP re-reads the users file (a bad one is logged and the old users
stay; auth.py) and the TLS files: the listener's certificate and key, the replication
connections' CA and client certificate (bad files are logged, the old ones stay).
Safe default (docs/security.md): without a users file the server only listens on
loopback; a non-loopback ``host`` without one refuses to start (exit 2) with a line
saying how to add a user. Exit codes (docs/operations.md, "Damaged data files and exit
codes"):

    0  stopped cleanly: everything acknowledged is persisted
    1  a runtime error stopped the server (port in use, an LMDB error at open...), or a
       second signal cut the graceful stop short
    2  bad settings (a users file that does not load, a public address without one,
       ``users_etcd`` not answering at start or holding a record that does not load,
       ``cluster``: etcd not answering at start, or the join refused — a node name
       held by a live node, another vbucket count, another cluster's data directory)
    3  refused to start: the data directory is damaged (truncated, emptied or missing
       data file; ``datafiles.py``); nothing was changed. ``--reset-data`` sets a damaged
       data file aside and starts empty (an intact store is never touched)
    4  stopped, but the final flush could not persist every acknowledged write (disk
       full, I/O error); the next start treats the stop as a crash

``faulthandler`` is on: should the data file be truncated under a running server (its
map then faults), the process dies with a traceback on stderr instead of silently.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import signal
import sys
from pathlib import Path

import trio

from ..protocol.errors import StatusError
from ..protocol.sasl import is_loopback_host
from .cluster.membership import JoinRefused
from .cluster.store import StoreUnavailable
from .config import ConfigError, ServerConfig, add_arguments, load_config
from .engine.datafiles import set_aside_damaged
from .engine.errors import DataDirError
from .server import DcpServer
from .users import Users, UsersFileError

__all__ = ["main"]

log = logging.getLogger("dcp.server")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DATA_DIR = 3
EXIT_UNPERSISTED = 4


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def auth_refusal(cfg: ServerConfig) -> str:
    """Why the server must not start with these auth settings ('' when it may)."""
    if cfg.users_file:
        try:
            Users.load(cfg.users_file)
        except UsersFileError as exc:
            return str(exc)
        return ""
    if cfg.users_etcd or is_loopback_host(cfg.host):  # etcd's users are checked at start
        return ""
    return (
        f"refusing to listen on {cfg.host or 'every interface'} without users: add one with "
        "`dcpctl user add NAME --role all --users-file users.toml` and start with "
        "--users-file users.toml (or listen on 127.0.0.1)"
    )


def reload_settings(server: DcpServer) -> None:
    """SIGHUP: re-read the users file and the TLS certificate; bad files keep the old."""
    if server.authenticator is not None:
        server.authenticator.reload()
    else:
        log.info("SIGHUP: no users file configured; nothing to reload")
    if server.tls_context is not None or server.config.replication_tls:
        try:
            server.reload_tls()
        except (ConfigError, OSError) as exc:
            log.error("TLS certificate not reloaded, keeping the previous one: %s", exc)


async def _serve(cfg: ServerConfig) -> bool:
    """Run until stopped; True when the stop was clean (everything persisted)."""
    server = DcpServer(cfg)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)

            async def watch_signals() -> None:
                seen = 0
                async for sig in signals:
                    if sig == signal.SIGHUP:
                        reload_settings(server)
                        continue
                    seen += 1
                    if seen == 1:
                        log.info(
                            "signal %s: shutting down gracefully (again to exit now)",
                            signal.Signals(sig).name,
                        )
                        server.request_shutdown()
                    else:
                        log.warning("second signal: exiting immediately")
                        logging.shutdown()
                        os._exit(1)

            nursery.start_soon(watch_signals)
            await server.wait_stopped()
            nursery.cancel_scope.cancel()
    return server.clean_shutdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dcp-server",
        description="DCP change-streaming server (Couchbase memcached-binary DCP wire format).",
    )
    add_arguments(parser)
    parser.add_argument(
        "--reset-data",
        action="store_true",
        help="if the data directory is damaged (truncated, emptied or "
        "missing data file), set the data file aside and start with "
        "an empty store; an intact store is left alone",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        print(f"dcp-server: {exc}", file=sys.stderr)
        return EXIT_USAGE
    refusal = auth_refusal(cfg)
    if refusal:
        print(f"dcp-server: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    _setup_logging(cfg.log_level)
    faulthandler.enable()
    # Many long-lived queued items: fewer, larger GC passes (the default thresholds made
    # the collector walk every queued item over and over under ingest).
    gc.set_threshold(100_000, 50, 100)
    sys.setswitchinterval(cfg.gil_switch_interval)
    data = Path(cfg.data_dir).resolve()  # error lines name the directory unambiguously
    if data.exists() and not data.is_dir():
        print(f"dcp-server: data dir {data} exists and is not a directory", file=sys.stderr)
        return EXIT_USAGE
    if args.reset_data:
        code = _reset_data(data)
        if code:
            return code
    try:
        clean = trio.run(_serve, cfg)
    except BaseException as exc:
        leaf = _first_leaf(exc)
        if isinstance(leaf, KeyboardInterrupt | SystemExit) or not isinstance(leaf, Exception):
            raise
        if isinstance(leaf, UsersFileError):  # users_etcd: etcd silent or a bad record
            print(f"dcp-server: refusing to start: {leaf}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(leaf, JoinRefused | StoreUnavailable):  # cluster: cannot join
            print(f"dcp-server: refusing to join cluster: {leaf}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(leaf, DataDirError):
            print(f"dcp-server: refusing to start: {leaf.detail}", file=sys.stderr)
            return EXIT_DATA_DIR
        if not isinstance(leaf, OSError | StatusError) and type(leaf).__module__ != "lmdb":
            raise  # a bug: keep the traceback
        print(f"dcp-server: {data}: {leaf}", file=sys.stderr)
        return EXIT_FAILED
    if not clean:
        print(
            "dcp-server: stopped without persisting every acknowledged write (see the log above)",
            file=sys.stderr,
        )
        return EXIT_UNPERSISTED
    return EXIT_OK


def _reset_data(data: Path) -> int:
    """``--reset-data``: set a damaged data file aside (0, or an exit code on failure)."""
    try:
        done = set_aside_damaged(data)
    except OSError as exc:
        print(f"dcp-server: --reset-data failed: {exc}", file=sys.stderr)
        return EXIT_DATA_DIR
    for line in done:
        log.warning("%s", line)
    if not done:
        log.info("--reset-data: %s passes its checks; nothing was reset", data.resolve())
    return EXIT_OK


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


if __name__ == "__main__":
    sys.exit(main())
