"""KvClient: writes and reads on the same port as DCP (SET/ADD/REPLACE/DELETE/GET), to
one server or a cluster.

Rules of this module:
- Keys are hashed to ``dcp.protocol.layout.vbucket_for_key(key, num_vbuckets)`` with the
  vbucket count of the server's config, and each vbucket goes to its node: the
  bootstrap address itself against a single server, the active node of the cluster map
  otherwise (``kv_router.py``). The map is fetched at connect from the first bootstrap
  address that answers and kept current on NOT_MY_VBUCKET and lost nodes
  (``kv_nodes.py``).
- Pipelining: a batch is encoded into one buffer per node, written with one
  ``send_all``, and its responses are matched by opaque (they may come back in any
  order); the nodes of a batch are asked concurrently (``kv_execute.py``). Single
  operations are batches of one. Any number of tasks may use one client concurrently.
- A write returns ``MutationResult`` (CAS, and vb_uuid + seqno when the server reports
  them: HELLO MutationSeqno), once the write is in the server's memory. A durable
  write (``durability=`` a level other than none, or ``durable=True``: persisted on
  the active) sends alt framing (magic 0x08) and a durability frame info with the
  level and, as timeout, the time the client will still wait less a margin, rewritten
  per attempt (``kv_requests.py``; every frame of a batch carries it). The server
  answers once the level holds or, at that deadline, with SYNC_WRITE_AMBIGUOUS, raised
  as ``SyncWriteAmbiguous``: the write was applied but may not be durable. It is never
  retried here; the caller reads the document or repeats an idempotent write. A level
  the cluster map has too few copies for is refused with DURABILITY_IMPOSSIBLE
  (``DurabilityImpossibleError``, nothing written, not retried).
- Requests are encoded once with opaque 0 (``Op.frame``) and the opaque of each attempt
  is patched into the send buffer, so a retry re-sends the same bytes. The connection
  (``kv_connection.py``) matches answers by opaque straight from the received bytes.
- Errors: bad arguments raise ``UsageError`` at once. NOT_MY_VBUCKET/ETMPFAIL/EBUSY/
  ENOMEM answers, a vbucket without an active node and a lost node are retried with
  backoff until ``timeout``; of what a lost connection left unanswered only GET and SET
  (same key, same value: safe to repeat) are re-sent, while ADD/REPLACE/DELETE and CAS
  writes fail with ``ConnectionLostError`` because whether they were applied is
  unknown (``kv_execute.py``). Other statuses raise the protocol's ``StatusError``
  subclasses (``KeyNotFound``, ``KeyExists``, ``NotStored``...).
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, cast

import trio

from dcp.protocol import codec
from dcp.protocol.cluster_config import Address, ClusterConfig, ConfigError, parse_addresses
from dcp.protocol.errors import for_status
from dcp.protocol.layout import vbucket_for_key
from dcp.protocol.opcodes import DurabilityLevel, Opcode, Status

from .errors import BatchWriteError, ClientClosedError, UsageError
from .kv_connection import Op
from .kv_execute import Result as _Result
from .kv_execute import execute
from .kv_nodes import KV_FEATURES, KvNodes
from .kv_requests import (
    DocValue,
    KvItems,
    doc_bytes,
    durability_info,
    durability_level,
    get_request,
    key_bytes,
    plain_sets,
)
from .kv_results import GetResult, MutationResult
from .kv_router import KvRouter
from .security import resolve

__all__ = ["KV_FEATURES", "DocValue", "KvClient", "KvItems"]

Connector = Callable[[], Awaitable[trio.abc.Stream]]


class KvClient:
    """Async KV client (pipelined, routed by the cluster map).

    Args:
        host: the bootstrap list: one host (with ``port``), ``"h1:p1,h2:p2"``, or a
            list of ``"h:p"``/``(host, port)``. Any node of a cluster will do.
        port: the port of an address given without one.
        num_vbuckets: the server's vbucket count (a power of two); default: what the
            server's config says. Given and contradicting it: ``UsageError`` on connect.
        timeout: seconds an operation (with its retries) may take.
        connector: ``async () -> trio.abc.Stream`` replacing the TCP connect; the
            client then talks to that one server only (no cluster map is followed).
        username, password, mechanism, tls, tls_ca, tls_cert: credentials and TLS, as
            ``DcpClient`` takes them (``security.py``; env ``DCP_USERNAME``...).
    """

    def __init__(
        self,
        host: str | Address | Iterable[str | Address] = "127.0.0.1",
        port: int = 11210,
        *,
        num_vbuckets: int | None = None,
        timeout: float = 10.0,
        connector: Connector | None = None,
        agent: str = "dcp-kv/0.1",
        username: str | None = None,
        password: str | None = None,
        mechanism: str | None = None,
        tls: ssl.SSLContext | bool | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
    ) -> None:
        if connector is None and (type(port) is not int or not 0 < port < 65536):
            raise UsageError(f"port must be an int in 1..65535, not {port!r}")
        try:
            addrs = parse_addresses(host, default_port=port)
        except ConfigError as exc:
            raise UsageError(f"host: {exc}") from None
        security = resolve(
            addrs[0][0],
            username=username,
            password=password,
            mechanism=mechanism,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
        )
        if num_vbuckets is not None and (num_vbuckets <= 0 or num_vbuckets & (num_vbuckets - 1)):
            raise UsageError(f"num_vbuckets must be a power of two, not {num_vbuckets!r}")
        if not timeout > 0:
            raise UsageError("timeout must be > 0")
        self.timeout = timeout
        self._router = KvRouter(addrs, num_vbuckets, pinned=connector is not None)
        self._nodes = KvNodes(
            self._router, timeout=timeout, connector=connector, security=security, agent=agent
        )
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: Any = None
        self._state = "new"

    @property
    def num_vbuckets(self) -> int:
        """The vbucket count keys are routed with (the config's once connected)."""
        return self._router.num_vbuckets

    @property
    def config(self) -> ClusterConfig | None:
        """The cluster map the client routes with (None before it connected); read-only,
        for tools: a server that knows no maps shows as a one-node config of rev 0."""
        return self._router.config

    async def __aenter__(self) -> KvClient:
        if self._state != "new":
            raise UsageError("a KvClient can only be entered once")
        self._state = "running"
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._nodes.nursery = self._nursery
        try:
            await self._nodes.bootstrap()
        except BaseException:
            await self.aclose()
            raise
        self._nursery.start_soon(self._nodes.poll)
        self._nursery.start_soon(self._nodes.watch)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every connection. Idempotent."""
        if self._state == "closed":
            return
        self._state = "closed"
        self._nodes.close(ClientClosedError("the client is closed"))
        cm, self._nursery_cm = self._nursery_cm, None
        if cm is not None:
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
            await cm.__aexit__(None, None, None)

    def vbucket_for(self, key: str | bytes) -> int:
        return vbucket_for_key(key_bytes(key), self._router.num_vbuckets)

    async def _execute(self, ops: list[Op], durable: int = 0) -> list[_Result]:
        """Run ``ops`` on their nodes, retrying until ``timeout`` (``kv_execute.py``)."""
        if self._state != "running":
            raise ClientClosedError("use the client inside `async with`, before it is closed")
        return await execute(self._nodes, ops, self.timeout, bool(durable))

    def _store_op(
        self,
        opcode: int,
        key: str | bytes,
        value: DocValue,
        flags: int,
        expiry: int,
        cas: int,
        level: int,
    ) -> Op:
        k = key_bytes(key)
        v, dt = doc_bytes(value)
        vb = vbucket_for_key(k, self.num_vbuckets)
        extras = codec.store_extras(flags, expiry)
        fe = durability_info(level, self.timeout)
        return Op(
            opcode,
            k,
            vb,
            codec.request(
                opcode,
                vbucket=vb,
                cas=cas,
                datatype=dt,
                extras=extras,
                key=k,
                value=v,
                framing_extras=fe,
            ),
            opcode == Opcode.SET and cas == 0,
        )

    def _set_ops(
        self, pairs: Iterable[tuple[str | bytes, DocValue]], flags: int, expiry: int
    ) -> list[Op]:
        """Plain SETs (no CAS, not durable) for ``set_many`` (``kv_requests.plain_sets``)."""
        return plain_sets(pairs, flags, expiry, self.num_vbuckets)

    def _delete_op(self, key: str | bytes, cas: int, level: int) -> Op:
        k = key_bytes(key)
        vb = vbucket_for_key(k, self.num_vbuckets)
        fe = durability_info(level, self.timeout)
        return Op(
            Opcode.DELETE,
            k,
            vb,
            codec.request(Opcode.DELETE, vbucket=vb, cas=cas, key=k, framing_extras=fe),
            False,
        )

    @staticmethod
    def _mutation_result(op: Op, r: _Result) -> MutationResult | BaseException:
        if isinstance(r, tuple):
            if r[1] is None:
                return MutationResult(op.key, op.vbucket, r[0])
            return MutationResult(op.key, op.vbucket, r[0], r[1], r[2])
        if isinstance(r, BaseException):
            return r
        if r.status != Status.SUCCESS:
            return for_status(r.status, bytes(r.value), f"key {op.key!r}")
        ms = codec.parse_mutation_seqno(r)
        if ms is None:
            return MutationResult(op.key, op.vbucket, r.cas)
        return MutationResult(op.key, op.vbucket, r.cas, ms[0], ms[1])

    async def _one_write(self, op: Op, level: int) -> MutationResult:
        (r,) = await self._execute([op], level)
        res = self._mutation_result(op, r)
        if isinstance(res, BaseException):
            raise res
        return res

    # ------------------------------------------------------------------ public API
    # Every write takes ``durability``: a ``DurabilityLevel`` or its name ("none",
    # "majority", "majorityAndPersistActive", "persistToMajority", "persistActive"; any
    # case), or the older ``durable=True`` (= "persistActive"); not both (TypeError).
    # An unknown name raises ``UsageError`` (a ValueError) before anything is sent.

    async def set(
        self,
        key: str | bytes,
        value: DocValue,
        *,
        flags: int = 0,
        expiry: int = 0,
        cas: int = 0,
        durable: bool | None = None,
        durability: DurabilityLevel | str | None = None,
    ) -> MutationResult:
        """Create or replace ``key`` (with ``cas``: only if the CAS still matches)."""
        lv = durability_level(durability, durable)
        return await self._one_write(
            self._store_op(Opcode.SET, key, value, flags, expiry, cas, lv), lv
        )

    async def add(
        self,
        key: str | bytes,
        value: DocValue,
        *,
        flags: int = 0,
        expiry: int = 0,
        durable: bool | None = None,
        durability: DurabilityLevel | str | None = None,
    ) -> MutationResult:
        """Create ``key``; raises ``KeyExists`` if it exists."""
        lv = durability_level(durability, durable)
        return await self._one_write(
            self._store_op(Opcode.ADD, key, value, flags, expiry, 0, lv), lv
        )

    async def replace(
        self,
        key: str | bytes,
        value: DocValue,
        *,
        flags: int = 0,
        expiry: int = 0,
        cas: int = 0,
        durable: bool | None = None,
        durability: DurabilityLevel | str | None = None,
    ) -> MutationResult:
        """Replace an existing ``key``; raises ``KeyNotFound`` if it does not exist."""
        lv = durability_level(durability, durable)
        return await self._one_write(
            self._store_op(Opcode.REPLACE, key, value, flags, expiry, cas, lv), lv
        )

    async def delete(
        self,
        key: str | bytes,
        *,
        cas: int = 0,
        durable: bool | None = None,
        durability: DurabilityLevel | str | None = None,
    ) -> MutationResult:
        """Delete ``key``; raises ``KeyNotFound`` if it does not exist."""
        lv = durability_level(durability, durable)
        return await self._one_write(self._delete_op(key, cas, lv), lv)

    async def get(self, key: str | bytes) -> GetResult:
        """Read ``key``; raises ``KeyNotFound`` if it does not exist."""
        res = await self.get_many([key], missing_ok=False)
        return next(iter(res.values()))

    async def get_many(
        self, keys: Iterable[str | bytes], *, missing_ok: bool = True
    ) -> dict[bytes, GetResult]:
        """Read many keys in one pipelined batch; missing keys are left out."""
        ops: list[Op] = []
        for key in keys:
            k = key_bytes(key)
            vb = vbucket_for_key(k, self.num_vbuckets)
            ops.append(Op(Opcode.GET, k, vb, get_request(vb, k), True))
        out: dict[bytes, GetResult] = {}
        for op, r in zip(ops, await self._execute(ops), strict=True):
            if isinstance(r, BaseException):
                raise r
            if isinstance(r, tuple):  # SUCCESS without flags or value: an empty document
                out[op.key] = GetResult(op.key, b"", 0, r[0], 0)
                continue
            if r.status == Status.KEY_ENOENT and missing_ok:
                continue
            if r.status != Status.SUCCESS:
                raise for_status(r.status, bytes(r.value), f"key {op.key!r}")
            flags = codec.U32.unpack(r.extras)[0] if len(r.extras) == 4 else 0
            out[op.key] = GetResult(op.key, bytes(r.value), flags, r.cas, r.datatype)
        return out

    async def set_many(
        self,
        items: KvItems,
        *,
        flags: int = 0,
        expiry: int = 0,
        durable: bool | None = None,
        durability: DurabilityLevel | str | None = None,
    ) -> list[MutationResult]:
        """Write many documents in one pipelined batch (one buffer, one ``send_all``);
        a durable batch carries its level on every request.

        Returns:
            one ``MutationResult`` per item, in input order.
        Raises:
            BatchWriteError: some writes failed; ``.results`` has a result or an
                exception per item.
        """
        lv = durability_level(durability, durable)
        pairs = items.items() if isinstance(items, Mapping) else items
        if lv:
            ops = [self._store_op(Opcode.SET, k, v, flags, expiry, 0, lv) for k, v in pairs]
        else:
            ops = self._set_ops(pairs, flags, expiry)
        return await self._write_many(ops, lv)

    async def delete_many(
        self,
        keys: Iterable[str | bytes],
        *,
        durable: bool | None = None,
        durability: DurabilityLevel | str | None = None,
    ) -> list[MutationResult]:
        """Delete many keys in one pipelined batch (see ``set_many`` for errors)."""
        lv = durability_level(durability, durable)
        return await self._write_many([self._delete_op(k, 0, lv) for k in keys], lv)

    async def _write_many(self, ops: list[Op], level: int = 0) -> list[MutationResult]:
        if not ops:
            return []
        results = [
            self._mutation_result(op, r)
            for op, r in zip(ops, await self._execute(ops, level), strict=True)
        ]
        if any(isinstance(r, BaseException) for r in results):
            raise BatchWriteError(results)
        return cast(list[MutationResult], results)  # no exception among them (checked)
