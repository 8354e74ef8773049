"""Options are validated at query start, with messages that name the option."""

from __future__ import annotations

import pytest

from dcp.spark.errors import OptionError
from dcp.spark.options import parse_options, parse_vbuckets


def test_defaults_differ_only_in_the_merged_snapshot_policy():
    s = parse_options({}, streaming=True)
    b = parse_options({}, streaming=False)
    assert (s.host, s.port, s.vbuckets, s.on_rollback) == ("127.0.0.1", 11210, None, "fail")
    assert (s.on_merged_snapshot, b.on_merged_snapshot) == ("fail", "reread")


def test_options_are_case_insensitive_and_typed():
    c = parse_options(
        {
            "PORT": "1234",
            "maxRowsPerBatch": "10",
            "vbuckets": "0,2,4-6",
            "onRollback": "REWIND",
            "numPartitions": "3",
        },
        streaming=True,
    )
    assert (c.port, c.max_rows_per_batch, c.vbuckets, c.on_rollback, c.partitions) == (
        1234,
        10,
        (0, 2, 4, 5, 6),
        "rewind",
        3,
    )


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"prot": "1"}, "unknown option 'prot'"),
        ({"port": "x"}, "port"),
        ({"onRollback": "ignore"}, "onRollback"),
        ({"startingOffsets": "latest"}, "startingOffsetsFile"),
        ({"startingOffsets": "yesterday"}, "startingOffsets"),
        ({"vbuckets": "3-1"}, "vbuckets"),
        ({"maxRowsPerBatch": "0"}, "maxRowsPerBatch"),
    ],
)
def test_bad_options_are_refused_by_name(opts, match):
    with pytest.raises(OptionError, match=match):
        parse_options(opts, streaming=True)


def test_vbucket_lists():
    assert parse_vbuckets("all") is None
    assert parse_vbuckets(" 5, 1-2 ") == (1, 2, 5)


def test_kafka_names_are_aliases_with_the_same_meaning():
    c = parse_options(
        {
            "maxOffsetsPerTrigger": "1000",
            "minOffsetsPerTrigger": "10",
            "maxTriggerDelay": "30s",
            "failOnDataLoss": "false",
        },
        streaming=True,
    )
    assert (c.max_rows_per_batch, c.min_rows_per_batch, c.max_trigger_delay) == (1000, 10, 30.0)
    assert c.on_rollback == "rewind"
    assert parse_options({"failOnDataLoss": "true"}, streaming=True).on_rollback == "fail"
    b = parse_options({"startingOffsets": '{"0": 5}', "endingOffsets": "latest"}, streaming=False)
    assert (b.starting_offsets, b.ending_offsets) == ('{"0": 5}', "latest")
    assert parse_options({"retryTimeout": "forever"}, streaming=True).retry_timeout == float("inf")


@pytest.mark.parametrize(
    ("opts", "streaming", "match"),
    [
        ({"maxOffsetPerTrigger": "1"}, None, "did you mean 'maxOffsetsPerTrigger'"),
        ({"startingOffset": "earliest"}, None, "did you mean 'startingOffsets'"),
        ({"failOnDataLoss": "false", "onRollback": "fail"}, True, "contradict"),
        ({"maxOffsetsPerTrigger": "5", "maxRowsPerBatch": "6"}, True, "same option"),
        ({"minOffsetsPerTrigger": "9", "maxOffsetsPerTrigger": "5"}, True, "no batch could"),
        ({"endingOffsets": "latest"}, True, "endingOffsets is for batch reads"),
        ({"maxOffsetsPerTrigger": "5"}, False, "maxOffsetsPerTrigger is for streams"),
        ({"startingOffsets": "latest"}, False, "means nothing for a batch read"),
        ({"maxTriggerDelay": "soon"}, None, "maxTriggerDelay"),
    ],
)
def test_near_misses_and_contradictions_are_refused_with_a_hint(opts, streaming, match):
    with pytest.raises(OptionError, match=match):
        parse_options(opts, streaming=streaming)
