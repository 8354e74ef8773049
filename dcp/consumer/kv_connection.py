"""The connection under ``KvClient``: one socket, pipelined requests, answers matched
by opaque.

Rules of this module:
- An I/O shell over a ``ClientSession`` (``dcp.protocol.session``): ``roundtrip`` has
  the session put a batch into one buffer with a fresh opaque patched into each request
  (requests are encoded once with opaque 0: a retry re-sends the same bytes) and makes
  one ``send_all``; one reader task feeds the received bytes to the session, whose
  ``Answer`` events it routes to the waiting batch by opaque. A successful write answer
  (the bulk of pipelined writes) is a ``(cas, vb_uuid, seqno)`` tuple, any other answer
  a ``Frame``; ``Batch.others`` counts those, so a batch that only succeeded needs no
  per-answer inspection. A caller may give up on a batch's missing answers (``forget``:
  the node went silent and the map moved its vbuckets); answers that come later are
  dropped.
- The session validates every header before its body is awaited; a frame that breaks
  the protocol fails the connection. A failed connection fails every waiting batch
  (their answers become None) and every later call; ``KvClient`` decides what may be
  retried. A failure TLS itself caused (a refused client certificate) fails it with a
  ``TlsError``, which nothing retries.
- ``authenticate`` runs the SASL exchange (``security.authenticate``) right after HELLO,
  before any other request.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from dcp.protocol import events
from dcp.protocol.frames import Frame
from dcp.protocol.opcodes import Status
from dcp.protocol.session import ClientSession

from .errors import ConnectionLostError
from .security import Credentials, authenticate, closed_message, tls_failure

__all__ = ["Answer", "Batch", "KvConnection", "Op", "WriteOk"]

#: A write answered SUCCESS with nothing but a CAS: ``(cas, vb_uuid, seqno)`` (the last two
#: None without HELLO MutationSeqno). The session builds it instead of a ``Frame``.
WriteOk = tuple[int, int | None, int | None]
#: What a request is answered with; None: the connection died before the answer.
Answer = Frame | WriteOk | None


class Op:
    """One request of a batch: encoded once with opaque 0 (patched per attempt)."""

    __slots__ = ("frame", "key", "opcode", "safe_to_repeat", "vbucket")

    def __init__(
        self, opcode: int, key: bytes, vbucket: int, frame: bytes, safe_to_repeat: bool
    ) -> None:
        self.opcode = opcode
        self.key = key
        self.vbucket = vbucket
        self.frame = frame  # the encoded request, opaque 0 (patched per attempt)
        self.safe_to_repeat = safe_to_repeat


class Batch:
    """The answers to one pipelined write (``frames[i]`` answers ``ops[i]``)."""

    __slots__ = ("abandoned", "event", "frames", "opaques", "ops", "others", "remaining", "sent_at")

    def __init__(self, ops: list[Op]) -> None:
        n = len(ops)
        self.ops = ops
        self.sent_at = trio.current_time()
        self.frames: list[Answer] = [None] * n
        self.remaining = n
        self.others = 0  # answers that are not a successful write's tuple
        self.event = trio.Event()
        self.opaques: list[int] = []
        #: why the caller stopped waiting for the answers still missing (``forget``)
        self.abandoned: BaseException | None = None


class KvConnection:
    """One socket under ``KvClient`` (see the module rules)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.lock = trio.StrictFIFOLock()
        self.waiting: dict[int, tuple[Batch, int]] = {}
        self.proto = ClientSession()
        self.error: BaseException | None = None
        self.features: set[int] = set()
        self.closed = trio.Event()

    async def read_loop(self) -> None:
        try:
            receive = self.stream.receive_some
            decode = self.proto.receive_data
            waiting = self.waiting
            received = 0
            while True:
                data = await receive(256 * 1024)
                if not data:
                    raise ConnectionLostError(closed_message(self.stream, received))
                received += len(data)
                for e in decode(data):
                    if type(e) is not events.Answer:
                        continue
                    entry = waiting.pop(e.opaque, None)
                    if entry is not None:
                        batch, idx = entry
                        res: Answer = e.result
                        if type(res) is not tuple:
                            batch.others += 1
                        batch.frames[idx] = res
                        batch.remaining -= 1
                        if batch.remaining == 0:
                            batch.event.set()
        except Exception as exc:
            self.fail(
                exc
                if isinstance(exc, ConnectionLostError)
                else tls_failure(exc) or ConnectionLostError(f"connection failed: {exc!r}")
            )
        finally:
            await trio.aclose_forcefully(self.stream)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for batch, _ in self.waiting.values():
            batch.event.set()
        self.waiting.clear()
        self.closed.set()

    async def roundtrip(self, ops: list[Op]) -> list[Answer]:
        """One write for all ``ops``; their responses (None where the connection died)."""
        return (await self.roundtrip_batch(ops)).frames

    async def roundtrip_batch(self, ops: list[Op]) -> Batch:
        """``roundtrip``, returning the whole ``Batch`` (its answers and their counts)."""
        batch = await self.send_batch(ops)
        await batch.event.wait()
        return batch

    async def send_batch(self, ops: list[Op]) -> Batch:
        """Send ``ops`` in one write; their ``Batch`` is complete when its event is set."""
        if self.error is not None:
            raise self.error
        batch = Batch(ops)
        batch.opaques, buf = self.proto.pipeline([op.frame for op in ops])
        waiting = self.waiting
        for i, o in enumerate(batch.opaques):
            waiting[o] = (batch, i)
        try:
            async with self.lock:
                await self.stream.send_all(buf)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.fail(ConnectionLostError(f"send failed: {exc!r}"))
        return batch

    def forget(self, batch: Batch, why: BaseException) -> None:
        """Stop waiting for ``batch``'s missing answers (late ones are dropped); they stay
        None, and ``batch.abandoned`` says why."""
        for o in batch.opaques:
            self.waiting.pop(o, None)
        batch.abandoned = why
        batch.event.set()

    async def authenticate(self, credentials: Credentials) -> None:
        """The SASL exchange as ``credentials`` (``security.authenticate``)."""
        await authenticate(self._ask, credentials)

    async def _ask(self, build: Callable[[int], bytes]) -> tuple[int, bytes]:
        frame = build(0)  # the session patches the opaque in (see the module rules)
        (answer,) = await self.roundtrip([Op(frame[1], b"", 0, frame, False)])
        if answer is None:
            raise self.error or ConnectionLostError("no answer during authentication")
        if isinstance(answer, tuple):  # SUCCESS with nothing but a CAS (e.g. PLAIN)
            return Status.SUCCESS, b""
        return answer.status, bytes(answer.value)
