"""Driver side: the ``Planner``, a cached view of what the server has now, and the
offsets planned from it.

Rules of this module:
- Lives in the process that plans batches (Spark's long-lived streaming source runner, or
  the batch planning worker). It opens its connection lazily and keeps it; nothing here
  may be pickled (the Spark reader drops its planner before it is shipped).
- Spark polls ``latestOffset`` about every 12 ms when idle, so the server's answer is
  cached for ``planCacheMs`` (250 ms): one GET_ALL_VB_SEQNOS per refresh, plus
  DCP_GET_FAILOVER_LOG only for vbuckets whose high seqno moved since their log was
  fetched (all of them after every (re)connect: a server restart is when failover logs
  change under us).
- Every high seqno the server returns is a snapshot boundary (it closes each open
  checkpoint when it answers); they are remembered per vbucket so a row limit can cut
  between them. Decisions are ``batch_plan.py``'s; this module only gathers their inputs.
- ``startingOffsets=latest`` is resolved once per ``startingOffsetsFile`` and read back
  from that file ever after (Spark calls ``initialOffset`` again on restarts and replays).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping

from .batch_plan import FailoverLog, branch_uuid, plan_end
from .errors import OffsetError, RangeUnavailableError
from .offsets import (
    Offsets,
    VbPosition,
    earliest,
    parse_starting_offsets,
    read_file,
    write_file_atomic,
)
from .options import SourceConfig
from .wire import ConnectionLost, WireClient

__all__ = ["Planner"]

_MAX_BOUNDARIES = 4096


class Planner:
    """Cached view of the server for planning. Not thread-safe, not picklable."""

    def __init__(self, cfg: SourceConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self._client: WireClient | None = None
        self._fetched_at = -1e18
        self._highs: dict[int, int] = {}
        self._logs: dict[int, FailoverLog] = {}
        self._log_high: dict[int, int] = {}  # high seqno when the vbucket's log was fetched
        self._boundaries: dict[int, list[int]] = {}
        self._vbuckets: list[int] | None = None
        self._initial: Offsets | None = None
        self._prev: dict[int, tuple[VbPosition, int]] = {}  # vb -> (batch end, its start)
        self.refreshes = 0  #: server round trips made (for tests and metrics)

    # ------------------------------------------------------------------ server view

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _fetch(self) -> None:
        if self._client is None:
            self._client = WireClient(
                self.cfg.host, self.cfg.port, timeout=self.cfg.timeout
            ).connect()
            self._logs.clear()
            self._log_high.clear()
            self._boundaries.clear()
        client = self._client
        all_highs = client.get_all_vb_seqnos()
        if self._vbuckets is None:
            wanted = self.cfg.vbuckets
            if wanted is None:
                self._vbuckets = sorted(all_highs)
            else:
                missing = sorted(set(wanted) - set(all_highs))
                if missing:
                    raise RangeUnavailableError(
                        f"option vbuckets names vbuckets the server does not have: "
                        f"{missing[:20]} (it has {len(all_highs)})"
                    )
                self._vbuckets = list(wanted)
        highs = {vb: all_highs[vb] for vb in self._vbuckets if vb in all_highs}
        stale = [vb for vb in self._vbuckets if vb in highs and self._log_high.get(vb) != highs[vb]]
        if stale:
            logs = client.failover_logs(stale)
            for vb in stale:
                self._logs[vb] = tuple(logs[vb])
                self._log_high[vb] = highs[vb]
        for vb, h in highs.items():
            b = self._boundaries.setdefault(vb, [])
            if h and (not b or h > b[-1]):
                b.append(h)
                if len(b) > _MAX_BOUNDARIES:
                    del b[: len(b) - _MAX_BOUNDARIES]
        self._highs = highs
        self.refreshes += 1

    def refresh(self, *, force: bool = False) -> tuple[dict[int, int], dict[int, FailoverLog]]:
        """High seqnos and failover logs of the query's vbuckets (cached unless ``force``).

        A lost connection is reopened with back-off for up to ``retryTimeout`` seconds.
        """
        now = self._clock()
        if not force and now - self._fetched_at < self.cfg.plan_cache_seconds:
            return self._highs, self._logs
        deadline = time.monotonic() + self.cfg.retry_timeout
        delay = 0.05
        while True:
            try:
                self._fetch()
                break
            except ConnectionLost as exc:
                self.close()
                if time.monotonic() + delay > deadline:
                    raise RangeUnavailableError(
                        f"cannot reach the DCP server at {self.cfg.host}:{self.cfg.port}: {exc}"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        self._fetched_at = self._clock()
        return self._highs, self._logs

    def vbuckets(self) -> list[int]:
        if self._vbuckets is None:
            self.refresh(force=True)
        assert self._vbuckets is not None
        return list(self._vbuckets)

    # ------------------------------------------------------------------ offsets

    def initial_offsets(self) -> Offsets:
        """The query's starting offsets; identical on every call and every restart."""
        if self._initial is not None:
            return self._initial
        cfg = self.cfg
        path = cfg.starting_offsets_file
        vbs = self.vbuckets()
        if path:
            kept = read_file(path)
            if kept is not None:
                if sorted(kept) != vbs:
                    raise OffsetError(
                        f"startingOffsetsFile {path} holds vbuckets {sorted(kept)[:10]}... "
                        f"({len(kept)}), the query reads {len(vbs)}: delete the file or "
                        f"fix option vbuckets"
                    )
                self._initial = kept
                return kept
        if cfg.starting_offsets == "earliest":
            offsets = earliest(vbs)
        elif cfg.starting_offsets == "latest":
            highs, logs = self.refresh(force=True)
            offsets = {
                vb: VbPosition(branch_uuid(logs.get(vb, ()), highs[vb]), highs[vb]) for vb in vbs
            }
        else:
            offsets = parse_starting_offsets(cfg.starting_offsets, vbs)
        if path:
            write_file_atomic(path, offsets)
        self._initial = offsets
        return offsets

    def target(self) -> dict[int, int]:
        """The current high seqnos (the end of an availableNow run)."""
        highs, _ = self.refresh(force=True)
        return dict(highs)

    def latest(
        self,
        start: Offsets,
        *,
        limit: int | None = None,
        min_rows: int = 0,
        target: Mapping[int, int] | None = None,
    ) -> Offsets:
        """The end offset of the next batch; ``start`` itself when nothing is new."""
        highs, logs = self.refresh()
        vbs = self.vbuckets()
        if sorted(start) != vbs:
            raise OffsetError(
                f"the query's offsets name {len(start)} vbuckets ({sorted(start)[:8]}...) but "
                f"it reads {len(vbs)} ({vbs[:8]}...): option vbuckets (or the server's "
                f"vbucket count) changed since the checkpoint was written; start a new "
                f"checkpoint or restore the option"
            )
        for vb, pos in start.items():
            b = self._boundaries.get(vb)
            if b and b[0] <= pos.seqno:
                del b[: bisect.bisect_right(b, pos.seqno)]
        floor = {vb: seq for vb, (e, seq) in self._prev.items() if start.get(vb) == e}
        end = plan_end(
            start,
            highs,
            logs,
            self._boundaries,
            limit=limit,
            target=target,
            on_rollback=self.cfg.on_rollback,
            floor=floor,
        )
        for vb, pos in end.items():
            if pos.rollback is not None:  # boundaries of the abandoned branch are void
                b = self._boundaries.get(vb)
                if b:
                    del b[bisect.bisect_right(b, pos.seqno) :]
        if min_rows and target is None:
            new = sum(max(0, end[vb].seqno - start[vb].seqno) for vb in end)
            if new < min_rows and not any(p.rollback is not None for p in end.values()):
                return start
        self.remember(start, end)
        return end

    def remember(self, start: Offsets, end: Offsets) -> None:
        """Record batch ``(start, end]`` (planned here or replayed from Spark's log): if
        its end turns out to be off the server's history, a rewind goes back at least to
        its start (see ``batch_plan.plan_end``'s ``floor``)."""
        for vb, e in end.items():
            s = start.get(vb)
            if s is not None and s != e:
                self._prev[vb] = (e, s.seqno)
