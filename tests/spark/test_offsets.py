"""Offsets are canonical JSON: the same positions always give the same text."""

from __future__ import annotations

import json

import pytest

from dcp.spark.errors import OffsetError
from dcp.spark.offsets import (
    VbPosition,
    dumps,
    earliest,
    from_json,
    parse_starting_offsets,
    read_file,
    to_json,
    write_file_atomic,
)


def test_offset_json_is_canonical_whatever_the_insertion_order():
    a = {10: VbPosition(2**64 - 1, 7), 2: VbPosition(5, 3), 0: VbPosition()}
    b = {0: VbPosition(), 10: VbPosition(2**64 - 1, 7), 2: VbPosition(5, 3)}
    assert dumps(a) == dumps(b)
    assert list(to_json(a)["vb"]) == ["0", "2", "10"]
    assert to_json(a)["vb"]["10"] == {"u": str(2**64 - 1), "s": 7}


def test_offsets_survive_the_round_trip_through_spark_text():
    offs = {0: VbPosition(123, 9), 1: VbPosition(456, 4, 4)}
    text = json.dumps(to_json(offs))  # what Spark stores
    back = from_json(json.loads(text))
    assert back == offs
    assert json.dumps(to_json(back)) == text


@pytest.mark.parametrize(
    "bad",
    [
        {"v": 2, "vb": {}},
        {"vb": {"0": {"u": "1", "s": -1}}, "v": 1},
        {"v": 1, "vb": {"x": {"u": "1", "s": 1}}},
        {"v": 1, "vb": {"0": {"u": "1", "s": 1, "zz": 0}}},
        {"v": 1, "vb": {"0": {"u": "1", "s": 1, "rb": 5}}},
        "not json",
    ],
)
def test_malformed_offsets_are_refused(bad):
    with pytest.raises(OffsetError):
        from_json(bad if isinstance(bad, str) else json.dumps(bad))


def test_explicit_starting_offsets_fill_unnamed_vbuckets_with_earliest():
    got = parse_starting_offsets('{"3": {"u": "77", "s": 5}, "1": 9}', range(4))
    assert got == {0: VbPosition(), 1: VbPosition(0, 9), 2: VbPosition(), 3: VbPosition(77, 5)}
    full = dumps(got)
    assert parse_starting_offsets(full, range(4)) == got
    with pytest.raises(OffsetError, match="does not read"):
        parse_starting_offsets('{"9": 1}', range(4))


def test_offsets_file_is_written_atomically_and_read_back(tmp_path):
    path = str(tmp_path / "sub" / "start.json")
    assert read_file(path) is None
    offs = earliest(range(3))
    write_file_atomic(path, offs)
    assert read_file(path) == offs
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["start.json"]
