"""Blocking facades for applications that do not use trio.

Rules of this module:
- Each facade owns one dedicated thread that runs ``trio.run``; inside it the real async
  client lives in ``async with``. Calls from the application's thread go through
  ``trio.from_thread.run`` (one round trip per call, ~0.1 ms), so the facade hands out
  a whole batch per call (raw mode: a whole chunk of events), never one item per call.
- Same iteration model as ``DcpClient``: ``for item in client`` yields
  ``SnapshotBatch``/``RollbackEvent`` (raw mode: events); ``item.commit()`` and
  ``client.commit()`` block until the positions are saved.
- ``close()`` is idempotent, stops the async client and joins the thread; use ``with``.
- Errors raised inside the client (``RollbackError``, ``RetryTimeoutError``...) are
  re-raised in the calling thread unchanged.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Self

import trio

from .batches import RollbackEvent, SnapshotBatch
from .client import DcpClient, Delivered
from .errors import ClientClosedError, UsageError
from .kv import DocValue, KvClient, KvItems
from .kv_results import GetResult, MutationResult
from .offset import Offset

__all__ = ["BlockingDcpClient", "BlockingKvClient"]


class _TrioThread:
    """Runs ``make()`` (an async context manager) in its own thread under ``trio.run``."""

    def __init__(self, make: Callable[[], Any], name: str) -> None:
        self._make = make
        self._name = name
        self.resource: Any = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> Any:
        self._thread = threading.Thread(target=self._target, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self.resource

    def _target(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # surfaced to the starting thread
            if self._error is None:
                self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        try:
            async with self._make() as res:
                self.resource = res
                self._token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            if not self._ready.is_set():
                self._error = exc
                return
            raise

    def call(self, afn: Callable[..., Any], *args: Any) -> Any:
        if self._closed or self._token is None:
            raise ClientClosedError("the client is closed")
        try:
            return trio.from_thread.run(afn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise ClientClosedError("the client's thread has stopped") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join()


class _Facade:
    """Enter once (starts the trio thread), close idempotently (stops and joins it)."""

    _runner: _TrioThread
    _entered: bool

    def __enter__(self) -> Self:
        if self._entered:
            raise UsageError(f"a {type(self).__name__} can only be entered once")
        self._entered = True
        self._runner.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop, close the connection and join the thread. Idempotent."""
        self._runner.close()


class BlockingDcpClient(_Facade):
    """``DcpClient`` for synchronous code. Takes exactly ``DcpClient``'s arguments.

    Example::

        with BlockingDcpClient("127.0.0.1", 11210, offset_store=store) as client:
            for batch in client:
                apply(batch)
                batch.commit()
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._client = DcpClient(*args, **kwargs)  # validates arguments now (tier 1)
        self._raw = bool(kwargs.get("raw", False))
        self._runner = _TrioThread(lambda: self._client, "dcp-consumer")
        self._ready: deque[Delivered] = deque()
        self._entered = False

    def _bind(self, item: Delivered) -> Delivered:
        if type(item) is SnapshotBatch or type(item) is RollbackEvent:
            item.commit_fn = self.commit
        return item

    def __iter__(self) -> Iterator[Delivered]:
        while True:
            item = self.getone()
            if item is None:
                return
            yield item

    def getone(self) -> Delivered | None:
        """The next batch/rollback (raw mode: event); None when every stream finished."""
        if self._raw:
            if not self._ready:
                items = self._runner.call(self._client.getmany)
                if not items:
                    return None
                self._ready.extend(items)
            return self._bind(self._ready.popleft())
        return self._bind(self._runner.call(self._client.getone))

    def getmany(self, *, timeout: float | None = None, max_items: int = 10_000) -> list[Delivered]:
        """Everything ready now (see ``DcpClient.getmany``)."""
        if self._ready:
            out = list(self._ready)
            self._ready.clear()
            return [self._bind(x) for x in out]
        items = self._runner.call(
            lambda: self._client.getmany(timeout=timeout, max_items=max_items)
        )
        return [self._bind(x) for x in items]

    def commit(
        self,
        items: SnapshotBatch
        | RollbackEvent
        | Iterable[SnapshotBatch | RollbackEvent]
        | None = None,
    ) -> bool:
        """Commit (see ``DcpClient.commit``); blocks until the offset store has saved."""
        return self._runner.call(self._client.commit, items)

    def committed(self) -> dict[int, Offset]:
        return self._client.committed()

    def statistics(self) -> dict[str, Any]:
        return self._client.statistics()


class BlockingKvClient(_Facade):
    """``KvClient`` for synchronous code. Takes exactly ``KvClient``'s arguments; the
    writes take its keyword arguments too (``durability=``, ``durable=``, ``cas=``...)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._client = KvClient(*args, **kwargs)
        self._runner = _TrioThread(lambda: self._client, "dcp-kv")
        self._entered = False

    def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self._client, method)
        return self._runner.call(lambda: fn(*args, **kwargs))

    def set(self, key: str | bytes, value: DocValue, **kw: Any) -> MutationResult:
        return self._run("set", key, value, **kw)

    def add(self, key: str | bytes, value: DocValue, **kw: Any) -> MutationResult:
        return self._run("add", key, value, **kw)

    def replace(self, key: str | bytes, value: DocValue, **kw: Any) -> MutationResult:
        return self._run("replace", key, value, **kw)

    def delete(self, key: str | bytes, **kw: Any) -> MutationResult:
        return self._run("delete", key, **kw)

    def get(self, key: str | bytes) -> GetResult:
        return self._run("get", key)

    def get_many(self, keys: Iterable[str | bytes], **kw: Any) -> dict[bytes, GetResult]:
        return self._run("get_many", list(keys), **kw)

    def set_many(self, items: KvItems, **kw: Any) -> list[MutationResult]:
        return self._run("set_many", items, **kw)

    def delete_many(self, keys: Iterable[str | bytes], **kw: Any) -> list[MutationResult]:
        return self._run("delete_many", list(keys), **kw)
