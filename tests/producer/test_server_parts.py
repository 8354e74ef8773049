"""The server's parts by ownership (server.py's rules): each part does its job on its own,
and the seams between them stay where server.py says they are.

- ``StreamRegistry`` wakes only the streams of changed vbuckets, once per batch, and
  tells persistence; ``Backfills`` keeps one limiter per connection until it closes.
- The handler table is the server's (or the caller's) and reaches each connection as a
  constructor argument: a table of our own answers on the wire.
- STAT and metrics work from any ``ServerView``, not only a ``DcpServer``.
- Structure: reporting never imports the server, the reader imports no handler, no
  producer module imports inside a function or spells a wire layout, the 55-byte
  charge or the vbucket hash itself (dcp/protocol/layout.py does).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from dcp.producer.backfills import Backfills
from dcp.producer.config import ServerConfig
from dcp.producer.connection import Connection
from dcp.producer.dispatch import HANDLERS, HandlerTable
from dcp.producer.durability import DurabilityMonitor
from dcp.producer.engine import Bucket, EngineConfig
from dcp.producer.metrics import ServerMetrics, render
from dcp.producer.server import DcpServer
from dcp.producer.stats import stat_units
from dcp.producer.stream_registry import StreamRegistry
from dcp.protocol import Frame, Status, codec
from dcp.protocol.layout import HEADER
from tests.test_layering import imports_of

from .conftest import client_of, running_server

PRODUCER = Path(__file__).resolve().parents[2] / "dcp" / "producer"


# ---------------------------------------------------------------- StreamRegistry


class FakeConn:
    def __init__(self) -> None:
        self.ready: list[Any] = []

    def mark_ready(self, stream: Any) -> None:
        self.ready.append(stream)


class FakeStream:
    def __init__(self, vbid: int) -> None:
        self.vbid = vbid
        self.conn: Any = None
        self.cursor: Any = None


def test_wake_dirty_marks_only_the_streams_of_changed_vbuckets_once_per_batch() -> None:
    kicks: list[int] = []
    reg = StreamRegistry(on_new_items=lambda: kicks.append(1))
    conn = FakeConn()
    s0, s1, s1b = FakeStream(0), FakeStream(1), FakeStream(1)
    for s in (s0, s1, s1b):
        reg.add(conn, s)  # type: ignore[arg-type]
    assert s0.conn is conn
    reg.wake_dirty()  # nothing changed: nobody woken, persistence not bothered
    assert conn.ready == [] and kicks == []
    reg.mark_dirty(1)
    reg.mark_dirty(1)
    reg.mark_dirty(3)  # a vbucket without streams
    reg.wake_dirty()
    assert sorted(map(id, conn.ready)) == sorted(map(id, (s1, s1b))) and kicks == [1]
    reg.wake_dirty()  # the batch was consumed
    assert len(conn.ready) == 2 and kicks == [1]
    reg.remove(s1)  # type: ignore[arg-type]
    assert reg.of(1) == [s1b] and sorted(map(id, reg.all())) == sorted(map(id, (s0, s1b)))


async def test_each_connection_has_its_own_backfill_limiter_until_it_closes() -> None:
    cfg = ServerConfig(max_concurrent_backfills=2)
    async with trio.open_nursery() as nursery:
        b = Backfills(
            storage=None,
            config=cfg,
            metrics=ServerMetrics(),  # type: ignore[arg-type]
            nursery=nursery,
        )
        first = b.slots(1)
        assert b.slots(1) is first and b.slots(2) is not first
        assert first.total_tokens == 2
        b.connection_closed(1)
        assert b.slots(1) is not first


# ---------------------------------------------------------------- handler table


def _answer_with(status: int):  # type: ignore[no-untyped-def]
    def handler(conn: Connection, f: Frame) -> None:
        conn.error(f.opcode, status, f.opaque, "from the test's table")

    return handler


async def test_connections_dispatch_through_the_table_the_server_was_given(tmp_path: Path) -> None:
    table = HandlerTable(
        requests={**HANDLERS.requests, 0xEE: _answer_with(Status.EBUSY)},
        unknown=_answer_with(Status.NOT_SUPPORTED),
        response=HANDLERS.response,
        set_run=HANDLERS.set_run,
    )
    cfg = ServerConfig(port=0, data_dir=str(tmp_path / "d"), num_vbuckets=4)
    async with DcpServer(cfg, handlers=table) as server:
        async with client_of(server) as c:
            r = await c.call(codec.request(0xEE, opaque=7), 7)
            assert r.status == Status.EBUSY
            r = await c.call(codec.request(0xEF, opaque=8), 8)
            assert r.status == Status.NOT_SUPPORTED  # the table's own "unknown"
            await c.set(b"k", b"v")  # the rest of the table is the server's
            assert (await c.get(b"k")).value == b"v"
    async with running_server(tmp_path / "e") as server:  # the default table
        async with client_of(server) as c:
            r = await c.call(codec.request(0xEF, opaque=9), 9)
            assert r.status == Status.UNKNOWN_COMMAND


# ---------------------------------------------------------------- ServerView


class View:
    """A ``ServerView`` that is not a server: a bucket and counters, no connections."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.config = ServerConfig(num_vbuckets=bucket.num_vbuckets)
        self.metrics = ServerMetrics()
        self.connections: list[Any] = []
        self.storage_error: str | None = "disk on fire"
        self.durability = DurabilityMonitor.of_vbuckets("self", bucket.vbuckets)

    def uptime(self) -> float:
        return 12.0

    def output_bytes(self) -> int:
        return 345

    def streams(self) -> list[Any]:
        return []

    def streams_of(self, vbid: int) -> list[Any]:
        return []

    def replication_of(self, vbid: int) -> dict[str, Any]:
        return {}

    def replication_sources(self) -> dict[str, dict[str, Any]]:
        return {}


@pytest.fixture
def bucket(tmp_path: Path) -> Iterator[Bucket]:
    uuids = itertools.count(1)
    b = Bucket.open(
        tmp_path / "data",
        EngineConfig(num_vbuckets=4, map_size=64 << 20),
        clock=lambda: 1000.0,
        uuid_source=lambda: next(uuids),
    )
    yield b
    b.close()


def test_stat_and_metrics_read_any_server_view(bucket: Bucket) -> None:
    view = View(bucket)
    view.metrics.rollbacks = 3
    general = dict(p for unit in stat_units(view, "") for p in unit)
    assert general["uptime"] == 12 and general["output_bytes"] == 345
    assert general["ep_storage_error"] == "disk on fire"
    assert general["ep_rollbacks_answered"] == 3 and general["curr_connections"] == 0
    assert [p for unit in stat_units(view, "vbucket") for p in unit] == [
        (f"vb_{vb}", "active") for vb in range(4)
    ]
    text = render(view).decode()
    assert "dcp_output_bytes 345.0" in text and "dcp_rollbacks_answered_total 3.0" in text


# ---------------------------------------------------------------- structure


def _source(name: str) -> str:
    return (PRODUCER / name).read_text(encoding="utf-8")


def _producer_modules() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(PRODUCER.glob("*.py"))}


def test_reporting_reads_a_view_not_the_server_and_the_reader_imports_no_handler() -> None:
    for name in ("stats.py", "metrics.py"):
        assert "dcp.producer.server" not in imports_of(_source(name), f"dcp.producer.{name[:-3]}")
    reader = imports_of(_source("request_reader.py"), "dcp.producer.request_reader")
    handlers = {"dcp.producer.kv_handlers", "dcp.producer.dcp_handlers", "dcp.producer.dispatch"}
    assert not reader & handlers
    conn = imports_of(_source("connection.py"), "dcp.producer.connection")
    assert not conn & {"dcp.producer.kv_handlers", "dcp.producer.dcp_handlers"}


def test_no_producer_module_imports_inside_a_function() -> None:
    """A lazy import hides a dependency (server.py's did, and typed the bucket ``Any``)."""
    lazy = [
        f"{name}:{n.lineno}"
        for name, tree in _producer_modules().items()
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(fn)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    ]
    assert not lazy


def test_no_producer_module_spells_a_wire_layout_the_item_charge_or_the_vbucket_hash() -> None:
    header = HEADER.format.lstrip(">!")
    found = []
    for name, tree in _producer_modules().items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and header in n.value:
                found.append(f"{name}:{n.lineno}: header format")
            elif isinstance(n, ast.Constant) and n.value == 55 and type(n.value) is int:
                found.append(f"{name}:{n.lineno}: 55")
            elif isinstance(n, ast.Attribute) and n.attr in ("Struct", "crc32"):
                found.append(f"{name}:{n.lineno}: {n.attr}")
    assert not found
