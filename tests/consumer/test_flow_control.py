"""Flow control: bytes are acknowledged after hand-off, and nothing ever stalls."""

from __future__ import annotations

import trio

from dcp.consumer.flow_control import FlowControl

from .conftest import drain, make_client


def test_bytes_are_ackable_only_after_the_batch_is_handed_over():
    fc = FlowControl(1000, 0.2)  # threshold 200
    fc.held += 150
    assert fc.after_receive() == 0
    fc.held -= 150  # the snapshot completed
    fc.queued += 150
    assert fc.after_receive() == 0, "queued bytes wait for the application"
    assert fc.handed(150) == 0  # 150 < threshold
    fc.ackable += 60  # e.g. a stream end
    assert fc.after_receive() == 210
    assert fc.ackable == 0 and fc.acked_total == 210


def test_partial_snapshot_bytes_are_released_when_the_application_waits():
    fc = FlowControl(1000, 0.2)
    released = []

    def release() -> int:
        released.append(fc.held)
        return fc.held

    fc.release = release
    fc.held = 900  # one snapshot bigger than what is left of the window
    assert fc.after_receive() == 900
    assert released == [900] and fc.held == 0


def test_partial_bytes_are_not_released_while_the_application_is_behind():
    fc = FlowControl(1000, 0.2)
    fc.release = lambda: fc.held
    fc.held = 900
    fc.queued = 100  # the application has not taken a completed batch yet
    assert fc.after_receive() == 0, "back-pressure: wait for the application"
    assert fc.handed(100) == 1000  # it took the batch: now everything can go


def test_disabled_flow_control_never_acks():
    fc = FlowControl(0)
    fc.ackable = 10**6
    assert not fc.enabled and fc.after_receive() == 0 and fc.handed(5) == 0


async def test_snapshot_larger_than_the_window_completes(producer):
    h = producer.vb(0)
    h.add_mutations(200, per_snapshot=200, value=b"x" * 100)  # ~33 KB in one snapshot
    async with make_client(producer, vbuckets=[0], to_latest=True, buffer_size=4096) as c:
        with trio.fail_after(10):
            items = await drain(c)
    assert [len(b) for b in items] == [200]
    assert producer.acks, "acks were sent before the snapshot completed"
    assert producer.max_outstanding <= 4096 + 200


async def test_slow_application_with_a_small_window_never_stalls(producer):
    for vb in range(4):
        producer.vb(vb).add_mutations(120, per_snapshot=7, value=b"y" * 200)
    n = 0
    async with make_client(
        producer, vbuckets=range(4), to_latest=True, buffer_size=3000, ack_ratio=0.5
    ) as c:
        with trio.fail_after(20):
            async for b in c:
                n += len(b)
                if n % 50 < 7:
                    await trio.sleep(0.01)  # the application is slow now and then
                await b.commit()
    assert n == 480
    assert producer.max_outstanding <= 3000 + 300
    assert sum(producer.acks) > 480 * 200


async def test_unconsumed_batches_hold_back_the_server(producer):
    producer.vb(0).add_mutations(400, per_snapshot=4, value=b"z" * 100)
    async with make_client(producer, vbuckets=[0], buffer_size=8000) as c:
        first = await c.getone()
        await trio.sleep(0.3)  # the application stops consuming
        sent = producer.bytes_sent
        assert sent < 8000 + 1000, "the server stopped at the window"
        assert first.end == 4
        await trio.sleep(0.2)
        assert producer.bytes_sent == sent
        got = 1
        with trio.fail_after(10):
            while got < 100:
                await c.getone()
                got += 1
    assert producer.bytes_sent > 40_000


async def test_acks_are_batched_at_the_threshold(producer):
    producer.vb(0).add_mutations(300, per_snapshot=10, value=b"v" * 100)
    async with make_client(producer, vbuckets=[0], buffer_size=100_000, ack_ratio=0.2) as c:
        for _ in range(30):
            await c.getone()
        await trio.sleep(0.1)
        assert c.statistics()["flow_control"]["acked_total"] == sum(producer.acks)
    assert producer.acks and all(a >= 20_000 for a in producer.acks)
    assert len(producer.acks) == 2  # ~49 KB handed over, one ack per 20 KB
