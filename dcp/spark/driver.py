"""Driver side: the ``Planner``, a cached view of what the server has now, and the
offsets planned from it.

Rules of this module:
- Lives in the process that plans batches (Spark's long-lived streaming source runner, or
  the batch planning worker). It opens its connection lazily and keeps it (on a cluster:
  one per node, ``cluster.NodeView``); nothing here may be pickled (the Spark reader
  drops its planner before it is shipped).
- On a cluster every vbucket's high seqno and failover log come from the node holding it
  active by the map (GET_ALL_VB_SEQNOS for state active, per node); a node that fails or
  does not hold what the map says makes the refresh retry after a (rate-limited) config
  refresh, within ``retryTimeout``. A vbucket that moved to another node (or a new
  connection) has its failover log and boundaries fetched anew.
- Spark polls ``latestOffset`` about every 12 ms when idle, so the server's answer is
  cached for ``planCacheMs`` (250 ms): one GET_ALL_VB_SEQNOS per refresh, plus
  DCP_GET_FAILOVER_LOG only for vbuckets whose high seqno moved since their log was
  fetched (all of them after every (re)connect: a server restart is when failover logs
  change under us).
- Between two refreshes an idle poll asks the same question again: ``latest`` keeps its
  last answer with what it was decided from (the start, the limits, a counter of the
  planner's state: bumped by every refresh and every batch recorded) and returns it
  while all are unchanged, instead of planning 1024 vbuckets again at every poll (that
  kept the streaming source runner ~40 % busy on an idle query). Answers that depend on
  the clock (``minRowsPerBatch`` waiting) or carry a rollback are never reused.
- Every high seqno the server returns is a snapshot boundary (it closes each open
  checkpoint when it answers); they are remembered per vbucket so a row limit can cut
  between them. Decisions are ``batch_plan.py``'s; this module only gathers their inputs.
- ``stableOnly``: each refresh also asks the vbuckets' active nodes for their stable
  seqnos (``stable.py``; the other queries make no extra request), and no planned end is
  above one: a micro-batch ends at an observed boundary at or below it
  (``batch_plan.plan_end``), while a one-off point (``startingOffsets=latest``, a
  batch read's end, an ``availableNow`` run's target) is the high seqno once it is
  stable, waited for briefly, else the stable seqno reached (``now``). So a failover
  can never take back a planned end and turn it into a rollback. Positions given by
  the user are theirs (checked against the high seqnos as before); rollback checks
  always use the high seqnos.
- ``startingOffsets=latest`` is resolved once per ``startingOffsetsFile`` and read back
  from that file ever after (Spark calls ``initialOffset`` again on restarts and replays).
- A lost connection is retried for ``retryTimeout`` (forever when infinite), with one
  warning when the trouble starts; a server (or every address of a bootstrap list) that
  refuses the very first connection of a planner fails at once, naming the addresses (a
  wrong host or port must not take the retry time to show), unless the retries are
  endless.
- A stream checks once whether the server keeps a change history (it accepts the
  ``change_streams`` control) and warns when not: replays after the server's checkpoint
  retention or a restart may then be impossible to serve exactly (docs/spark.md).
"""

from __future__ import annotations

import bisect
import errno
import logging
import math
import time
from collections.abc import Callable, Mapping

from dcp.protocol.cluster_config import Address

from .batch_plan import FailoverLog, branch_uuid, plan_end
from .cluster import NodeView
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
from .stable import stable_seqnos
from .wire import ConnectionLost, WireClient

__all__ = ["Planner", "server_keeps_history"]

log = logging.getLogger("dcp.spark")

_MAX_BOUNDARIES = 4096
#: stableOnly: how long a one-off point waits for the high seqnos to become stable
#: (a flush interval on one server, a replication round trip on a cluster: far less)
STABLE_SETTLE_SECONDS = 2.0
_SETTLE_POLL = 0.02


class Planner:
    """Cached view of the server for planning. Not thread-safe, not picklable."""

    def __init__(self, cfg: SourceConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self._nodes = NodeView(cfg, clock=clock)
        self._fetched_at = -1e18
        self._highs: dict[int, int] = {}
        self._stable: dict[int, int] = {}  # stableOnly: per vbucket, at most its high
        self._logs: dict[int, FailoverLog] = {}
        self._log_high: dict[int, int] = {}  # high seqno when the vbucket's log was fetched
        self._boundaries: dict[int, list[int]] = {}
        self._log_owner: dict[int, tuple[Address, int]] = {}  # node + connection of a log
        self._vbuckets: list[int] | None = None
        self._initial: Offsets | None = None
        self._prev: dict[int, tuple[VbPosition, int]] = {}  # vb -> (batch end, its start)
        self._waiting_since: float | None = None  # minRowsPerBatch: first short poll
        self.refreshes = 0  #: server round trips made (for tests and metrics)
        self.plans = 0  #: batch ends computed by ``latest`` (not reused; tests)
        self._state = 0  # bumped when what ``latest`` decides from changes
        self._last: tuple[tuple, Offsets, Offsets] | None = None  # key, start, end

    # ------------------------------------------------------------------ server view

    def close(self) -> None:
        self._nodes.close()

    def _fetch(self) -> None:
        nodes = self._nodes
        wanted = self._vbuckets if self._vbuckets is not None else self.cfg.vbuckets
        all_highs, owner = nodes.high_seqnos(wanted)
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
        if self.cfg.stable_only:  # before anything is recorded: a failure changes nothing
            self._stable = stable_seqnos(nodes, highs, owner)
        for vb in highs:  # a new connection, or another node: its log and boundaries anew
            if self._log_owner.get(vb) != owner[vb]:
                self._log_high.pop(vb, None)
                self._boundaries.pop(vb, None)
        stale = [vb for vb in self._vbuckets if vb in highs and self._log_high.get(vb) != highs[vb]]
        if stale:
            logs = nodes.failover_logs(stale, owner)
            for vb in stale:
                self._logs[vb] = tuple(logs[vb])
                self._log_high[vb] = highs[vb]
                self._log_owner[vb] = owner[vb]
        for vb, h in highs.items():
            b = self._boundaries.setdefault(vb, [])
            if h and (not b or h > b[-1]):
                b.append(h)
                if len(b) > _MAX_BOUNDARIES:
                    del b[: len(b) - _MAX_BOUNDARIES]
        self._highs = highs
        self.refreshes += 1
        self._state += 1

    def refresh(self, *, force: bool = False) -> tuple[dict[int, int], dict[int, FailoverLog]]:
        """High seqnos and failover logs of the query's vbuckets (cached unless ``force``).

        A lost connection is reopened with back-off for up to ``retryTimeout`` seconds.
        """
        now = self._clock()
        if not force and now - self._fetched_at < self.cfg.plan_cache_seconds:
            return self._highs, self._logs
        cfg = self.cfg
        began = time.monotonic()
        delay = 0.05
        while True:
            try:
                self._fetch()
                break
            except ConnectionLost as exc:
                nodes = self._nodes
                where = nodes.describe()
                endless = math.isinf(cfg.retry_timeout)
                refused = getattr(exc, "refused", False) or (
                    isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ECONNREFUSED
                )
                if refused and not nodes.connected_once and not endless:
                    nodes.close()
                    raise RangeUnavailableError(
                        f"{where} refused the connection ({exc}): is it running, on that "
                        f"host and port (options host, port)? Set option "
                        f"retryTimeout=forever to wait for it instead."
                    ) from exc
                nodes.trouble(exc)
                waited = time.monotonic() - began
                if delay == 0.05:  # the first failure of this outage
                    log.warning(
                        "lost %s (%s); retrying %s",
                        where,
                        exc,
                        "forever (retryTimeout=forever)"
                        if endless
                        else f"for up to {cfg.retry_timeout:g} s (option retryTimeout)",
                    )
                if waited + delay > cfg.retry_timeout:
                    raise RangeUnavailableError(
                        f"cannot reach {where}: {exc}; gave up after {waited:.1f} s of retries "
                        f"(option retryTimeout={cfg.retry_timeout:g}; 'forever' never gives up)"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        self._fetched_at = self._clock()
        return self._highs, self._logs

    def now(self) -> dict[int, int]:
        """Where "now" is per vbucket for the one-off points (``startingOffsets=latest``,
        a batch read's end, an availableNow target), after a fresh refresh: the high
        seqnos; with ``stableOnly``, the high seqnos of this refresh once they are stable,
        waited for up to ``STABLE_SETTLE_SECONDS`` (a high seqno is a boundary of every
        stream, the stable seqno need not be: see ``batch_plan``), else the stable seqno
        reached by then."""
        self.refresh(force=True)
        highs = dict(self._highs)
        if not self.cfg.stable_only:
            return highs
        deadline = time.monotonic() + min(self.cfg.timeout, STABLE_SETTLE_SECONDS)
        while any(self._stable[vb] < h for vb, h in highs.items()):
            if time.monotonic() >= deadline:
                break
            time.sleep(_SETTLE_POLL)
            self.refresh(force=True)
        return {vb: min(h, self._stable[vb]) for vb, h in highs.items()}

    def owners(self) -> dict[int, Address] | None:
        """Where each vbucket of the query is read now: the node holding it active
        (None: a single server, read at the address the query was given)."""
        return self._nodes.owners(self.vbuckets())

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
            now = self.now()
            logs = self._logs
            offsets = {
                vb: VbPosition(branch_uuid(logs.get(vb, ()), now[vb]), now[vb]) for vb in vbs
            }
        else:
            offsets = parse_starting_offsets(cfg.starting_offsets, vbs)
            self.check_reached(offsets, "startingOffsets")
        if path:
            write_file_atomic(path, offsets)
        self._initial = offsets
        return offsets

    def check_reached(self, offsets: Offsets, option: str) -> None:
        """Positions the user gave must be ones the server has reached on that branch."""
        highs, logs = self.refresh(force=True)
        for vb, pos in sorted(offsets.items()):
            log_ = logs.get(vb, ())
            current = not pos.uuid or (bool(log_) and pos.uuid == log_[0][0])
            if current and pos.seqno > highs.get(vb, 0):
                raise OffsetError(
                    f"option {option}: vbucket {vb} position seqno {pos.seqno} is ahead of "
                    f"the server (its high seqno is {highs.get(vb, 0)}): the server has not "
                    f"written that change yet. Offsets of another server or data directory?"
                )

    def ending_offsets(self) -> Offsets:
        """Batch reads: where each vbucket ends (option endingOffsets, default the high
        seqnos now; with stableOnly the stable seqnos)."""
        now = self.now()
        logs = self._logs
        vbs = self.vbuckets()
        if self.cfg.ending_offsets == "latest":
            return {vb: VbPosition(branch_uuid(logs.get(vb, ()), now[vb]), now[vb]) for vb in vbs}
        given = parse_starting_offsets(self.cfg.ending_offsets, vbs)
        self.check_reached(given, "endingOffsets")
        # vbuckets not named end "now", like Kafka's -1 ("latest")
        named = _named_vbuckets(self.cfg.ending_offsets)
        return self.on_branches(
            {vb: (given[vb] if vb in named else VbPosition(0, now[vb])) for vb in vbs}
        )

    def on_branches(self, offsets: Offsets) -> Offsets:
        """Positions given without a uuid, on the branch that holds them now (a stream
        request needs one)."""
        _, logs = self.refresh()
        out: Offsets = {}
        for vb, p in offsets.items():
            if not p.uuid and p.seqno:
                p = VbPosition(branch_uuid(logs.get(vb, ()), p.seqno), p.seqno, None, p.prev, p.gen)
            out[vb] = p
        return out

    def warn_without_history(self) -> bool:
        """Warn (once per planner) when the server keeps no change history; True if it does."""
        ok = server_keeps_history(self.cfg)
        if not ok:
            log.warning(
                "the DCP server at %s:%d keeps no change history (it refused "
                "change_streams): a batch replayed after a restart of the server or of this "
                "query, or read more than the server's checkpoint retention (10 s) after "
                "it was planned, may fail with MergedSnapshotError once documents are "
                "rewritten. Run the server with a change history: dcp-server "
                "--history-seconds 3600 --history-bytes 1073741824 (or history_seconds / "
                "history_bytes in its config file).",
                self.cfg.host,
                self.cfg.port,
            )
        return ok

    def target(self) -> dict[int, int]:
        """The current high seqnos, or stable seqnos with stableOnly (the end of an
        availableNow run)."""
        return self.now()

    def latest(
        self,
        start: Offsets,
        *,
        limit: int | None = None,
        min_rows: int = 0,
        max_delay: float = math.inf,
        target: Mapping[int, int] | None = None,
    ) -> Offsets:
        """The end offset of the next batch; ``start`` itself when nothing is new, or
        fewer than ``min_rows`` are new and the first such poll is under ``max_delay``
        seconds old."""
        highs, logs = self.refresh()
        last, self._last = self._last, None  # kept again below when still valid
        if last is not None and last[0] == self._key(limit, min_rows, max_delay, target):
            if last[1] == start:  # an idle poll: nothing the answer depends on changed
                self._last = last
                return dict(last[2])
        vbs = self.vbuckets()
        if len(start) != len(vbs) or sorted(start) != vbs:
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
                self._state += 1
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
            stable=self._stable if self.cfg.stable_only else None,
        )
        for vb, pos in end.items():
            if pos.rollback is not None:  # boundaries of the abandoned branch are void
                b = self._boundaries.get(vb)
                if b:
                    del b[bisect.bisect_right(b, pos.seqno) :]
        if min_rows and target is None and end != start:
            new = sum(max(0, end[vb].seqno - start[vb].seqno) for vb in end)
            if new < min_rows and not any(p.rollback is not None for p in end.values()):
                now = self._clock()
                if self._waiting_since is None:
                    self._waiting_since = now
                if now - self._waiting_since < max_delay:
                    return start
        self._waiting_since = None
        self.remember(start, end)
        self.plans += 1
        reusable = not (min_rows and target is None)  # waiting for rows depends on the clock
        if reusable and not any(p.rollback is not None for p in end.values()):
            key = self._key(limit, min_rows, max_delay, target)  # after remember()
            self._last = (key, dict(start), dict(end))  # copies: the caller's may change
        return end

    def _key(
        self, limit: int | None, min_rows: int, max_delay: float, target: Mapping[int, int] | None
    ) -> tuple:
        """What a kept ``latest`` answer was decided from, besides its start."""
        return (self._state, limit, min_rows, max_delay, None if target is None else dict(target))

    def remember(self, start: Offsets, end: Offsets) -> None:
        """Record batch ``(start, end]`` (planned here or replayed from Spark's log): if
        its end turns out to be off the server's history, a rewind goes back at least to
        its start (see ``batch_plan.plan_end``'s ``floor``)."""
        prev = self._prev
        for vb, e in end.items():
            s = start.get(vb)
            if s is not None and s != e and prev.get(vb) != (e, s.seqno):
                prev[vb] = (e, s.seqno)
                self._state += 1  # a rewind's floor changed: answers kept are void


def _named_vbuckets(text: str) -> set[int]:
    import json

    obj = json.loads(text)
    if isinstance(obj, dict) and "vb" in obj and isinstance(obj["vb"], dict):
        obj = obj["vb"]
    return {int(k) for k in obj} if isinstance(obj, dict) else set()


def server_keeps_history(cfg: SourceConfig) -> bool:
    """Whether the server accepts ``change_streams`` (it keeps a history window); a
    short-lived connection of its own, to the first address of the bootstrap list that
    accepts one (the nodes of a cluster run with the same settings). A server that cannot
    be reached counts as keeping one (the query's own connection will report it)."""
    for addr in cfg.addresses:
        # credentials too: DCP_OPEN needs the stream privilege
        client = WireClient.for_config(cfg, address=addr)
        try:
            client.connect()
            accepted = client.dcp_open(controls={"change_streams": "true"})
            return accepted.get("change_streams", False)
        except ConnectionLost:
            continue
        except Exception:
            return True
        finally:
            client.close()
    return True
