"""LinkControl against real in-process servers: seqnos by state, states, state changes
with JSON options, a login as the internal user, and every way of not getting an answer
(refused, silent, wrong password) as ControlUnavailable within the timeout."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio

from dcp.consumer import KvClient
from dcp.producer.cluster.control import ControlUnavailable, LinkControl
from dcp.producer.replication.link import SourceAuth
from dcp.producer.server import DcpServer, ServerConfig
from dcp.producer.users import add_user
from dcp.protocol.opcodes import Status, VBucketState
from tests.producer.conftest import running_server

NVB = 4


async def _write(port: int, n: int, **kw: object) -> None:
    async with KvClient("127.0.0.1", port, num_vbuckets=NVB, **kw) as kv:  # type: ignore[arg-type]
        await kv.set_many([(f"k{i}", b"v%d" % i) for i in range(n)])


async def test_seqnos_states_and_set_states(tmp_path: Path) -> None:
    async with running_server(tmp_path / "a", num_vbuckets=NVB) as a:
        await _write(a.port, 40)
        addr = f"127.0.0.1:{a.port}"
        control = LinkControl(timeout=5.0)
        try:
            want = {vb: a.bucket.vbucket(vb).high_seqno for vb in range(NVB)}
            assert sum(want.values()) == 40
            assert await control.seqnos(addr, VBucketState.ACTIVE) == want
            assert await control.seqnos(addr, VBucketState.REPLICA) == {}
            assert await control.states(addr, [0, 1, 2, 3]) == dict.fromkeys(
                range(NVB), VBucketState.ACTIVE
            )
            # vb 1 becomes a replica fed from a (closed) port elsewhere: the JSON options
            # reach the node's assignment
            got = await control.set_states(
                addr, [1, 2], VBucketState.REPLICA, {"source": "127.0.0.1:1"}
            )
            assert got == {1: Status.SUCCESS, 2: Status.SUCCESS}
            assert a.bucket.vbucket(1).state == VBucketState.REPLICA
            assignment = a.vbucket_states.assignment(1)
            assert assignment is not None and assignment.source == "127.0.0.1:1"
            assert await control.seqnos(addr, VBucketState.REPLICA) == {1: want[1], 2: want[2]}
            assert (await control.states(addr, [1, 3])) == {
                1: VBucketState.REPLICA,
                3: VBucketState.ACTIVE,
            }
            # refusals come back per vbucket: a takeover needs a source (EINVAL), and a
            # vbucket the node does not have is left out of states
            bad = await control.set_states(addr, [0], VBucketState.REPLICA, {"takeover": True})
            assert bad == {0: Status.EINVAL}
            assert await control.states(addr, [NVB + 3]) == {}
            await control.set_states(addr, [1, 2], VBucketState.ACTIVE)
            assert a.bucket.vbucket(1).state == VBucketState.ACTIVE
        finally:
            await control.aclose()


async def test_a_dead_cached_connection_is_replaced(tmp_path: Path) -> None:
    """The node restarts between two calls: the second call reconnects once."""
    data = tmp_path / "a"
    control = LinkControl(timeout=5.0)
    try:
        async with running_server(data, num_vbuckets=NVB) as a:
            port = a.port
            assert len(await control.seqnos(f"127.0.0.1:{port}", VBucketState.ACTIVE)) == NVB
        cfg = ServerConfig(port=port, data_dir=str(data), num_vbuckets=NVB)
        async with DcpServer(cfg) as b:
            assert b.port == port
            assert len(await control.seqnos(f"127.0.0.1:{port}", VBucketState.ACTIVE)) == NVB
    finally:
        await control.aclose()


async def test_login_as_the_internal_user(tmp_path: Path) -> None:
    users = tmp_path / "users.toml"
    add_user(users, "orch", ["admin", "read", "write", "stream"], "orch-pw", iterations=500)
    cfg = ServerConfig(
        port=0, data_dir=str(tmp_path / "a"), num_vbuckets=NVB, users_file=str(users)
    )
    async with DcpServer(cfg) as a:
        addr = f"127.0.0.1:{a.port}"
        good = LinkControl(auth=SourceAuth("orch", "orch-pw"), timeout=5.0)
        try:
            assert await good.set_states(addr, [3], VBucketState.DEAD) == {3: Status.SUCCESS}
            assert (await good.states(addr, [3])) == {3: VBucketState.DEAD}
        finally:
            await good.aclose()
        for auth in (SourceAuth("orch", "wrong"), None):
            control = LinkControl(auth=auth, timeout=5.0)
            try:
                if auth is None:  # no login: the node answers EACCESS, not a state
                    assert await control.states(addr, [3]) == {}
                    with pytest.raises(ControlUnavailable, match=addr):
                        await control.seqnos(addr, VBucketState.ACTIVE)
                else:
                    with pytest.raises(ControlUnavailable, match="orch"):
                        await control.seqnos(addr, VBucketState.ACTIVE)
            finally:
                await control.aclose()


async def test_unreachable_and_silent_nodes_are_unavailable_within_the_timeout() -> None:
    control = LinkControl(timeout=0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with trio.fail_after(3):
        with pytest.raises(ControlUnavailable, match=f"127.0.0.1:{closed}"):
            await control.seqnos(f"127.0.0.1:{closed}", VBucketState.ACTIVE)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        silent = f"127.0.0.1:{listener.getsockname()[1]}"
        start = trio.current_time()
        with pytest.raises(ControlUnavailable, match=r"no answer within 0\.5 s"):
            await control.states(silent, [0, 1])
        assert trio.current_time() - start < 2.0
    with pytest.raises(ControlUnavailable, match="HOST:PORT"):
        await control.set_states("nonsense", [0], VBucketState.ACTIVE)
    await control.aclose()
