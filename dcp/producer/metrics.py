"""Server counters, kept as plain ints on the hot path and exported on scrape.

Rules of this module:
- Incrementing a counter is an attribute add: no locks, no prometheus objects per
  operation. ``MetricsCollector.collect`` turns the ints and the server's live state into
  Prometheus metric families only when someone scrapes, reading the server through
  ``ServerView`` (server_view.py) only.
- The HTTP endpoint is a tiny trio server (``serve_metrics``) in the server's nursery:
  ``GET /metrics`` only; anything else gets 404. No thread is started. It accepts with
  the server's accept loop (``limits.accept_with_backoff``: out of descriptors it backs
  off and logs once in a while, counting ``accept_errors``), serves at most
  ``MAX_METRICS_CONNECTIONS`` at once (more are closed at accept) and gives each 5 s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..protocol.opcodes import DurabilityLevel, Opcode
from .limits import accept_with_backoff

if TYPE_CHECKING:
    from .server_view import ServerView

__all__ = ["MAX_METRICS_CONNECTIONS", "MetricsCollector", "ServerMetrics", "serve_metrics"]

#: Scrapes served at once; a scraper needs one, a few more cover overlapping scrapes.
MAX_METRICS_CONNECTIONS = 16


class ServerMetrics:
    def __init__(self) -> None:
        self.ops: Counter[int] = Counter()
        self.bytes_out = 0
        self.rollbacks = 0
        self.backfills_started = 0
        self.backfills_completed = 0
        self.flushes = 0
        self.flush_errors = 0
        self.items_persisted = 0
        self.connections_total = 0
        #: Connections closed at accept because ``max_connections`` were open.
        self.connections_refused = 0
        #: accept() failures for lack of descriptors or memory (EMFILE, ENFILE...).
        self.accept_errors = 0
        #: Connections closed because all output together went over ``total_output_cap``.
        self.connections_shed = 0
        #: KV connections closed by ``kv_idle_timeout``.
        self.idle_closed = 0
        #: Connections closed because a frame stayed incomplete (``partial_frame_timeout``).
        self.partial_frame_closed = 0
        #: Durable writes answered SYNC_WRITE_AMBIGUOUS / ETMPFAIL at their deadline.
        self.durable_timeouts = 0
        #: Replica vbuckets rolled back because their source answered ROLLBACK.
        self.replica_rollbacks = 0
        #: Durable writes by (level, outcome): ok, ambiguous, impossible.
        self.sync_writes: Counter[tuple[int, str]] = Counter()

    def op(self, opcode: int) -> None:
        self.ops[opcode] += 1

    def sync_write(self, level: int, outcome: str) -> None:
        self.sync_writes[level, outcome] += 1

    def bytes_sent(self, n: int) -> None:
        self.bytes_out += n


def _opname(op: int) -> str:
    try:
        return Opcode(op).name.lower()
    except ValueError:
        return f"0x{op:02x}"


class MetricsCollector:
    """A prometheus_client collector reading a live server (its ``ServerView``)."""

    def __init__(self, server: ServerView) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        s = self.server
        m = s.metrics
        ops = CounterMetricFamily("dcp_ops", "KV operations served, by opcode", labels=["op"])
        for op, n in sorted(m.ops.items()):
            ops.add_metric([_opname(op)], n)
        yield ops
        yield CounterMetricFamily("dcp_bytes_sent", "Bytes written to clients", value=m.bytes_out)
        yield CounterMetricFamily(
            "dcp_rollbacks_answered", "Stream requests answered ROLLBACK", value=m.rollbacks
        )
        yield CounterMetricFamily(
            "dcp_backfills_started", "Disk backfills started", value=m.backfills_started
        )
        yield CounterMetricFamily(
            "dcp_backfills_completed", "Disk backfills completed", value=m.backfills_completed
        )
        yield CounterMetricFamily("dcp_flushes", "Flusher transactions committed", value=m.flushes)
        yield CounterMetricFamily(
            "dcp_flush_errors", "Flusher transactions that failed", value=m.flush_errors
        )
        yield CounterMetricFamily(
            "dcp_connections_accepted", "Connections accepted", value=m.connections_total
        )
        yield CounterMetricFamily(
            "dcp_connections_refused",
            "Connections refused at accept: max_connections were open",
            value=m.connections_refused,
        )
        yield CounterMetricFamily(
            "dcp_accept_errors",
            "accept() failures (out of file descriptors or memory)",
            value=m.accept_errors,
        )
        closed = CounterMetricFamily(
            "dcp_connections_closed_by_limit",
            "Connections the server closed to enforce a limit",
            labels=["limit"],
        )
        closed.add_metric(["total_output_cap"], m.connections_shed)
        closed.add_metric(["kv_idle_timeout"], m.idle_closed)
        closed.add_metric(["partial_frame_timeout"], m.partial_frame_closed)
        yield closed
        yield CounterMetricFamily(
            "dcp_durable_write_timeouts",
            "Durable writes answered ambiguous (or ETMPFAIL) at their durability timeout",
            value=m.durable_timeouts,
        )
        yield GaugeMetricFamily(
            "dcp_output_bytes",
            "Output queued or being sent to all connections (bounded by total_output_cap)",
            value=s.output_bytes(),
        )
        b = s.bucket
        conns = GaugeMetricFamily(
            "dcp_connections", "Open connections by type (kv, dcp)", labels=["type"]
        )
        dcp_conns = sum(1 for c in s.connections if c.dcp_name)
        conns.add_metric(["kv"], len(s.connections) - dcp_conns)
        conns.add_metric(["dcp"], dcp_conns)
        yield conns
        yield GaugeMetricFamily(
            "dcp_checkpoint_memory_bytes", "Checkpoint memory in use", value=b.checkpoint_memory()
        )
        yield GaugeMetricFamily(
            "dcp_checkpoint_memory_quota_bytes",
            "Checkpoint memory quota",
            value=b.checkpoint_memory_quota,
        )
        yield GaugeMetricFamily(
            "dcp_checkpoint_retained_bytes",
            "Checkpoint memory kept only by checkpoint_retain_seconds",
            value=b.checkpoint_retained(),
        )
        yield GaugeMetricFamily(
            "dcp_flusher_queue_items",
            "Items waiting to be persisted",
            value=b.flusher.pending_items(),
        )
        high = persisted = 0
        for vb in range(b.num_vbuckets):
            v = b.vbucket(vb)
            high += v.high_seqno
            persisted += v.persisted_seqno
        yield CounterMetricFamily(
            "dcp_items_queued", "Items queued (sum of high seqnos)", value=high
        )
        yield CounterMetricFamily(
            "dcp_items_persisted", "Items persisted (sum of persisted seqnos)", value=persisted
        )
        yield GaugeMetricFamily(
            "dcp_flusher_lag_items", "Queued minus persisted seqnos", value=high - persisted
        )
        phases = GaugeMetricFamily("dcp_streams", "Open streams by phase", labels=["phase"])
        counts: Counter[str] = Counter(st.state.value for st in s.streams())
        for phase in ("pending", "backfilling", "in-memory", "dead"):
            phases.add_metric([phase], counts.get(phase, 0))
        yield phases
        # The bucket's total: a per-stream sum would shrink whenever a stream ends.
        yield CounterMetricFamily(
            "dcp_cursors_dropped", "Stream cursors dropped for memory", value=b.cursors_dropped
        )
        yield CounterMetricFamily(
            "dcp_flusher_items_written",
            "Items in the flusher's committed batches",
            value=b.flusher.items_written,
        )
        yield from _replication_metrics(s)
        yield from _durability_metrics(s)


def _durability_metrics(s: ServerView) -> Iterator[Metric]:
    """Durable writes by level and outcome; how far the stable seqno trails the high
    seqno over the active vbuckets (summed, and the worst one's)."""
    writes = CounterMetricFamily(
        "dcp_sync_writes", "Durable writes by level and outcome", labels=["level", "outcome"]
    )
    counts = s.metrics.sync_writes
    for level in DurabilityLevel:
        if level:
            for outcome in ("ok", "ambiguous", "impossible"):
                writes.add_metric([level.name.lower(), outcome], counts.get((level, outcome), 0))
    yield writes
    b = s.bucket
    dur = s.durability
    lag_sum = lag_max = 0
    for vb in range(b.num_vbuckets):
        if dur.is_active(vb):
            lag = max(0, b.vbucket(vb).high_seqno - dur.stable_seqno(vb))
            lag_sum += lag
            lag_max = max(lag_max, lag)
    yield GaugeMetricFamily(
        "dcp_stable_seqno_lag_sum",
        "High seqno minus stable seqno, summed over active vbuckets",
        value=lag_sum,
    )
    yield GaugeMetricFamily(
        "dcp_stable_seqno_lag_max",
        "High seqno minus stable seqno of the furthest-behind active vbucket",
        value=lag_max,
    )


def _replication_metrics(s: ServerView) -> Iterator[Metric]:
    """vbuckets by state; per source node: connected, bytes, items, snapshots, rollbacks,
    reconnects and the lag (seqnos behind, summed and the worst vbucket's)."""
    b = s.bucket
    states = GaugeMetricFamily("dcp_vbuckets", "vbuckets by state", labels=["state"])
    counts: Counter[str] = Counter(b.vbucket(vb).state.name.lower() for vb in range(b.num_vbuckets))
    for state in ("active", "replica", "pending", "dead"):
        states.add_metric([state], counts.get(state, 0))
    yield states
    lag_sum: Counter[str] = Counter()
    lag_max: Counter[str] = Counter()
    for vb in range(b.num_vbuckets):
        info = s.replication_of(vb)
        if info:
            src, lag = info["source"], info["lag"]
            lag_sum[src] += lag
            lag_max[src] = max(lag_max[src], lag)
    sources = s.replication_sources()
    lag = GaugeMetricFamily(
        "dcp_replication_lag_seqnos",
        "Seqnos replicas are behind, summed per source",
        labels=["source"],
    )
    worst = GaugeMetricFamily(
        "dcp_replication_lag_max_seqnos",
        "The most-behind replica vbucket per source",
        labels=["source"],
    )
    up = GaugeMetricFamily(
        "dcp_replication_connected", "Source connection up (1)", labels=["source"]
    )
    families = {
        key: CounterMetricFamily(f"dcp_replication_{key}", help_, labels=["source"])
        for key, help_ in (
            ("bytes_received", "Bytes received from the source"),
            ("items_applied", "Items applied to replica vbuckets"),
            ("snapshots_applied", "Whole snapshots applied to replica vbuckets"),
            ("rollbacks", "Replica rollbacks the source asked for"),
            ("reconnects", "Reconnects to the source"),
        )
    }
    for src, st in sorted(sources.items()):
        lag.add_metric([src], lag_sum[src])
        worst.add_metric([src], lag_max[src])
        up.add_metric([src], 1 if st.get("connected") else 0)
        for key, fam in families.items():
            fam.add_metric([src], st.get(key, 0))
    yield lag
    yield worst
    yield up
    yield from families.values()


def render(server: ServerView) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(server))
    return generate_latest(registry)


async def _handle(server: ServerView, stream: Any) -> None:
    try:
        with trio.move_on_after(5):
            data = b""
            while b"\r\n\r\n" not in data and len(data) < 8192:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                data += chunk
            line = data.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
                body = render(server)
                head = (
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                )
            else:
                body = b"not found\n"
                head = (
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n" % len(body)
                )
            await stream.send_all(head + body)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(stream)


async def serve_metrics(
    server: ServerView, host: str, port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``GET /metrics`` on ``host``:``port`` (0 = ephemeral); the bound port is
    what ``nursery.start`` returns."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    busy = 0

    async def serve(stream: trio.SocketStream) -> None:
        nonlocal busy
        busy += 1
        try:
            await _handle(server, stream)
        finally:
            busy -= 1

    async with trio.open_nursery() as nursery:

        async def admit(stream: trio.SocketStream) -> None:
            if busy >= MAX_METRICS_CONNECTIONS:  # scrapers are few: this is a flood
                await trio.aclose_forcefully(stream)
                return
            nursery.start_soon(serve, stream)

        for listener in listeners:
            nursery.start_soon(
                accept_with_backoff, listener, admit, server.metrics, "metrics connections"
            )
