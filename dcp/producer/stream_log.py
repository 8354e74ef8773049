"""Per-stream events, counted: one INFO summary line per interval instead of a line each.

Rules of this module:
- A consumer such as the Spark connector opens a stream per vbucket per task, every few
  seconds: with 1024 vbuckets that is thousands of stream requests and ends a minute.
  Each one is logged at DEBUG by its caller; this module counts them by kind and, when
  an event arrives at least ``INTERVAL`` seconds after the last summary, logs one INFO
  line with the counts since then (no timer task: a server without streams has nothing
  to summarise).
- Module-level and process-wide (all servers of a process share it: tests run several);
  counting is a dict increment, cheap enough for the event path.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

__all__ = ["INTERVAL", "count", "flush"]

log = logging.getLogger("dcp.producer.streams")

#: Seconds between two summary lines (at most one per interval).
INTERVAL = 60.0

_counts: Counter[str] = Counter()
_since = time.monotonic()


def count(event: str) -> None:
    """Count one per-stream event (``accepted``, ``rollback``, ``refused``, ``ended``,
    ``cursor_dropped``); log the summary when the interval is over."""
    _counts[event] += 1
    if time.monotonic() - _since >= INTERVAL:
        flush()


def flush() -> None:
    """Log the counts since the last summary (if any) and start a new interval."""
    global _since
    now = time.monotonic()
    if _counts:
        log.info(
            "streams in the last %.0f s: %s",
            now - _since,
            " ".join(f"{k}={v}" for k, v in sorted(_counts.items())),
        )
        _counts.clear()
    _since = now
