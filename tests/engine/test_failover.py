"""FailoverTable: new branches prune abandoned ones and are capped."""

from __future__ import annotations

import pytest

from dcp.producer.engine import FailoverTable
from dcp.producer.engine.failover import draw_uuid


def test_new_table_has_one_entry_at_seqno_0() -> None:
    t = FailoverTable.new(lambda: 7)
    assert t.entries == [(7, 0)] and t.latest_uuid == 7


def test_uuid_is_never_0_and_is_64_bit() -> None:
    vals = iter([0, 0, 1 << 70 | 5])
    assert draw_uuid(lambda: next(vals)) == 5
    with pytest.raises(ValueError):
        draw_uuid(lambda: 0)


def test_create_entry_prunes_entries_above_and_caps_the_table() -> None:
    t = FailoverTable([(3, 30), (2, 20), (1, 0)], max_entries=3)
    uuids = iter([9, 10])
    assert t.create_entry(25, lambda: next(uuids)) == 9
    assert t.entries == [(9, 25), (2, 20), (1, 0)]
    t.create_entry(26, lambda: next(uuids))
    assert t.entries == [(10, 26), (9, 25), (2, 20)]  # oldest dropped


def test_create_entry_never_reuses_a_uuid_in_the_table() -> None:
    t = FailoverTable([(5, 0)])
    uuids = iter([5, 6])
    assert t.create_entry(1, lambda: next(uuids)) == 6


def test_prune_above_keeps_at_least_one_entry() -> None:
    t = FailoverTable([(3, 30), (2, 20), (1, 10)])
    t.prune_above(25)
    assert t.entries == [(2, 20), (1, 10)]
    t.prune_above(5)
    assert t.entries == [(1, 10)]


def test_empty_table_is_refused() -> None:
    with pytest.raises(ValueError):
        FailoverTable([])
