"""A stable-only stream is served by the vbucket's active only (dcp_handlers.stream_req):
elsewhere the stable seqno is 0 and the stream would hold its first snapshot forever,
so the request is NOT_MY_VBUCKET, as a request to a dead vbucket is, and the client
follows the map."""

from __future__ import annotations

from dcp.producer.server import DcpServer
from dcp.protocol import Status, VBucketState, codec

from .conftest import client_of
from .wire import WireClient


async def _set_state(c: WireClient, vb: int, state: VBucketState) -> None:
    op = next(c.opaques)
    assert (await c.call(codec.set_vbucket_state(vb, state, op), op)).status == Status.SUCCESS


async def test_stable_only_streams_need_an_active_vbucket(
    server: DcpServer, client: WireClient
) -> None:
    await _set_state(client, 1, VBucketState.REPLICA)
    await _set_state(client, 2, VBucketState.PENDING)
    await _set_state(client, 3, VBucketState.DEAD)
    assert (await client.dcp_open("stable-reader")).status == Status.SUCCESS
    assert (await client.control("stable_only", "true")).status == Status.SUCCESS
    for vb in (1, 2, 3):
        r = await client.stream_req(vb)
        assert r.status == Status.NOT_MY_VBUCKET, (vb, r)
        assert b"not active" in bytes(r.value)
        assert vb not in client_streams(server)
    assert (await client.stream_req(0)).status == Status.SUCCESS  # the active one streams
    # the refusals cost the connection nothing; a normal connection may still stream
    # the replica vbucket, as before
    async with client_of(server) as other:
        assert (await other.dcp_open("normal-reader")).status == Status.SUCCESS
        assert (await other.stream_req(1)).status == Status.SUCCESS


def client_streams(server: DcpServer) -> set[int]:
    """The vbuckets with a live stream on any of ``server``'s connections."""
    return {vb for conn in server.connections for vb, s in conn.streams.items() if not s.is_dead}
