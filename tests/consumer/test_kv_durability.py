"""KvClient durability levels: the level byte each write sends, the names it takes, and
the answers a durable write can get (``dcp/consumer/kv_requests.py``, ``kv.py``).

The server side is a scripted stand-in over a memory stream: it records every request
and answers each write with the status the test chooses, so the bytes sent and the
mapping of each status are checked without a cluster. The last test runs every level
against a real single server, with persistence paused and running.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
from trio.testing import memory_stream_pair

from dcp.consumer import (
    BatchWriteError,
    BlockingKvClient,
    DurabilityImpossibleError,
    KvClient,
    StatusError,
    SyncWriteAmbiguous,
    UsageError,
)
from dcp.consumer.kv_requests import LEVEL_NAMES, durability_level
from dcp.producer.server import DcpServer, ServerConfig
from dcp.protocol import FrameReader, codec
from dcp.protocol.frames import Frame
from dcp.protocol.opcodes import DurabilityLevel, FrameInfoId, Opcode, Status

NUM_VB = 16
WRITES = (Opcode.SET, Opcode.ADD, Opcode.REPLACE, Opcode.DELETE)


class Scripted:
    """A server that answers HELLO with no features and every write with
    ``status_of(frame)`` (SUCCESS by default); ``frames`` are the writes received."""

    def __init__(self, status_of: Callable[[Frame], int] = lambda f: Status.SUCCESS) -> None:
        self.status_of = status_of
        self.frames: list[Frame] = []
        self.client_end, self._server_end = memory_stream_pair()

    async def connect(self) -> trio.abc.Stream:
        return self.client_end

    async def serve(self) -> None:
        reader = FrameReader()
        while data := await self._server_end.receive_some(65536):
            reader.feed(data)
            for f in reader.read_frames():
                status = Status.SUCCESS
                if f.opcode in WRITES:
                    self.frames.append(f)
                    status = self.status_of(f)
                out = codec.response(f.opcode, status, opaque=f.opaque, cas=7)
                await self._server_end.send_all(out)


async def _with_client(server: Scripted, body: Callable, timeout: float = 5.0) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve)
        async with KvClient(connector=server.connect, num_vbuckets=NUM_VB, timeout=timeout) as kv:
            await body(kv)
        nursery.cancel_scope.cancel()


def _level_byte(f: Frame) -> int | None:
    """The level of a request's durability frame info, parsed from its bytes (None: the
    request has no framing extras at all)."""
    if f.magic == 0x80:
        assert not f.framing_extras
        return None
    assert f.magic == 0x08
    infos = codec.parse_frame_infos(f.framing_extras)
    assert [fid for fid, _ in infos] == [FrameInfoId.DURABILITY]
    data = infos[0][1]
    assert len(data) == 3  # the level and the u16 timeout
    return data[0]


EXPECTED = [
    ("none", None),
    ("majority", 1),
    ("majorityAndPersistActive", 2),
    ("persistToMajority", 3),
    ("persistActive", 4),
]


@pytest.mark.parametrize(("name", "byte"), EXPECTED)
async def test_every_write_sends_the_level_byte_of_its_name(name: str, byte: int | None) -> None:
    server = Scripted()

    async def body(kv: KvClient) -> None:
        await kv.set("s", b"1", durability=name)
        await kv.add("a", b"1", durability=name)
        await kv.replace("r", b"1", durability=name)
        await kv.delete("d", durability=name)
        await kv.set_many({"m1": b"1", "m2": b"2", "m3": b"3"}, durability=name)
        await kv.delete_many(["m1", "m2"], durability=name)

    await _with_client(server, body)
    assert [f.opcode for f in server.frames] == [
        Opcode.SET,
        Opcode.ADD,
        Opcode.REPLACE,
        Opcode.DELETE,
        *[Opcode.SET] * 3,
        *[Opcode.DELETE] * 2,
    ]
    # every request of the batches carries the level too, not just the first
    assert [_level_byte(f) for f in server.frames] == [byte] * 9


@pytest.mark.parametrize(
    ("given", "level"),
    [
        ("MAJORITY", DurabilityLevel.MAJORITY),
        ("persisttomajority", DurabilityLevel.PERSIST_TO_MAJORITY),
        ("PersistActive", DurabilityLevel.PERSIST_TO_ACTIVE),
        ("MajorityAndPersistActive", DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE),
        (DurabilityLevel.MAJORITY, DurabilityLevel.MAJORITY),
        (3, DurabilityLevel.PERSIST_TO_MAJORITY),
    ],
)
async def test_names_are_case_insensitive_and_levels_may_be_given_as_such(given, level) -> None:
    server = Scripted()

    async def body(kv: KvClient) -> None:
        await kv.set("k", b"v", durability=given)

    await _with_client(server, body)
    assert _level_byte(server.frames[0]) == level


async def test_durable_true_is_persist_to_active_and_false_or_nothing_is_plain() -> None:
    server = Scripted()

    async def body(kv: KvClient) -> None:
        await kv.set("a", b"1", durable=True)
        await kv.set("b", b"1", durable=False)
        await kv.set("c", b"1")
        await kv.set_many({"d": b"1"}, durable=True)

    await _with_client(server, body)
    assert [_level_byte(f) for f in server.frames] == [4, None, None, 4]


async def test_bad_levels_raise_before_anything_is_sent() -> None:
    server = Scripted()

    async def body(kv: KvClient) -> None:
        with pytest.raises(ValueError, match="persistToMajority") as info:
            await kv.set("k", b"v", durability="persist_to_majority")
        assert isinstance(info.value, UsageError)
        for name in LEVEL_NAMES:  # the message lists every valid name
            assert name in str(info.value)
        with pytest.raises(UsageError, match="unknown durability level 5"):
            await kv.set_many({"k": b"v"}, durability=5)
        with pytest.raises(TypeError, match="not both"):
            await kv.delete("k", durable=True, durability="majority")
        with pytest.raises(TypeError, match="not both"):
            await kv.add("k", b"v", durable=False, durability="majority")
        with pytest.raises(TypeError):
            await kv.replace("k", b"v", durability=True)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await kv.delete_many(["k"], durable=1)  # type: ignore[arg-type]

    await _with_client(server, body)
    assert server.frames == []


def test_durability_level_resolves_every_spelling() -> None:
    assert durability_level(None, None) is DurabilityLevel.NONE
    assert durability_level(None, False) is DurabilityLevel.NONE
    assert durability_level(None, True) is DurabilityLevel.PERSIST_TO_ACTIVE
    assert durability_level("NONE", None) is DurabilityLevel.NONE
    for name, level in LEVEL_NAMES.items():
        assert durability_level(name.upper(), None) is level


async def test_durability_impossible_raises_its_own_error_and_is_not_retried() -> None:
    server = Scripted(lambda f: Status.DURABILITY_IMPOSSIBLE)

    async def body(kv: KvClient) -> None:
        with pytest.raises(DurabilityImpossibleError) as info:
            await kv.set("k", b"v", durability="majority")
        assert info.value.status == Status.DURABILITY_IMPOSSIBLE == 0xA1
        assert isinstance(info.value, StatusError) and not info.value.retriable
        with pytest.raises(BatchWriteError) as batch:
            await kv.set_many({"a": b"1", "b": b"2"}, durability="persistToMajority")
        assert all(isinstance(r, DurabilityImpossibleError) for r in batch.value.results)

    await _with_client(server, body)
    assert len(server.frames) == 3  # each sent once


async def test_sync_write_ambiguous_stays_sync_write_ambiguous_at_every_level() -> None:
    server = Scripted(lambda f: Status.SYNC_WRITE_AMBIGUOUS)

    async def body(kv: KvClient) -> None:
        for name in ("majority", "majorityAndPersistActive", "persistToMajority"):
            with pytest.raises(SyncWriteAmbiguous) as info:
                await kv.delete("k", durability=name)
            assert info.value.status == 0xA3

    await _with_client(server, body)
    assert len(server.frames) == 3


async def test_the_timeout_sent_is_the_time_the_client_will_still_wait() -> None:
    server = Scripted()

    async def body(kv: KvClient) -> None:
        await kv.set_many({"a": b"1", "b": b"2"}, durability="majority")

    await _with_client(server, body, timeout=3.0)
    for f in server.frames:
        data = codec.parse_frame_infos(f.framing_extras)[0][1]
        ms = int.from_bytes(data[1:], "big")
        assert 2500 <= ms <= 2750, ms  # 3 s less the 0.25 s margin, a little time spent


async def test_blocking_client_passes_the_level_and_raises_in_the_callers_thread(producer):
    for vb in range(1024):
        producer.vb(vb)

    def app() -> None:
        with BlockingKvClient("127.0.0.1", producer.port) as kv:
            kv.set("a", b"1", durability="majority")
            kv.delete("a", durability=DurabilityLevel.PERSIST_TO_MAJORITY)
            kv.set_many([("b", b"2")], durability="persistActive")
            with pytest.raises(UsageError):
                kv.set("c", b"3", durability="quorum")

    await trio.to_thread.run_sync(app)
    writes = [f for f in producer.frames if f.opcode in WRITES]
    assert [codec.parse_durability(f) for f in writes] == [1, 3, 4]


async def test_each_level_against_a_real_single_node(tmp_path) -> None:
    """A single server is a chain of one: ``majority`` holds once the write is in its
    memory, every level that involves persistence waits for its disk. With persistence
    paused those are ambiguous at the client's deadline; once it runs, all succeed."""
    cfg = ServerConfig(
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "d"),
        num_vbuckets=NUM_VB,
        log_level="WARNING",
    )
    async with (
        DcpServer(cfg) as server,
        KvClient("127.0.0.1", server.port, num_vbuckets=NUM_VB, timeout=1.0) as kv,
    ):
        server.pause_persistence()
        assert (await kv.set("m", b"1", durability="majority")).seqno
        assert (await kv.set("n", b"1", durability="none")).seqno
        for name in ("majorityAndPersistActive", "persistToMajority", "persistActive"):
            with pytest.raises(SyncWriteAmbiguous):
                await kv.set(f"p-{name}", b"1", durability=name)
        server.resume_persistence()
        for name in LEVEL_NAMES:
            r = await kv.set(f"q-{name}", b"2", durability=name)
            assert r.seqno
        results = await kv.delete_many(
            [f"q-{n}" for n in LEVEL_NAMES], durability="persistToMajority"
        )
        assert len(results) == len(LEVEL_NAMES)
