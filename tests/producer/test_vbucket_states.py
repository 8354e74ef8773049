"""SET_VBUCKET_STATE / GET_VBUCKET on the wire, and what a state change does to streams.

The server's owner of the assignment (``server.vbucket_states``) is wrapped by a recorder
that notes what the handler hands it (state and JSON options) and passes it on, so these
tests see both the handler's layouts and errors and the whole path: engine state,
StreamRegistry.end_streams, writes refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from dcp.producer.server import DcpServer
from dcp.protocol import Opcode, Status, StreamEndStatus, StreamRequestFlag, codec
from dcp.protocol.opcodes import VBucketState

from .conftest import client_of
from .wire import WireClient, items_of, keys_for_vb


class RecordingStates:
    """Records ``set(vb, state, options)`` calls, then lets the server's own
    ``vbucket_states`` act on them."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[tuple[int, VBucketState, dict]] = []

    def set(self, vb: int, state: VBucketState, options: dict) -> None:
        self.calls.append((vb, state, options))
        self.real.set(vb, state, options)


@pytest.fixture
def states(server: DcpServer) -> RecordingStates:
    rec = RecordingStates(server.vbucket_states)
    server.vbucket_states = rec  # type: ignore[assignment]
    return rec


async def _raw_answer(client: WireClient, request: bytes) -> bytes:
    """Send ``request`` and return the exact bytes of the one response frame."""
    await client.send(request)
    data = b""
    with trio.fail_after(5):
        while len(data) < 24 or len(data) < 24 + int.from_bytes(data[8:12], "big"):
            chunk = await client.stream.receive_some(4096)
            assert chunk, "server closed the connection"
            data += chunk
    assert len(data) == 24 + int.from_bytes(data[8:12], "big"), data.hex()
    return data


async def _set_state(
    client: WireClient, vb: int, extras: bytes, value: bytes = b"", datatype: int = 0, key=b""
) -> Any:
    op = next(client.opaques)
    frame = codec.request(
        Opcode.SET_VBUCKET_STATE,
        vbucket=vb,
        opaque=op,
        extras=extras,
        key=key,
        value=value,
        datatype=datatype,
    )
    return await client.call(frame, op)


# --------------------------------------------------------------------------- GET_VBUCKET


async def test_get_vbucket_answers_the_state_as_four_bytes(server, client, states) -> None:
    req = bytes.fromhex("803e0000000000010000000000000007") + bytes(8)  # vb 1, opaque 7
    assert await _raw_answer(client, req) == bytes.fromhex(
        "813e0000 00000000 00000004 00000007 0000000000000000 00000001"
    )
    server.bucket.vbucket(1).set_state(VBucketState.REPLICA)
    assert (await _raw_answer(client, req))[24:] == b"\x00\x00\x00\x02"
    server.bucket.vbucket(1).set_state(VBucketState.DEAD)
    assert (await _raw_answer(client, req))[24:] == b"\x00\x00\x00\x04"


async def test_get_vbucket_errors(server, client) -> None:
    op = next(client.opaques)
    r = await client.call(codec.request(Opcode.GET_VBUCKET, vbucket=4, opaque=op), op)
    assert r.status == Status.NOT_MY_VBUCKET  # 4 vbuckets: 0..3
    op = next(client.opaques)
    r = await client.call(codec.request(Opcode.GET_VBUCKET, opaque=op, extras=b"\x01"), op)
    assert r.status == Status.EINVAL
    op = next(client.opaques)
    r = await client.call(codec.request(Opcode.GET_VBUCKET, opaque=op, key=b"k"), op)
    assert r.status == Status.EINVAL


# --------------------------------------------------------------------------- SET_VBUCKET_STATE


async def test_set_vbucket_state_layout_and_success(server, client, states) -> None:
    # 1 byte of extras (2 = replica), no key, no value: SUCCESS with an empty body
    req = bytes.fromhex("803d0000010000020000000100000009") + bytes(8) + b"\x02"
    assert await _raw_answer(client, req) == bytes.fromhex(
        "813d0000 00000000 00000000 00000009 0000000000000000"
    )
    assert states.calls == [(2, VBucketState.REPLICA, {})]
    assert server.bucket.vbucket(2).state is VBucketState.REPLICA
    # with our JSON options (datatype JSON); nothing listens at the source: the replica
    # keeps trying in the background, which is not this test's business
    opts = {"source": "127.0.0.1:1"}
    op = next(client.opaques)
    r = await client.call(codec.set_vbucket_state(3, VBucketState.REPLICA, op, opts), op)
    assert r.status == Status.SUCCESS and not r.value
    assert states.calls[-1] == (3, VBucketState.REPLICA, opts)


@pytest.mark.parametrize(
    ("extras", "value", "datatype", "key"),
    [
        (b"\x00", b"", 0, b""),  # state 0
        (b"\x05", b"", 0, b""),  # state 5
        (b"", b"", 0, b""),  # no extras
        (b"\x00\x00\x00\x02", b"", 0, b""),  # the old 4-byte form
        (b"\x02", b"not json", 1, b""),  # value not JSON
        (b"\x02", b'{"source": "h:1"}', 0, b""),  # JSON not marked JSON
        (b"\x02", b"[1, 2]", 1, b""),  # not an object
        (b"\x02", b"", 0, b"key"),  # a key
    ],
)
async def test_set_vbucket_state_bad_frames_get_einval(
    server, client, states, extras, value, datatype, key
) -> None:
    r = await _set_state(client, 1, extras, value, datatype, key)
    assert r.status == Status.EINVAL
    assert states.calls == []
    assert server.bucket.vbucket(1).state is VBucketState.ACTIVE
    op = next(client.opaques)  # the connection goes on
    assert (await client.call(codec.request(Opcode.NOOP, opaque=op), op)).status == 0


async def test_set_vbucket_state_unknown_vbucket_and_refused_options(server, client, states):
    r = await _set_state(client, 4, b"\x02")
    assert r.status == Status.NOT_MY_VBUCKET and states.calls == []
    r = await _set_state(client, 1, b"\x02", b'{"colour": "red"}', 1)
    assert r.status == Status.EINVAL  # the assignment's refusal, answered with its status
    assert server.bucket.vbucket(1).state is VBucketState.ACTIVE


# --------------------------------------------------------------------------- streams


async def test_demotion_ends_the_vbuckets_streams_with_state_changed(server, client, states):
    await client.set_many([(k, b"v") for k in keys_for_vb(1, 3, 4) + keys_for_vb(2, 2, 4)])
    async with client_of(server) as dcp:
        await dcp.dcp_open("t-demote")
        assert (await dcp.stream_req(1)).status == Status.SUCCESS
        assert (await dcp.stream_req(2)).status == Status.SUCCESS
        seen: set[tuple[int, int]] = set()
        await dcp.read_stream_until(
            lambda f: (
                bool(seen.update((f.vbucket, s) for _, s, _, _ in items_of([f])))
                or {(1, 3), (2, 2)} <= seen
            )
        )
        assert (await _set_state(client, 1, b"\x02")).status == Status.SUCCESS
        frames = await dcp.read_stream_until(lambda f: f.opcode == Opcode.DCP_STREAM_END)
        assert frames[-1].vbucket == 1
        assert codec.parse_stream_end(frames[-1]) == StreamEndStatus.STATE_CHANGED
        # writes to the demoted vbucket are refused; its neighbour goes on streaming
        (k1,) = keys_for_vb(1, 1, 4, prefix="late")
        assert (await client.store(Opcode.SET, k1, b"x")).status == Status.NOT_MY_VBUCKET
        (k2,) = keys_for_vb(2, 1, 4, prefix="late")
        await client.set(k2, b"x")
        after = await dcp.frames_for(0.5)
        assert [(f.vbucket, s) for f in after for _, s, _, _ in items_of([f])] == [(2, 3)]
        assert all(f.vbucket != 1 for f in after if not f.is_response)


async def test_replica_streams_unless_active_vb_only(server, client, states) -> None:
    keys = keys_for_vb(1, 3, 4)
    await client.set_many([(k, b"v") for k in keys])
    assert (await _set_state(client, 1, b"\x02")).status == 0
    await client.dcp_open("t-replica")
    r = await client.stream_req(1, flags=StreamRequestFlag.ACTIVE_VB_ONLY)
    assert r.status == Status.NOT_MY_VBUCKET
    r = await client.stream_req(1, flags=StreamRequestFlag.TAKEOVER)
    assert r.status == Status.NOT_MY_VBUCKET  # a takeover needs the active copy
    r = await client.stream_req(1, end=3)
    assert r.status == Status.SUCCESS
    frames = await client.read_stream_until(lambda f: f.opcode == Opcode.DCP_STREAM_END)
    assert [s for _, s, _, _ in items_of(frames)] == [1, 2, 3]
    assert codec.parse_stream_end(frames[-1]) == StreamEndStatus.OK
    for state in (b"\x03", b"\x04"):  # pending and dead: no streams
        assert (await _set_state(client, 1, state)).status == 0
        assert (await client.stream_req(1)).status == Status.NOT_MY_VBUCKET
