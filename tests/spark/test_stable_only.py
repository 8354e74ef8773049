"""Option ``stableOnly``: validated like the others, and an executor that asks for
stable-only streams reads a range only once it is stable (on a single server: once it
is persisted). Executor-level: no Spark session needed, so the tests stay fast."""

from __future__ import annotations

import threading

import pytest

from dcp.spark.batch_plan import VbRange
from dcp.spark.errors import OptionError, RangeUnavailableError
from dcp.spark.executor import read_ranges
from dcp.spark.options import parse_options
from dcp.spark.wire import WireClient

from .helpers import ThreadServer
from .test_executor import _cfg, _plan, _rows


def test_the_option_is_true_or_false_in_any_case() -> None:
    assert parse_options({"stableOnly": "TRUE"}, streaming=True).stable_only is True
    assert parse_options({"stableonly": "false"}, streaming=False).stable_only is False
    assert parse_options({}, streaming=True).stable_only is False
    with pytest.raises(OptionError, match="stableOnly"):
        parse_options({"stableOnly": "yes"}, streaming=None)


def _ranges(server: ThreadServer) -> list[VbRange]:
    highs, logs = _plan(server)
    return [VbRange(vb, logs[vb][0][0], 0, h) for vb, h in highs.items() if h]


def test_a_stable_only_task_waits_for_its_range_to_be_persisted(server) -> None:
    with server.kv() as kv:
        kv.set_many({f"old{i}": b"1" for i in range(40)})
    server.flush()
    server.pause_persistence()
    with server.kv() as kv:
        kv.set_many({f"new{i}": b"2" for i in range(40)})
    ranges = _ranges(server)  # planned up to the high seqnos: not all persisted
    keys = {r[3] for r in _rows(list(read_ranges(_cfg(server.port), ranges, "normal")))}
    assert len(keys) == 80  # a normal task reads what is in memory at once

    got: list[tuple] = []  # type: ignore[type-arg]
    task = threading.Thread(
        target=lambda: got.extend(
            _rows(list(read_ranges(_cfg(server.port, stableOnly="true"), ranges, "stable")))
        ),
        daemon=True,
    )
    task.start()
    task.join(1.5)
    assert task.is_alive(), "a stable-only task read data that is not persisted yet"
    server.call(server.server.resume_persistence)
    task.join(20)
    assert not task.is_alive()
    assert {r[3] for r in got} == keys


def test_a_server_that_refuses_the_control_fails_the_task_naming_the_option(
    server, monkeypatch
) -> None:
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"1" for i in range(10)})
    ranges = _ranges(server)
    real = WireClient.dcp_open

    def refusing(self, *args, **kw):  # type: ignore[no-untyped-def]
        accepted = real(self, *args, **kw)
        return {**accepted, "stable_only": False}  # what an older server answers

    monkeypatch.setattr(WireClient, "dcp_open", refusing)
    with pytest.raises(RangeUnavailableError, match="stableOnly=true"):
        list(read_ranges(_cfg(server.port, stableOnly="true"), ranges, "refused"))
