"""The batched SET path (``kv_handlers.set_run``): a received chunk's plain SETs are
applied in one run, and anything else in between still gets its own answer, in order."""

from __future__ import annotations

import trio

from dcp.protocol import Opcode, Status, codec
from dcp.protocol.opcodes import HelloFeature

from .conftest import client_of, running_server
from .wire import keys_for_vb


def _set(
    vb: int, key: bytes, value: bytes, opaque: int, *, cas: int = 0, expiry: int = 0, flags: int = 0
) -> bytes:
    return codec.request(
        Opcode.SET,
        vbucket=vb,
        opaque=opaque,
        cas=cas,
        key=key,
        value=value,
        extras=codec.store_extras(flags, expiry),
    )


async def _answers(client, n: int) -> list:
    return [await client.next_frame() for _ in range(n)]


async def test_one_chunk_of_mixed_requests_is_answered_in_order(tmp_path) -> None:
    async with (
        running_server(tmp_path / "d", max_item_size=1024) as server,
        client_of(server) as client,
    ):
        await client.hello([int(HelloFeature.MUTATION_SEQNO)])
        a, b, c = keys_for_vb(1, 3, 4)
        other = keys_for_vb(2, 1, 4)[0]
        chunk = b"".join(
            [
                _set(1, a, b"v1", 1),
                _set(1, b, b"v2", 2),
                codec.request(
                    Opcode.ADD,
                    vbucket=1,
                    opaque=3,
                    key=a,
                    value=b"x",
                    extras=codec.store_extras(0, 0),
                ),  # exists
                _set(1, c, b"v3", 4),
                _set(1, other, b"misrouted", 5),  # NOT_MY_VBUCKET
                _set(9, other, b"bad vbucket", 6),  # NOT_MY_VBUCKET
                _set(1, a, b"x" * 5000, 7),  # E2BIG
                _set(1, a, b"cas-miss", 8, cas=12345),  # KEY_EEXISTS
                codec.request(Opcode.GET, vbucket=1, opaque=9, key=a),
                _set(1, a, b"v4", 10, flags=7, expiry=100),
                codec.request(Opcode.DELETE, vbucket=1, opaque=11, key=b),
                _set(1, b, b"v5", 12),
            ]
        )
        await client.send(chunk)
        got = await _answers(client, 12)
        assert [f.opaque for f in got] == list(range(1, 13))
        status = {f.opaque: f.status for f in got}
        assert status == {
            1: 0,
            2: 0,
            3: Status.KEY_EEXISTS,
            4: 0,
            5: Status.NOT_MY_VBUCKET,
            6: Status.NOT_MY_VBUCKET,
            7: Status.E2BIG,
            8: Status.KEY_EEXISTS,
            9: 0,
            10: 0,
            11: 0,
            12: 0,
        }
        assert got[8].value == b"v1"
        ok = (1, 2, 4, 10, 11, 12)
        seqnos = [codec.parse_mutation_seqno(f)[1] for f in got if f.opaque in ok]
        assert seqnos == [1, 2, 3, 4, 5, 6]
        uuid = server.bucket.vbucket(1).uuid
        assert all(
            codec.parse_mutation_seqno(f)[0] == uuid
            for f in got
            if f.status == 0 and f.opcode == Opcode.SET
        )
        vb = server.bucket.vbucket(1)
        meta = vb.key_meta(a)
        assert meta[0] == 4 and meta[1] == 2 and meta[3] == 7  # seqno, rev, flags
        assert meta[4] > 1_000_000_000  # relative expiry became absolute
        cases = [f.cas for f in got if f.status == 0 and f.opcode == Opcode.SET]
        assert cases == sorted(cases) and len(set(cases)) == len(cases)
        assert vb.get(b).value == b"v5"
        assert server.metrics.ops[int(Opcode.SET)] == 5


async def test_sets_without_mutation_seqno_get_plain_answers(server, client) -> None:
    keys = keys_for_vb(3, 50, 4)
    await client.send(b"".join(_set(3, k, k, i + 1) for i, k in enumerate(keys)))
    got = await _answers(client, 50)
    assert [f.opaque for f in got] == list(range(1, 51))
    assert all(f.status == 0 and not f.extras and f.cas for f in got)
    assert server.bucket.vbucket(3).high_seqno == 50


async def test_a_set_split_across_receives_is_applied_once(server, client) -> None:
    keys = keys_for_vb(0, 20, 4)
    data = b"".join(_set(0, k, b"v" * 300, i + 1) for i, k in enumerate(keys))
    for cut in range(0, len(data), 777):  # frames straddle the reads
        await client.send(data[cut : cut + 777])
        await trio.sleep(0.001)
    got = await _answers(client, 20)
    assert [f.opaque for f in got] == list(range(1, 21))
    assert server.bucket.vbucket(0).high_seqno == 20


async def test_writes_are_refused_with_etmpfail_while_storage_fails(server, client) -> None:
    server.persistence.storage_error = "disk on fire"
    keys = keys_for_vb(2, 3, 4)
    await client.send(b"".join(_set(2, k, b"v", i + 1) for i, k in enumerate(keys)))
    got = await _answers(client, 3)
    assert [f.status for f in got] == [Status.ETMPFAIL] * 3
    assert server.bucket.vbucket(2).high_seqno == 0
    server.persistence.storage_error = None
    f = await client.set(keys[0], b"ok")
    assert f.status == 0


async def test_batched_sets_reach_streams_and_disk(server, client) -> None:
    await client.dcp_open("ingest-batch")
    await client.control("enable_noop", "false")
    await client.stream_req(1)
    keys = keys_for_vb(1, 200, 4)
    async with client_of(server) as writer:
        await writer.send(b"".join(_set(1, k, k, i + 1) for i, k in enumerate(keys)))
        got = await _answers(writer, 200)
        assert all(f.status == 0 for f in got)
    seen: list[bytes] = []

    def done(f) -> bool:
        if f.opcode == Opcode.DCP_MUTATION:
            seen.append(bytes(f.key))
        return len(seen) == 200

    await client.read_stream_until(done)
    assert seen == keys
    with trio.fail_after(10):
        while server.bucket.vbucket(1).persisted_seqno < 200:
            await trio.sleep(0.01)
    assert server.bucket.storage.get(1, 200).key == keys[-1]


async def test_sdk_set_many_results_equal_plainly_built_ones(server) -> None:
    from dcp.consumer import KvClient, MutationResult

    async with KvClient("127.0.0.1", server.port, num_vbuckets=4) as kv:
        pairs = [(b"sdk-%d" % i, b"v%d" % i) for i in range(300)]
        res = await kv.set_many(pairs)
    for (k, _v), r in zip(pairs, res, strict=True):
        vb = server.bucket.vbucket(kv.vbucket_for(k))
        e = vb.key_meta(k)
        want = MutationResult(k, vb.vbid, e[2], vb.uuid, e[0])
        assert r == want and hash(r) == hash(want) and repr(r) == repr(want)
