"""A connection's timer task: DCP noops and the per-connection time limits.

Rules of this module:
- One task per connection (started by ``Connection.run`` in its nursery), waking twice a
  second (more often for a short noop interval). It closes the connection, with a log
  line and a count, when
  - the incomplete frame at the end of its input (``partial_since``, kept by
    ``request_reader``) is older than ``partial_frame_timeout``: a client sending a
    frame a byte at a time cannot hold a connection and its buffer indefinitely;
  - it has no stream and nothing was read from it for ``kv_idle_timeout``;
  - it is a DCP connection with noops enabled and nothing was read for ``idle_timeout``.
- It sends a DCP noop when the connection's ``ServerSession`` says one is due
  (``noop_due``: every ``noop_interval`` once noops are enabled and a stream exists, and
  only when the previous one was answered); the noop state is the session's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["run_timers"]

log = logging.getLogger("dcp.conn")


async def run_timers(conn: Connection) -> None:
    cfg = conn.server.config
    metrics = conn.server.metrics
    session = conn.session
    while True:
        await trio.sleep(min(session.noop_interval / 2, 0.5) if session.noop_enabled else 0.5)
        now = trio.current_time()
        since = conn.partial_since
        if since is not None and now - since > cfg.partial_frame_timeout:
            log.warning(
                "incomplete frame from id=%d peer=%s for %.1f s (%g s allowed); closing",
                conn.id,
                conn.peer,
                now - since,
                cfg.partial_frame_timeout,
            )
            metrics.partial_frame_closed += 1
            conn.close("partial frame timeout")
            return
        if not conn.streams and now - conn.last_read > cfg.kv_idle_timeout:
            log.info(
                "idle connection id=%d peer=%s: nothing read for %.0f s and no streams; closing",
                conn.id,
                conn.peer,
                now - conn.last_read,
            )
            metrics.idle_closed += 1
            conn.close("idle timeout (kv_idle_timeout)")
            return
        if not session.noop_enabled or conn.dcp_name is None:
            continue
        if now - conn.last_read > cfg.idle_timeout:
            log.warning(
                "idle DCP client id=%d name=%s: nothing read for %.0f s; closing",
                conn.id,
                conn.dcp_name,
                now - conn.last_read,
            )
            conn.close("idle timeout")
            return
        noop = session.noop_due(now, bool(conn.streams))
        if noop:
            conn.respond(noop)
