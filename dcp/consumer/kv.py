"""KvClient: writes and reads on the same port as DCP (SET/ADD/REPLACE/DELETE/GET).

Rules of this module:
- Keys are routed to ``dcp.protocol.layout.vbucket_for_key(key, num_vbuckets)``; the client
  must know the server's vbucket count (default 1024).
- Pipelining: a batch is encoded into one buffer, written with one ``send_all``, and its
  responses are matched by opaque (they may come back in any order). Single operations
  are batches of one. Any number of tasks may use one client concurrently.
- A write returns ``MutationResult`` (CAS, and vb_uuid + seqno when the server reports
  them: HELLO MutationSeqno), once the write is in the server's memory. ``durable=True``
  sends alt framing (magic 0x08) and a durability frame info of level
  PERSIST_TO_MAJORITY whose timeout is the time the client will still wait, less a
  margin, rewritten per attempt (``kv_requests.py``). The server answers once the write
  is persisted or, at that deadline, with SYNC_WRITE_AMBIGUOUS, raised as
  ``SyncWriteAmbiguous``: the write was applied but may not be persisted. It is never
  retried here; the caller reads the document or repeats an idempotent write.
- Requests are encoded once with opaque 0 (``Op.frame``) and the opaque of each attempt
  is patched into the send buffer, so a retry re-sends the same bytes. The connection
  (``kv_connection.py``) matches answers by opaque straight from the received bytes.
- Errors: bad arguments raise ``UsageError`` at once. NOT_MY_VBUCKET/ETMPFAIL/EBUSY/
  ENOMEM answers are retried with backoff until ``timeout``. A lost connection is
  reopened; GET and SET (same key, same value: safe to repeat) are then re-sent, while
  ADD/REPLACE/DELETE and CAS writes fail with ``ConnectionLostError`` because whether
  they were applied is unknown. Other statuses raise the protocol's ``StatusError``
  subclasses (``KeyNotFound``, ``KeyExists``, ``NotStored``...).
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, cast

import trio

from dcp.protocol import codec
from dcp.protocol.errors import for_status
from dcp.protocol.frames import Frame
from dcp.protocol.layout import HDR_STORE, vbucket_for_key
from dcp.protocol.opcodes import HelloFeature, Opcode, Status

from .errors import (
    BatchWriteError,
    ClientClosedError,
    ConnectionLostError,
    RetryTimeoutError,
    SyncWriteAmbiguous,
    UsageError,
)
from .kv_connection import KvConnection, Op, WriteOk
from .kv_requests import (
    DocValue,
    KvItems,
    doc_bytes,
    durability_info,
    durability_timeout_ms,
    get_request,
    key_bytes,
    with_durability_timeout,
)
from .kv_results import GetResult, MutationResult
from .security import resolve

__all__ = ["DocValue", "KvClient", "KvItems"]

#: One answer of ``_execute``: the response, a successful write's tuple, or the error.
_Result = Frame | WriteOk | BaseException

Connector = Callable[[], Awaitable[trio.abc.Stream]]
_RETRIABLE = frozenset((Status.NOT_MY_VBUCKET, Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM))
KV_FEATURES = [
    HelloFeature.XERROR,
    HelloFeature.JSON,
    HelloFeature.MUTATION_SEQNO,
    HelloFeature.ALT_REQUEST_SUPPORT,
    HelloFeature.SYNC_REPLICATION,
]
_SET = int(Opcode.SET)


class KvClient:
    """Async KV client (pipelined).

    Args:
        host, port: the server (ignored when ``connector`` is given).
        num_vbuckets: the server's vbucket count (a power of two).
        timeout: seconds an operation (with its retries) may take.
        connector: ``async () -> trio.abc.Stream`` replacing the TCP connect.
        username, password, mechanism, tls, tls_ca, tls_cert: credentials and TLS, as
            ``DcpClient`` takes them (``security.py``; env ``DCP_USERNAME``...).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 11210,
        *,
        num_vbuckets: int = 1024,
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
        security = resolve(
            host,
            username=username,
            password=password,
            mechanism=mechanism,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
        )
        if connector is None:
            if type(port) is not int or not 0 < port < 65536:
                raise UsageError(f"port must be an int in 1..65535, not {port!r}")
            connector = functools.partial(trio.open_tcp_stream, host, port)
        if security.tls is not None:
            connector = functools.partial(security.connect, connector)
        self._credentials = security.credentials
        if num_vbuckets <= 0 or num_vbuckets & (num_vbuckets - 1):
            raise UsageError(f"num_vbuckets must be a power of two, not {num_vbuckets!r}")
        if not timeout > 0:
            raise UsageError("timeout must be > 0")
        self._connector = connector
        self.num_vbuckets = num_vbuckets
        self.timeout = timeout
        self._agent = agent
        self._conn: KvConnection | None = None
        self._connect_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: Any = None
        self._state = "new"

    async def __aenter__(self) -> KvClient:
        if self._state != "new":
            raise UsageError("a KvClient can only be entered once")
        self._state = "running"
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        try:
            await self._connect_with_retry()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _connect_with_retry(self) -> None:
        start = trio.current_time()
        attempts = 0
        backoff = 0.05
        while True:
            attempts += 1
            left = start + self.timeout - trio.current_time()
            try:
                with trio.fail_after(max(left, 0.001)):
                    await self._connection()
                return
            except (OSError, trio.TooSlowError, ConnectionLostError) as exc:
                elapsed = trio.current_time() - start
                if elapsed + backoff >= self.timeout:
                    raise RetryTimeoutError(
                        "connect", attempts=attempts, elapsed=elapsed, last_error=exc
                    ) from exc
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection. Idempotent."""
        if self._state == "closed":
            return
        self._state = "closed"
        if self._conn is not None:
            self._conn.fail(ClientClosedError("the client is closed"))
        cm, self._nursery_cm = self._nursery_cm, None
        if cm is not None:
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
            await cm.__aexit__(None, None, None)

    def vbucket_for(self, key: str | bytes) -> int:
        return vbucket_for_key(key_bytes(key), self.num_vbuckets)

    async def _connection(self) -> KvConnection:
        if self._state != "running":
            raise ClientClosedError("use the client inside `async with`, before it is closed")
        conn = self._conn
        if conn is not None and conn.error is None:
            return conn
        async with self._connect_lock:
            conn = self._conn
            if conn is not None and conn.error is None:
                return conn
            stream = await self._connector()
            conn = KvConnection(stream)
            assert self._nursery is not None
            self._nursery.start_soon(conn.read_loop)
            try:
                await self._handshake(conn)
            except BaseException as exc:
                # a refused (re)login or a lost handshake: this connection and its reader
                # end here, or every failed attempt would leave both behind
                conn.fail(exc if isinstance(exc, Exception) else ConnectionLostError("cancelled"))
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(conn.stream)
                raise
            self._conn = conn
            return conn

    async def _handshake(self, conn: KvConnection) -> None:
        """HELLO, then SASL when the client has credentials."""
        (f,) = await conn.roundtrip(
            [
                Op(
                    Opcode.HELLO,
                    b"",
                    0,
                    codec.hello(self._agent, [int(x) for x in KV_FEATURES]),
                    True,
                )
            ]
        )
        if f is None:
            raise conn.error or ConnectionLostError("HELLO got no answer")
        if isinstance(f, tuple):  # success with an empty value: no features
            conn.features = set()
        elif f.status == Status.SUCCESS:
            conn.features = set(codec.parse_hello_features(bytes(f.value)))
        if self._credentials is not None:
            await conn.authenticate(self._credentials)

    # ------------------------------------------------------------------ execution

    async def _execute(self, ops: list[Op], durable: bool = False) -> list[_Result]:
        """Run ``ops`` pipelined, retrying what is retriable until ``timeout``.

        ``durable``: the ops are durable writes; each attempt sends the time left as
        their durability timeout."""
        results: list[_Result | None] = [None] * len(ops)
        pending = list(range(len(ops)))
        start = trio.current_time()
        attempts = 0
        backoff = 0.01
        last: BaseException | None = None
        while pending:
            attempts += 1
            retry: list[int] = []
            try:
                with trio.fail_after(max(0.001, start + self.timeout - trio.current_time())):
                    conn = await self._connection()
                    if durable:
                        ms = durability_timeout_ms(start + self.timeout - trio.current_time())
                        for i in pending:
                            ops[i].frame = with_durability_timeout(ops[i].frame, ms)
                    batch = await conn.roundtrip_batch([ops[i] for i in pending])
            except (OSError, trio.TooSlowError, ConnectionLostError) as exc:
                last = exc
                retry = pending
            else:
                frames = batch.frames
                if attempts == 1 and batch.remaining == 0 and batch.others == 0:
                    # no None and no Frame: every answer is a successful write's tuple
                    return cast(list[_Result], frames)
                for i, f in zip(pending, frames, strict=True):
                    if isinstance(f, tuple):  # a successful write (see the module rules)
                        results[i] = f
                    elif f is None:
                        err = conn.error or ConnectionLostError("connection lost")
                        if ops[i].safe_to_repeat:
                            last = err
                            retry.append(i)
                        else:
                            results[i] = ConnectionLostError(
                                f"connection lost before the answer to opcode "
                                f"0x{ops[i].opcode:02x} for key {ops[i].key!r}: it may or may "
                                f"not have been applied"
                            )
                    elif (
                        durable
                        and f.status == Status.ETMPFAIL
                        and HelloFeature.XERROR not in conn.features
                    ):
                        # without extended errors the server's deadline answer is ETMPFAIL
                        results[i] = SyncWriteAmbiguous(f.status, f"key {ops[i].key!r}")
                    elif f.status in _RETRIABLE:
                        last = for_status(f.status, bytes(f.value))
                        retry.append(i)
                    else:
                        results[i] = f
            pending = retry
            if pending:
                elapsed = trio.current_time() - start
                if elapsed >= self.timeout:
                    err = RetryTimeoutError(
                        f"opcode 0x{ops[pending[0]].opcode:02x}",
                        vbucket=ops[pending[0]].vbucket,
                        attempts=attempts,
                        elapsed=elapsed,
                        last_error=last,
                    )
                    err.__cause__ = last
                    for i in pending:
                        results[i] = err
                    break
                await trio.sleep(min(backoff, max(0.0, self.timeout - elapsed)))
                backoff = min(backoff * 2, 0.5)
        return cast(list[_Result], results)  # every slot was filled above

    def _store_op(
        self,
        opcode: int,
        key: str | bytes,
        value: DocValue,
        flags: int,
        expiry: int,
        cas: int,
        durable: bool,
    ) -> Op:
        k = key_bytes(key)
        v, dt = doc_bytes(value)
        vb = vbucket_for_key(k, self.num_vbuckets)
        extras = codec.store_extras(flags, expiry)
        fe = durability_info(self.timeout) if durable else b""
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
        """Plain SETs (no CAS, not durable) for ``set_many``: ``_store_op`` inlined."""
        codec.store_extras(flags, expiry)  # range check once
        nvb = self.num_vbuckets
        head = HDR_STORE.pack
        hash_key = vbucket_for_key
        ops: list[Op] = []
        append = ops.append
        for key, value in pairs:
            k = key if type(key) is bytes and 0 < len(key) <= 250 else key_bytes(key)
            if type(value) is bytes:
                v = value
                dt = 0
            else:
                v, dt = doc_bytes(value)
            vb = hash_key(k, nvb)
            kl = len(k)
            append(
                Op(
                    _SET,
                    k,
                    vb,
                    head(0x80, _SET, kl, 8, dt, vb, 8 + kl + len(v), 0, 0, flags, expiry) + k + v,
                    True,
                )
            )
        return ops

    def _delete_op(self, key: str | bytes, cas: int, durable: bool) -> Op:
        k = key_bytes(key)
        vb = vbucket_for_key(k, self.num_vbuckets)
        fe = durability_info(self.timeout) if durable else b""
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

    async def _one_write(self, op: Op, durable: bool) -> MutationResult:
        (r,) = await self._execute([op], durable)
        res = self._mutation_result(op, r)
        if isinstance(res, BaseException):
            raise res
        return res

    # ------------------------------------------------------------------ public API

    async def set(
        self,
        key: str | bytes,
        value: DocValue,
        *,
        flags: int = 0,
        expiry: int = 0,
        cas: int = 0,
        durable: bool = False,
    ) -> MutationResult:
        """Create or replace ``key`` (with ``cas``: only if the CAS still matches)."""
        return await self._one_write(
            self._store_op(Opcode.SET, key, value, flags, expiry, cas, durable), durable
        )

    async def add(
        self,
        key: str | bytes,
        value: DocValue,
        *,
        flags: int = 0,
        expiry: int = 0,
        durable: bool = False,
    ) -> MutationResult:
        """Create ``key``; raises ``KeyExists`` if it exists."""
        return await self._one_write(
            self._store_op(Opcode.ADD, key, value, flags, expiry, 0, durable), durable
        )

    async def replace(
        self,
        key: str | bytes,
        value: DocValue,
        *,
        flags: int = 0,
        expiry: int = 0,
        cas: int = 0,
        durable: bool = False,
    ) -> MutationResult:
        """Replace an existing ``key``; raises ``KeyNotFound`` if it does not exist."""
        return await self._one_write(
            self._store_op(Opcode.REPLACE, key, value, flags, expiry, cas, durable), durable
        )

    async def delete(
        self, key: str | bytes, *, cas: int = 0, durable: bool = False
    ) -> MutationResult:
        """Delete ``key``; raises ``KeyNotFound`` if it does not exist."""
        return await self._one_write(self._delete_op(key, cas, durable), durable)

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
        durable: bool = False,
    ) -> list[MutationResult]:
        """Write many documents in one pipelined batch (one buffer, one ``send_all``).

        Returns:
            one ``MutationResult`` per item, in input order.
        Raises:
            BatchWriteError: some writes failed; ``.results`` has a result or an
                exception per item.
        """
        pairs = items.items() if isinstance(items, Mapping) else items
        if durable:
            ops = [self._store_op(Opcode.SET, k, v, flags, expiry, 0, durable) for k, v in pairs]
        else:
            ops = self._set_ops(pairs, flags, expiry)
        return await self._write_many(ops, durable)

    async def delete_many(
        self, keys: Iterable[str | bytes], *, durable: bool = False
    ) -> list[MutationResult]:
        """Delete many keys in one pipelined batch (see ``set_many`` for errors)."""
        return await self._write_many([self._delete_op(k, 0, durable) for k in keys], durable)

    async def _write_many(self, ops: list[Op], durable: bool = False) -> list[MutationResult]:
        if not ops:
            return []
        results = [
            self._mutation_result(op, r)
            for op, r in zip(ops, await self._execute(ops, durable), strict=True)
        ]
        if any(isinstance(r, BaseException) for r in results):
            raise BatchWriteError(results)
        return cast(list[MutationResult], results)  # no exception among them (checked)
