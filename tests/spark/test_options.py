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


def test_host_takes_one_address_or_a_bootstrap_list():
    one = parse_options({"host": "db1", "port": "2000"}, streaming=True)
    assert (one.host, one.port, one.bootstrap, one.addresses) == ("db1", 2000, (), (("db1", 2000),))
    with_port = parse_options({"host": "db1:3000"}, streaming=True)
    assert (with_port.host, with_port.port, with_port.bootstrap) == ("db1", 3000, ())
    many = parse_options({"host": " a:1, b ,[::1]:3", "port": "9"}, streaming=True)
    assert many.addresses == (("a", 1), ("b", 9), ("::1", 3))  # a bare host uses option port
    assert (many.host, many.port) == ("a", 1)
    assert parse_options({"host": "::1"}, streaming=True).addresses == (("::1", 11210),)


@pytest.mark.parametrize("host", ["a:1,b:x", "a:1,:2", "a:99999", " , ", "[::1:3"])
def test_a_malformed_host_list_is_refused_by_name(host):
    with pytest.raises(OptionError, match="option host"):
        parse_options({"host": host}, streaming=None)


def test_plain_passwords_are_refused_to_any_remote_node_of_a_list():
    with pytest.raises(OptionError, match="PLAIN password in clear to db2"):
        parse_options(
            {"host": "127.0.0.1:1,db2:2", "username": "u", "password": "p", "mechanism": "PLAIN"},
            streaming=True,
        )
