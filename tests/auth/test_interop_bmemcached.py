"""A third-party memcached client (python-binary-memcached) logs in with SASL PLAIN over
loopback, as any memcached-binary client does, then SETs and GETs through the gate."""

from __future__ import annotations

import bmemcached
import pytest
import trio
from bmemcached.exceptions import MemcachedException

from dcp.protocol import Status, codec

from .conftest import password_of


def _key_in_vbucket_0(prefix: str) -> str:
    """bmemcached puts vbucket 0 in every request: use keys that hash there."""
    return next(
        k
        for k in (f"{prefix}{i}" for i in range(1000))
        if codec.vbucket_for_key(k.encode(), 4) == 0
    )


def _session(port: int, user: str, password: str) -> tuple:
    client = bmemcached.Client((f"127.0.0.1:{port}",), user, password, socket_timeout=5)
    try:
        key = _key_in_vbucket_0("interop-")
        stored = client.set(key, "hello from bmemcached")
        return stored, client.get(key)
    finally:
        client.disconnect_all()


async def test_bmemcached_plain_login_set_and_get(server):
    stored, got = await trio.to_thread.run_sync(
        _session, server.port, "u_all", password_of("u_all")
    )
    assert stored is True and got == "hello from bmemcached"


async def test_bmemcached_wrong_password_is_refused(server):
    # bmemcached expects AUTH_ERROR as 0x08 (its own table), so it reports memcached's
    # real AUTH_ERROR 0x20 as a generic error with that code
    with pytest.raises(MemcachedException) as info:
        await trio.to_thread.run_sync(_session, server.port, "u_all", "wrong")
    assert info.value.code == Status.AUTH_ERROR
