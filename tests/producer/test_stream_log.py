"""Per-stream events are counted and summarised at INFO once per interval (the events
themselves are DEBUG lines: a Spark source opens a stream per vbucket per task)."""

from __future__ import annotations

import logging

from dcp.producer import stream_log


def test_events_are_summarised_once_per_interval(monkeypatch, caplog):
    clock = [1000.0]
    monkeypatch.setattr(stream_log.time, "monotonic", lambda: clock[0])
    stream_log.flush()  # start an interval now
    with caplog.at_level(logging.INFO, logger="dcp.producer.streams"):
        for _ in range(500):
            stream_log.count("accepted")
            stream_log.count("ended")
        stream_log.count("rollback")
        assert caplog.messages == []  # inside the interval: nothing at INFO
        clock[0] += stream_log.INTERVAL
        stream_log.count("accepted")
    assert caplog.messages == ["streams in the last 60 s: accepted=501 ended=500 rollback=1"]
